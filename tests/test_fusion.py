"""q/k/v and gate/up fused at load decode as the stored layout does, streams included."""

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from specstream_mlx.convert import ConvertOptions, convert
from specstream_mlx.io.loading import dequantize_on_cpu, load_model
from specstream_mlx.method.msa import ss_forward, stream_logits
from specstream_mlx.method.streams import StreamConfig, StreamParams, new_streams
from specstream_mlx.method.tree import Tree
from specstream_mlx.models.fusion import fuse_projections
from specstream_mlx.runtime.cache import make_cache
from specstream_mlx.runtime.loaded_model import load
from specstream_mlx.runtime.steps import prefill
from tests.helpers.hf_reference import ARCHITECTURES
from tests.test_speculative import check_exact, pretend_trained

TREE = Tree(tuple(range(20, 29)), (-1, 0, 0, 1, 1, 2, 3, 4, 5))


def _pair(hf_models, tmp_path, arch):
    """The same model twice, loaded in the stored layout; the second is then fused."""
    if arch == "llama-q":
        _, src, _ = hf_models("llama-q")
        opts = ConvertOptions(dtype="float32", quantize=True, q_bits=4, q_group_size=32)
        dst = convert(str(src), str(tmp_path / "q4"), opts)
        kw = dict(dequantize=False)  # the quantized layers themselves are fused
    else:
        _, _, dst = hf_models(arch)
        kw = {}
    return load_model(dst, **kw)[0], load_model(dst, **kw)[0]


def _pass(model, streams, prompt):
    cache = make_cache(model)
    prefill(model, prompt, cache, 512)
    out = ss_forward(model, streams, TREE, cache[0].offset, cache)
    return np.array(out.main_logits), np.array(stream_logits(model, streams, out, 4))


def assert_same_outputs(a_model, b_model, streams):
    """Logits of a 29-token batch, and a tree pass's main and stream logits after a prompt,
    agree between two models to 1e-5 relative."""
    ids = mx.array(np.random.RandomState(1).randint(3, 151, size=(2, 29)))
    a, b = np.array(a_model(ids)), np.array(b_model(ids))
    assert np.abs(a - b).max() <= 1e-5 * np.abs(a).max()
    prompt = mx.array(np.random.RandomState(2).randint(3, 151, size=17))
    (ma, sa), (mb, sb) = _pass(a_model, streams, prompt), _pass(b_model, streams, prompt)
    assert np.abs(ma - mb).max() <= 1e-5 * np.abs(ma).max()
    assert np.abs(sa - sb).max() <= 1e-5 * np.abs(sa).max()


@pytest.mark.parametrize("arch", ARCHITECTURES + ("llama-q",))
def test_fused_layers_give_the_stored_layouts_logits_and_stream_logits(hf_models, tmp_path, arch):
    plain, fused = _pair(hf_models, tmp_path, arch)
    streams = pretend_trained(new_streams(plain, StreamConfig(num_streams=3, stream_layers=2, lora_rank=4)))
    saved = fuse_projections(fused)
    if arch == "phi3":  # stored fused already: nothing to do
        assert saved == 0
        return
    n = len(fused.layers)
    assert saved == 3 * n
    assert "qkv_proj" in fused.layers[0].self_attn and "q_proj" not in fused.layers[0].self_attn
    assert "gate_up_proj" in fused.layers[0].mlp and "gate_proj" not in fused.layers[0].mlp
    # The streams' LoRA on q/k/v and gate/up reaches the parts of the fused products.
    assert_same_outputs(plain, fused, streams)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3", "llama-q"])
def test_ss_greedy_equals_ar_on_fused_layers(hf_models, tmp_path, arch):
    _, model = _pair(hf_models, tmp_path, arch)
    fuse_projections(model)
    streams = pretend_trained(new_streams(model, StreamConfig(num_streams=3, stream_layers=2, lora_rank=4)))
    check_exact(model, streams, 151, n_prompts=3, seed=11)


def test_streams_attach_to_fused_layers_with_the_parts_shapes(hf_models, tmp_path):
    plain, fused = _pair(hf_models, tmp_path, "qwen2")
    fuse_projections(fused)
    cfg = StreamConfig(num_streams=2, stream_layers=2, lora_rank=4)
    shapes = lambda sp: {k: v.shape for k, v in tree_flatten(sp.parameters())}  # noqa: E731
    want, got = shapes(StreamParams(plain, cfg)), shapes(StreamParams(fused, cfg))
    assert got == want and any("q_proj" in k for k in got) and any("gate_proj" in k for k in got)


def test_load_fuses_for_decoding_and_can_keep_the_stored_layout(tiny_model_dir):
    model, _ = load(str(tiny_model_dir), warn=False)
    assert "qkv_proj" in model.layers[0].self_attn and "gate_up_proj" in model.layers[0].mlp
    model, _ = load(str(tiny_model_dir), warn=False, fuse=False)
    assert "q_proj" in model.layers[0].self_attn and "gate_proj" in model.layers[0].mlp


def test_a_quantized_model_loads_fused_and_expanded_in_one_evaluation(tiny_model_dir, tmp_path):
    """``load`` builds a 4-bit model lazily, fuses and evaluates once (on the CPU backend its
    weights expanded to float32 as they are written): the same bits as expanding every
    weight first and fusing after."""
    opts = ConvertOptions(quantize=True, q_bits=4, q_group_size=32)
    dst = convert(str(tiny_model_dir), str(tmp_path / "q4"), opts)
    model, _ = load(str(dst), warn=False)
    reference = load_model(dst)[0]  # expanded (on this backend) and evaluated, then fused
    fuse_projections(reference)
    got, want = dict(tree_flatten(model.base.parameters())), dict(tree_flatten(reference.parameters()))
    assert got.keys() == want.keys() and any(k.endswith("qkv_proj.weight") for k in got)
    for k, v in got.items():
        assert mx.array_equal(v, want[k]).item(), k
    # Expanded where the backend has no fast 4-bit products (the CPU's), kept 4-bit elsewhere.
    qkv = got["model.layers.0.self_attn.qkv_proj.weight"]
    assert qkv.dtype == (mx.float32 if dequantize_on_cpu() else mx.uint32)
