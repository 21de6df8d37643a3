"""Attention's composed form computes what MLX's fused call does; which one decodes is measured."""

import json

import mlx.core as mx
import numpy as np
import pytest

import specstream_mlx.models.base as base
import specstream_mlx.runtime.attention_choice as choice
from specstream_mlx.io.loading import load_model
from specstream_mlx.method.streams import StreamConfig, new_streams
from specstream_mlx.models.attention import composed_attention, fused_attention
from specstream_mlx.runtime.attention_choice import (
    Forms,
    HeadLayout,
    attention_form,
    choose_attention,
    faster_forms,
    measured_forms,
    set_attention_form,
)
from specstream_mlx.runtime.cache import make_cache
from specstream_mlx.runtime.loaded_model import load
from specstream_mlx.runtime.plain_step import plain_step
from tests.helpers.hf_reference import ARCHITECTURES
from tests.test_fusion import assert_same_outputs
from tests.test_speculative import check_exact


def _masks(B, H, L, S, rng):
    sees_itself = mx.arange(S)[None] == mx.arange(S - L, S)[:, None]  # every query sees a key
    rand = lambda shape: mx.array(rng.rand(*shape) > 0.4) | sees_itself  # noqa: E731

    def every_row(shape):  # one row of keys for all queries (the last key always seen)
        m = rng.rand(*shape) > 0.4
        m[..., -1] = True
        return mx.array(m)

    return [
        None,
        "causal",
        rand((L, S)),
        rand((B, 1, L, S)),
        rand((B, H, L, S)),
        rand((1, L, S)),
        every_row((1, S)),
        every_row((B, H, 1, S)),  # per head, the same for every row
        every_row((B, 1, 1, S)),
        mx.array(rng.randn(L, S).astype(np.float32)),  # added to the scores
        mx.array(rng.randn(B, H, 1, S).astype(np.float32)),
    ]


# The last two: causal queries in blocks (models/attention.CAUSAL_BLOCK), after a cached
# prefix and with a short last block, and just past the size that splits them.
SHAPES = [
    (1, 9, 3, 1, 137, 64),
    (1, 9, 3, 13, 150, 64),
    (2, 4, 4, 5, 5, 16),
    (2, 8, 2, 7, 30, 32),
    (1, 9, 3, 200, 230, 64),
    (2, 4, 2, 97, 97, 16),
]


@pytest.mark.parametrize("B,H,Hkv,L,S,D", SHAPES)
def test_composed_attention_equals_mlx_fused_attention(B, H, Hkv, L, S, D):
    rng = np.random.RandomState(L)
    q, k, v = (mx.array(rng.randn(B, h, n, D).astype(np.float32)) for h, n in ((H, L), (Hkv, S), (Hkv, S)))
    for mask in _masks(B, H, L, S, rng):
        want = np.array(fused_attention(q, k, v, D**-0.5, mask))
        got = np.array(composed_attention(q, k, v, D**-0.5, mask))
        what = mask if mask is None or isinstance(mask, str) else (mask.shape, mask.dtype)
        assert np.abs(got - want).max() < 1e-5, what


def test_composed_attention_ignores_what_masked_keys_hold():
    """Masked keys within the span may hold anything a rejected draft left (huge scores
    included): the softmax's largest score is taken over the keys a query sees."""
    rng = np.random.RandomState(0)
    q = mx.array(rng.randn(1, 4, 3, 16).astype(np.float32))
    k = rng.randn(1, 2, 10, 16).astype(np.float32)
    v = mx.array(rng.randn(1, 2, 10, 16).astype(np.float32))
    mask = mx.arange(10)[None] <= mx.array([[5], [6], [7]])  # keys 8 and 9 hidden from every row
    want = np.array(fused_attention(q, mx.array(k), v, 0.25, mask))
    k[:, :, 8:] = 1e4  # scores of ~1e5 on hidden keys
    got = np.array(composed_attention(q, mx.array(k), v, 0.25, mask))
    assert np.isfinite(got).all() and np.abs(got - want).max() < 1e-5


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_a_model_gives_the_same_logits_and_ss_equals_ar_with_composed_attention(hf_models, arch):
    """Prompts, tree passes with streams and sliding windows (gemma3) agree with the fused
    form; greedy ss (composed in its passes) still equals ar."""
    _, _, dst = hf_models(arch)
    fused, _ = load_model(dst)
    composed, _ = load_model(dst)
    set_attention_form(composed, "composed")
    assert attention_form(fused) == "fused" and attention_form(composed) == "composed"
    streams = new_streams(fused, StreamConfig(num_streams=3, stream_layers=2, lora_rank=4))
    assert_same_outputs(fused, composed, streams)
    check_exact(composed, streams, 151, n_prompts=3, seed=5)


