"""A quantized model on the CPU backend decodes from its weights as stored (runtime/stored_weights.py)."""

import gc

import mlx.core as mx
import numpy as np
import pytest

from specstream_mlx.method.tree import TreeSpec
from specstream_mlx.platform_info import _symbol, skinny_kernel
from specstream_mlx.runtime import stored_weights
from specstream_mlx.runtime.loaded_model import load
from specstream_mlx.runtime.sampling import SamplingParams
from specstream_mlx.runtime.speculative import ss_steps
from specstream_mlx.runtime.steps import ar_steps
from tests.helpers import KERNEL_NOT_LOADED


def _registered() -> int:
    count = _symbol("specstream_stored_count")
    return int(count()) if count is not None else 0


def _take(steps, n):
    out = []
    while len(out) < n:
        out += next(steps).tokens
    return out[:n]


def _decode(model, prompt, n=24):
    ar = _take(ar_steps(model.base, prompt, SamplingParams()), n)
    spec = TreeSpec("dynamic", budget=4, depth=3)
    return ar, _take(ss_steps(model.base, prompt, SamplingParams(), streams=model.streams, tree=spec), n)


def test_a_quantized_model_decodes_from_its_stored_weights_with_the_same_bits(quantized_dir, monkeypatch):
    """Loaded on the CPU backend, every layer's weight and the tied head are registered with
    the product kernel, which then serves the decoding products from the stored form; the
    logits of a step are the same bits as with the float32 weights (SPECSTREAM_STORED=0), plain
    and speculative greedy decoding give the same tokens, and the registrations go with the
    model."""
    if skinny_kernel() is None:
        pytest.fail(KERNEL_NOT_LOADED)
    prompt = mx.array([5, 9, 33, 70, 12, 8, 41])
    gc.collect()
    before_count = _registered()

    monkeypatch.setenv("SPECSTREAM_STORED", "0")
    plain_model, _ = load(str(quantized_dir), warn=False)
    assert _registered() == before_count
    want_logits = np.array(plain_model.base(prompt[None])[0, -1])
    want_ar, want_ss = _decode(plain_model, prompt)
    del plain_model
    gc.collect()

    monkeypatch.delenv("SPECSTREAM_STORED")
    model, _ = load(str(quantized_dir), warn=False)
    # 4 layers x (q/k/v fused, o, gate/up fused, down) and the tied embedding as the head.
    assert _registered() == before_count + 4 * 4 + 1
    served = stored_weights.served()
    got_ar, got_ss = _decode(model, prompt)
    assert stored_weights.served() > served  # the decoding products were the kernel's
    # A prompt of 7 rows: the kernel's tiles, reading the stored form.
    got_logits = np.array(model.base(prompt[None])[0, -1])
    assert np.array_equal(got_logits.view(np.uint32), want_logits.view(np.uint32))
    assert got_ar == want_ar and got_ss == want_ss == want_ar


def test_the_registrations_go_with_the_model(quantized_dir):
    """A model dropped after decoding is collected and its weights unregistered (the kernel
    never reads a freed buffer)."""
    if skinny_kernel() is None:
        pytest.fail(KERNEL_NOT_LOADED)
    gc.collect()
    before = _registered()
    model, _ = load(str(quantized_dir), warn=False)
    assert _registered() == before + 17
    _decode(model, mx.array([5, 9, 33]), n=8)
    del model
    gc.collect()
    assert _registered() == before
