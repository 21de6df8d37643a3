"""Which attention form a loaded model decodes with: measured once per machine and head layout.

MLX's fused attention kernel is one launch where the device has it; where it has none the
same call is composed at graph-building time around MLX's own softmax
(:mod:`specstream_mlx.models.attention`). Which of the two forms is faster is a fact of the
device and the build, so it is measured, not inferred from the device's name: both forms
attend, once per layer of the model, for nine query rows (a tree pass) over 128 cached keys,
interleaved, and ``composed`` is taken only where it is clearly faster. It serves queries of
several rows (tree passes, prompts); a single row (a plain step) always takes the fused call:
there the softmax is a few hundred exponentials per layer and the composed form's extra
operations cost more than it saves (``ar`` 1.05x slower with it in
``examples/attention_ab.py``). The verdict is kept in ``attention.json`` in the user cache, under
what it depends on (MLX's version, the device, how MLX's CPU kernels are built, the heads,
the dtype), so a model loads without measuring again.

``SPECSTREAM_ATTENTION`` = ``fused`` | ``composed`` | ``auto`` (the default: measured).
"""

from __future__ import annotations

import hashlib
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Optional

import mlx.core as mx

from ..cpu_jit import jit_words
from ..io.files import cache_root, read_cache_table, write_cache_table
from ..models.attention import FORMS, attention_fn
from ..settings import current as current_settings

SETTING = "SPECSTREAM_ATTENTION"
# composed is taken where it takes at most this share of fused's time: a measurement's
# noise must not flip a model between forms from one process to the next.
MARGIN = 0.95
# Query rows timed: a tree pass of a budget-8 tree.
ROWS = (9,)
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


def set_attention_form(model, form: str) -> None:
    """Every layer of ``model`` attends with ``form``; before it decodes (compiled graphs
    traced earlier keep the form they were traced with)."""
    attention_fn(form)  # an unknown form is refused here
    for layer in model.layers:
        layer.self_attn.attention_form = form


def attention_form(model) -> str:
    """The form ``model`` attends with."""
    return model.layers[0].self_attn.attention_form


def configured_form() -> str:
    """``SPECSTREAM_ATTENTION``, checked: a form, or ``auto``."""
    value = current_settings().attention
    if value != "auto" and value not in FORMS:
        raise ValueError(f"{SETTING}={value!r} is not one of: auto, {', '.join(FORMS)}")
    return value


def _store_file() -> Path:
    return cache_root() / "attention.json"


def _key(layout: HeadLayout) -> str:
    ident = [mx.__version__, str(mx.default_device()), jit_words(), *vars(layout).values()]
    return hashlib.sha1(json.dumps(ident).encode()).hexdigest()[:16]


def time_forms(layout: HeadLayout, reps: int = REPS) -> Dict[int, Dict[str, float]]:
    """Median seconds of ``layout.layers`` attention calls per form, per row count (the forms
    interleaved, one warm-up each)."""
    dtype = getattr(mx, layout.dtype.split(".")[-1])
    hd, scale = layout.head_dim, layout.head_dim**-0.5
    out = {}
    for rows in ROWS:
        keys = CONTEXT + rows
        q = mx.random.normal((1, layout.heads, rows, hd)).astype(dtype)
        k = mx.random.normal((1, layout.kv_heads, keys, hd)).astype(dtype)
        v = mx.random.normal((1, layout.kv_heads, keys, hd)).astype(dtype)
        mask = mx.arange(keys)[None] <= mx.arange(CONTEXT, keys)[:, None]
        mx.eval(q, k, v, mask)
        runs: Dict[str, list] = {f: [] for f in FORMS}

        def run(form: str, q=q, k=k, v=v, mask=mask) -> float:
            fn = attention_fn(form)
            t = time.perf_counter()
            mx.eval([fn(q, k, v, scale, mask) for _ in range(layout.layers)])
            return time.perf_counter() - t

        for form in FORMS:
            run(form)  # warm-up: MLX builds its compiled kernels once per process (or machine)
        for _ in range(reps):
            for form in FORMS:
                runs[form].append(run(form))
        out[rows] = {f: statistics.median(ts) for f, ts in runs.items()}
    return out


def faster_form(times: Dict[int, Dict[str, float]]) -> str:
    """``composed`` where it takes at most ``MARGIN`` of ``fused``'s time at every row count
    timed; else MLX's own ``fused``."""
    if all(t["composed"] <= MARGIN * t["fused"] for t in times.values()):
        return "composed"
    return "fused"


def measured_form(layout: HeadLayout, measure: Callable[[HeadLayout], Dict[int, Dict[str, float]]] = time_forms) -> str:
    """The stored verdict for ``layout`` on this machine, else a new measurement (stored)."""
    key = _key(layout)
    table = read_cache_table(_store_file())
    entry = table.get(key)
    if isinstance(entry, dict) and entry.get("form") in FORMS:
        return entry["form"]
    times = measure(layout)
    form = faster_form(times)
    table[key] = {
        "form": form,
        "layout": vars(layout),
        "ms": {str(r): {f: round(s * 1e3, 4) for f, s in t.items()} for r, t in times.items()},
    }
    write_cache_table(_store_file(), table, indent=1)
    return form


def choose_attention(model, setting: Optional[str] = None) -> str:
    """The form ``model`` should decode with: ``setting`` (default ``SPECSTREAM_ATTENTION``),
    or where that is ``auto``, the measured one."""
    setting = setting or configured_form()
    if setting != "auto":
        return setting
    return measured_form(HeadLayout.of(model))