def test_one_query_row_takes_its_own_form(hf_models, monkeypatch):
    """A plain step (one row) attends with the one-row form, several rows with theirs; a
    compiled plain step traced before a change is traced again."""
    _, _, dst = hf_models("llama")
    model, _ = load_model(dst)
    called = []
    real = base.attention_fn
    monkeypatch.setattr(base, "attention_fn", lambda form: called.append(form) or real(form))
    for forms in (Forms("composed", "fused"), Forms("fused", "composed")):
        set_attention_form(model, forms)
        called.clear()
        model(mx.array([[5]]))
        assert set(called) == {forms.one_row}
        called.clear()
        model(mx.array([[5, 6, 7]]))
        assert set(called) == {forms.rows}
    assert attention_form(model) == "fused, one row composed"
    cache = make_cache(model)
    model(mx.array([[5, 6, 7]]), cache=cache)
    called.clear()
    plain_step(model)(mx.array([8]), cache)
    assert called == ["composed"] * len(model.layers)  # traced with the one-row form
    set_attention_form(model, "fused")
    called.clear()
    plain_step(model)(mx.array([9]), cache)
    assert called == ["fused"] * len(model.layers)  # traced again


def test_one_row_composed_attention_in_a_compiled_step_equals_fused():
    """The one-row form as a plain step runs it (compiled, a (1, S) mask hiding the
    buffer's unwritten rows) and with every mask shape."""
    rng = np.random.RandomState(3)
    B, H, Hkv, S, D = 1, 9, 3, 128, 64
    q, k, v = (mx.array(rng.randn(B, h, n, D).astype(np.float32)) for h, n in ((H, 1), (Hkv, S), (Hkv, S)))
    k = mx.where(mx.arange(S)[:, None] < 70, k, 1e4)  # rows past the offset hold anything
    mask = (mx.arange(S) <= 69)[None]
    step = mx.compile(lambda q, k, v, m: composed_attention(q, k, v, D**-0.5, m))
    want = np.array(fused_attention(q, k[:, :, :70], v[:, :, :70], D**-0.5, None))  # the written rows alone
    assert np.abs(np.array(step(q, k, v, mask)) - want).max() < 1e-5


def test_faster_forms_take_composed_only_when_clearly_faster():
    assert faster_forms({1: {"fused": 6.0, "composed": 4.4}, 9: {"fused": 6.0, "composed": 4.4}}) == Forms.both(
        "composed"
    )
    assert faster_forms({1: {"fused": 6.0, "composed": 5.9}, 9: {"fused": 6.0, "composed": 4.4}}) == Forms(
        "composed",
        "fused",  # one row within the noise
    )
    assert faster_forms({1: {"fused": 6.0, "composed": 4.4}, 9: {"fused": 1.0, "composed": 2.5}}) == Forms(
        "fused",
        "composed",  # several rows: MLX's kernel
    )
    assert faster_forms({9: {"fused": 6.0, "composed": 4.4}}) == Forms("composed", "fused")  # one row not timed


