"""Which attention form a loaded model decodes with: measured once per machine and head layout.

MLX's fused attention kernel is one launch where the device has it; where it has none the
same call is composed at graph-building time around MLX's own softmax
(:mod:`specstream_mlx.models.attention`). Which of the two forms is faster is a fact of the
device and the build, so it is measured, not inferred from the device's name, for each of
the two ways a model attends: several query rows (a tree pass, a prompt: nine rows, op by op
as a pass runs) and one row (a plain step: compiled, as :mod:`.plain_step` runs it), both
over 128 cached keys, once per layer of the model, the forms interleaved; ``composed`` is
taken where it is clearly faster. The verdicts are kept in ``attention.json`` in the user
cache, under what they depend on (MLX's version, the device, how MLX's CPU kernels are
built, the heads, the dtype, the forms' version), so a model loads without measuring again.

``SPECSTREAM_ATTENTION`` = ``fused`` | ``composed`` (both ways) | ``auto`` (the default: measured).
"""

from __future__ import annotations

import hashlib
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Optional, Union

import mlx.core as mx

from ..cpu_jit import jit_words
from ..io.files import cache_root, read_cache_table, write_cache_table
from ..models.attention import FORMS, FORMS_VERSION, attention_fn
from ..platform_info import q8_products
from ..settings import current as current_settings
from .plain_step import forget_plain_step

SETTING = "SPECSTREAM_ATTENTION"
# composed is taken where it takes at most this share of fused's time: a measurement's
# noise must not flip a model between forms from one process to the next.
MARGIN = 0.95
# Query rows timed: a plain step, and a tree pass of a budget-8 tree.
ROWS = (1, 9)
CONTEXT = 128
REPS = 7


@dataclass(frozen=True)
class HeadLayout:
    """What an attention call's cost depends on, besides the device."""

    heads: int
    kv_heads: int
    head_dim: int
    layers: int
    dtype: str

    @classmethod
    def of(cls, model) -> "HeadLayout":
        a = model.args
        dtype = str(model.model.norm.weight.dtype)
        return cls(a.num_attention_heads, a.num_key_value_heads, a.head_dim, a.num_hidden_layers, dtype)


@dataclass(frozen=True)
class Forms:
    """The form a model attends with for several query rows and for one."""

    rows: str
    one_row: str

    @classmethod
    def both(cls, form: str) -> "Forms":
        return cls(form, form)

    def label(self) -> str:
        return self.rows if self.rows == self.one_row else f"{self.rows}, one row {self.one_row}"


def set_attention_form(model, forms: Union[str, Forms]) -> None:
    """Every layer of ``model`` attends with ``forms`` (a form name: both ways). Its compiled
    plain step is traced again; compiled tree passes traced earlier keep their form."""
    forms = Forms.both(forms) if isinstance(forms, str) else forms
    for form in (forms.rows, forms.one_row):
        attention_fn(form)  # an unknown form is refused here
    for layer in model.layers:
        layer.self_attn.attention_form = forms.rows
        layer.self_attn.one_row_form = forms.one_row
    forget_plain_step(model)


def attention_form(model) -> str:
    """The forms ``model`` attends with, in words (one name where both ways agree)."""
    attn = model.layers[0].self_attn
    return Forms(attn.attention_form, attn.one_row_form).label()


def configured_form() -> str:
    """``SPECSTREAM_ATTENTION``, checked: a form, or ``auto``."""
    value = current_settings().attention
    if value != "auto" and value not in FORMS:
        raise ValueError(f"{SETTING}={value!r} is not one of: auto, {', '.join(FORMS)}")
    return value


def _store_file() -> Path:
    return cache_root() / "attention.json"


def _key(layout: HeadLayout) -> str:
    ident = [mx.__version__, str(mx.default_device()), jit_words(), *vars(layout).values(), FORMS_VERSION]
    return hashlib.sha1(json.dumps(ident).encode()).hexdigest()[:16]


