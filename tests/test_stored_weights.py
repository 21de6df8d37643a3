"""A quantized model on the CPU backend decodes from its weights as stored (runtime/stored_weights.py)."""

import gc

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

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


def test_a_quantized_model_decodes_from_its_stored_weights_with_the_same_bits(
    quantized_dir, monkeypatch, float32_products
):
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


def test_the_draft_heads_rows_are_read_as_stored_with_the_same_bits(quantized_dir, tmp_path, float32_products):
    """Streams with a draft vocabulary: their head (the LM head's rows of those entries,
    read twice a pass) is registered with the model's weights; its products are served from
    the stored rows and give the full head's logits at those entries bit for bit; it goes
    with the model too."""
    import shutil

    from specstream_mlx.bench.machine import weight_bytes
    from specstream_mlx.method.streams import save_streams

    if skinny_kernel() is None:
        pytest.fail(KERNEL_NOT_LOADED)
    model_dir = tmp_path / "m"
    shutil.copytree(quantized_dir, model_dir)
    model, _ = load(str(model_dir), warn=False)
    step_bytes = weight_bytes(model.base)
    ids = np.array([7, 3, 90, 41, 5, 66, 12, 200, 1, 33, 150, 77, 2, 9, 120, 60, 250, 18, 44, 99])
    model.streams.use_draft_vocab(model.base, ids)
    save_streams(model.streams, model_dir)
    del model
    gc.collect()
    before = _registered()
    model, _ = load(str(model_dir), warn=False)
    assert model.streams.draft_head.form is not None
    assert _registered() == before + 4 * 4 + 1 + 1  # the layers, the tied head, the draft head
    reg = stored_weights.registration(model.base)
    assert (reg.weights, reg.extra) == (17, 1)
    assert weight_bytes(model.base) == step_bytes  # a plain step does not read the draft head
    h = mx.array(np.random.default_rng(0).standard_normal((1, 3, 160)).astype(np.float32))
    served = stored_weights.served()
    got = np.array(model.streams.draft_logits(model.base, h))
    assert stored_weights.served() == served + 1
    want = np.array(model.base.lm_logits(h))[..., ids]
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    del model
    gc.collect()
    assert _registered() == before


def test_float16_scales_are_read_as_float16_with_the_same_bits(tmp_path, monkeypatch, float32_products):
    """A model quantized from float16 weights (as a GGUF file's Q4_1/Q8_0 tensors: scales and
    biases float16) registers every weight with float16 copies of them: a step reads the codes
    and 2 bytes a scale and a bias (not 4), and its logits and greedy decoding are the bits of the
    float32 weights'. A model with float32 scales (the fixture's) keeps reading float32 ones."""
    from specstream_mlx.bench.machine import weight_bytes
    from specstream_mlx.convert import ConvertOptions, convert
    from specstream_mlx.demo.tiny import make_tiny_model_dir

    if skinny_kernel() is None:
        pytest.fail(KERNEL_NOT_LOADED)
    dims = dict(hidden_size=160, intermediate_size=320, num_attention_heads=5, num_key_value_heads=1)
    src = make_tiny_model_dir(tmp_path / "src", **dims)
    opts = ConvertOptions(dtype="float16", quantize=True, q_bits=4, q_group_size=32, num_streams=2, stream_layers=1)
    path = convert(str(src), str(tmp_path / "q4"), opts)
    prompt = mx.array([5, 9, 33, 70, 12, 8, 41])

    monkeypatch.setenv("SPECSTREAM_STORED", "0")
    plain, _ = load(str(path), warn=False)
    want = np.array(plain.base(prompt[None])[0, -1])
    want_ar, _ = _decode(plain, prompt, n=12)
    del plain
    gc.collect()
    monkeypatch.delenv("SPECSTREAM_STORED")

    model, _ = load(str(path), warn=False)
    reg = stored_weights.registration(model.base)
    assert reg.weights == 17 and reg.half == 17
    # Every registered weight: codes (4 bits) plus a float16 scale and bias per group of 32.
    packed = sum(n * k // 2 + 2 * 2 * n * (k // 32) for n, k in _registered_shapes(model.base))
    assert reg.stored_bytes == packed
    assert (
        weight_bytes(model.base)
        == sum(v.nbytes for _, v in tree_flatten(model.base.parameters())) - reg.float_bytes + packed
    )
    got = np.array(model.base(prompt[None])[0, -1])
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    got_ar, got_ss = _decode(model, prompt, n=12)
    assert got_ar == want_ar and got_ss == want_ar


def test_float32_scales_stay_float32(quantized_dir):
    """A model quantized from float32 weights has scales that are not float16 values: the kernel
    keeps reading its float32 scales and biases (4 bytes each a group)."""
    if skinny_kernel() is None:
        pytest.fail(KERNEL_NOT_LOADED)
    model, _ = load(str(quantized_dir), warn=False)
    reg = stored_weights.registration(model.base)
    assert reg.weights == 17 and reg.half == 0
    packed = sum(n * k // 2 + 2 * 4 * n * (k // 32) for n, k in _registered_shapes(model.base))
    assert reg.stored_bytes == packed


def _registered_shapes(base):
    """(n, k) of every weight a model registers: its Linear layers and its head (tied: the embedding)."""
    import mlx.nn as nn

    return [m.weight.shape for _, m in base.named_modules() if isinstance(m, (nn.Linear, nn.Embedding))]