def test_the_measured_forms_are_stored_and_reused(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSTREAM_MLX_CACHE", str(tmp_path))
    layout = HeadLayout(heads=4, kv_heads=2, head_dim=16, layers=2, dtype="mlx.core.float32")
    calls = []

    def measure(lay, form):
        calls.append(lay)
        return {r: {"fused": 1.0, "composed": 0.5 if form == "composed" else 2.0} for r in (1, 9)}

    assert measured_forms(layout, lambda lay: measure(lay, "composed")) == Forms.both("composed")
    assert measured_forms(layout, lambda lay: measure(lay, "fused")) == Forms.both("composed")  # stored
    assert len(calls) == 1
    stored = json.loads((tmp_path / "attention.json").read_text())
    (entry,) = stored.values()
    assert entry["form"] == entry["one_row"] == "composed" and entry["layout"]["heads"] == 4
    assert entry["ms"]["9"]["fused"] == entry["ms"]["1"]["fused"] == 1000.0
    other = HeadLayout(heads=8, kv_heads=2, head_dim=16, layers=2, dtype="mlx.core.float32")
    assert measured_forms(other, lambda lay: measure(lay, "fused")) == Forms.both("fused")  # another layout
    assert len(calls) == 2
    (tmp_path / "attention.json").write_text("{not json")  # a damaged store: measured again
    assert measured_forms(layout, lambda lay: measure(lay, "fused")) == Forms.both("fused")
    table = json.loads((tmp_path / "attention.json").read_text())
    for entry in table.values():
        del entry["one_row"]  # a verdict stored before one row was measured: measured again
    (tmp_path / "attention.json").write_text(json.dumps(table))
    assert measured_forms(layout, lambda lay: measure(lay, "composed")) == Forms.both("composed")
    assert len(calls) == 4


def test_the_time_forms_measurement_runs_on_a_small_layout():
    layout = HeadLayout(heads=4, kv_heads=2, head_dim=16, layers=2, dtype="mlx.core.float32")
    times = choice.time_forms(layout, reps=1)
    assert set(times) == set(choice.ROWS) and all(t["fused"] > 0 and t["composed"] > 0 for t in times.values())


def test_the_setting_picks_the_form_and_a_bad_one_is_named(tiny_model_dir, monkeypatch):
    monkeypatch.setenv("SPECSTREAM_ATTENTION", "composed")
    sm, _ = load(str(tiny_model_dir), warn=False)
    assert attention_form(sm.base) == "composed"
    sm, _ = load(str(tiny_model_dir), warn=False, attention="fused")  # the argument wins
    assert attention_form(sm.base) == "fused"
    monkeypatch.setenv("SPECSTREAM_ATTENTION", "fast")
    with pytest.raises(ValueError, match="SPECSTREAM_ATTENTION='fast' is not one of: auto, fused, composed"):
        choose_attention(sm.base)
    monkeypatch.setenv("SPECSTREAM_ATTENTION", "auto")
    monkeypatch.setattr(choice, "measured_forms", lambda layout: Forms("composed", "fused"))
    monkeypatch.setattr(choice, "q8_products", lambda: 0)  # float32 products (SPECSTREAM_PRODUCTS=exact)
    assert choose_attention(sm.base) == Forms("composed", "fused")
    # With integer activations on (16-bit, the default, or 8-bit), one form for both: a pass's
    # rows must reach every product as a plain step's bits to round to its codes
    # (docs/DESIGN.md decision 46).
    for planes in (2, 1):
        monkeypatch.setattr(choice, "q8_products", lambda planes=planes: planes)
        assert choose_attention(sm.base) == Forms.both("composed")
    monkeypatch.setattr(choice, "q8_products", lambda: None)  # a CPU without them
    assert choose_attention(sm.base) == Forms("composed", "fused")


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_every_architecture_gets_a_measured_form(hf_models, tmp_path, monkeypatch, arch):
    """The measurement runs on each architecture's head layout (gemma3's head size too)."""
    monkeypatch.setenv("SPECSTREAM_MLX_CACHE", str(tmp_path))
    _, _, dst = hf_models(arch)
    model, _ = load_model(dst)
    forms = choose_attention(model, "auto")
    (entry,) = json.loads((tmp_path / "attention.json").read_text()).values()
    # with integer activations on (the default where the product kernel serves) one form for both
    want = Forms.both(entry["form"]) if choice.q8_products() else Forms(entry["form"], entry["one_row"])
    assert forms == want
    layout = entry["layout"]
    assert (layout["heads"], layout["head_dim"]) == (model.args.num_attention_heads, model.args.head_dim)