def time_forms(layout: HeadLayout, reps: int = REPS) -> Dict[int, Dict[str, float]]:
    """Median seconds of ``layout.layers`` attention calls per form, per row count (the forms
    interleaved, one warm-up each). One row is timed compiled, as a plain step runs it."""
    dtype = getattr(mx, layout.dtype.split(".")[-1])
    hd, scale = layout.head_dim, layout.head_dim**-0.5
    out = {}
    for rows in ROWS:
        keys = CONTEXT + rows
        shape = lambda heads, n: (layout.layers, 1, heads, n, hd)  # noqa: E731
        q = mx.random.normal(shape(layout.heads, rows)).astype(dtype)
        k = mx.random.normal(shape(layout.kv_heads, keys)).astype(dtype)
        v = mx.random.normal(shape(layout.kv_heads, keys)).astype(dtype)
        mask = mx.arange(keys)[None] <= mx.arange(CONTEXT, keys)[:, None]
        mx.eval(q, k, v, mask)
        calls = {}
        for form in FORMS:

            def layers(q, k, v, mask, fn=attention_fn(form)):  # one call a layer
                return [fn(q[i], k[i], v[i], scale, mask) for i in range(len(q))]

            calls[form] = mx.compile(layers) if rows == 1 else layers
        runs: Dict[str, list] = {f: [] for f in FORMS}

        def run(form: str, q=q, k=k, v=v, mask=mask, calls=calls) -> float:
            t = time.perf_counter()
            mx.eval(calls[form](q, k, v, mask))
            return time.perf_counter() - t

        for form in FORMS:
            run(form)  # warm-up: MLX builds (and compiles) its kernels once per process (or machine)
        for _ in range(reps):
            for form in FORMS:
                runs[form].append(run(form))
        out[rows] = {f: statistics.median(ts) for f, ts in runs.items()}
    return out


def faster_forms(times: Dict[int, Dict[str, float]]) -> Forms:
    """For one row and for several: ``composed`` where it takes at most ``MARGIN`` of
    ``fused``'s time at every row count of that kind timed; else MLX's own ``fused``."""

    def faster(counts) -> str:
        counts = list(counts)
        if counts and all(times[r]["composed"] <= MARGIN * times[r]["fused"] for r in counts):
            return "composed"
        return "fused"

    return Forms(faster(r for r in times if r > 1), faster(r for r in times if r == 1))


def measured_forms(
    layout: HeadLayout, measure: Callable[[HeadLayout], Dict[int, Dict[str, float]]] = time_forms
) -> Forms:
    """The stored verdict for ``layout`` on this machine, else a new measurement (stored)."""
    key = _key(layout)
    table = read_cache_table(_store_file())
    entry = table.get(key)
    if isinstance(entry, dict) and entry.get("form") in FORMS and entry.get("one_row") in FORMS:
        return Forms(entry["form"], entry["one_row"])
    times = measure(layout)
    forms = faster_forms(times)
    table[key] = {
        "form": forms.rows,
        "one_row": forms.one_row,
        "layout": vars(layout),
        "ms": {str(r): {f: round(s * 1e3, 4) for f, s in t.items()} for r, t in times.items()},
    }
    write_cache_table(_store_file(), table, indent=1)
    return forms


def choose_attention(model, setting: Optional[str] = None) -> Forms:
    """The forms ``model`` should decode with: ``setting`` (default ``SPECSTREAM_ATTENTION``),
    or where that is ``auto``, the measured ones."""
    setting = setting or configured_form()
    if setting != "auto":
        return Forms.both(setting)
    forms = measured_forms(HeadLayout.of(model))
    if forms.rows != forms.one_row and q8_products():
        # Integer activations (8- or 16-bit) round a pass's rows to a plain step's codes only where the rows
        # reach each product as the step's bits, which takes one attention form for both
        # (docs/DESIGN.md decision 46): otherwise greedy ss parts from ar at near-ties.
        return Forms.both(forms.rows)
    return forms
