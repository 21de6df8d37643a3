"""Tiny GGUF files in llama.cpp's layout, written with ``gguf.GGUFWriter``.

What llama.cpp's converter does and this reproduces: Q/K rows of the llama family
permuted for interleaved RoPE (K with the KV head count), tensor names ``blk.N.*``,
dimensions listed fastest-first, block-quantized tensors (Q8_0/Q4_0/Q4_1), the
vocabulary as metadata (byte-level BPE tokens, merges, token types, special ids,
chat template).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np

CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "The quick brown fox jumps over the lazy dog. It's 2024, and 12345 apples cost $67.89!",
    "Speculative streaming drafts future tokens; verification keeps the output exact.",
    "café naïve über 東京 北京 привет мир 🙂🚀 — “quotes” and (parentheses) [brackets] {braces}",
    "def f(x):\n    return x * 2  # tabs\tand    spaces\n\n",
    "SELECT name FROM users WHERE age > 30 ORDER BY name LIMIT 10;",
]


def bpe_vocabulary(vocab_size: int = 420):
    """(tokens, merges) of a byte-level BPE trained on a fixed corpus, specials first."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 20, trainer)
    import json

    model = json.loads(tok.to_str())["model"]
    vocab = model["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [" ".join(m) if isinstance(m, list) else m for m in model["merges"]]
    return tokens, merges


# K-quants (256-element blocks): byte offset of each float16 field in a block and its scale,
# chosen so that the dequantized weights have magnitudes like a trained layer's (~0.1).
K_FLOAT_FIELDS = {
    "Q2_K": ((80, 2e-3), (82, 1e-3)),
    "Q3_K": ((108, 1e-3),),
    "Q4_K": ((0, 2e-4), (2, 1e-4)),
    "Q5_K": ((0, 1e-4), (2, 5e-5)),
    "Q6_K": ((208, 2e-5),),
}


def random_k_blocks(shape, kind: str, rng) -> np.ndarray:
    """Valid K-quant blocks for a float tensor of ``shape`` (rows, columns): random quants
    and sub-block scales, float16 super-block scales of a realistic size. ``gguf`` cannot
    quantize K-types, so the test's reference weights are these blocks dequantized."""
    import gguf

    qt = gguf.GGMLQuantizationType[kind]
    block, size = gguf.GGML_QUANT_SIZES[qt]
    rows, cols = shape
    assert cols % block == 0, f"{kind} needs rows of a multiple of {block} elements"
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    for offset, scale in K_FLOAT_FIELDS[kind]:
        d = (scale * (0.5 + rng.random((rows, cols // block)))).astype(np.float16)
        raw[..., offset : offset + 2] = d.view(np.uint8).reshape(rows, cols // block, 2)
    return raw.reshape(rows, -1)


def llama_cpp_unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's ``permute`` of Q/K rows (convert_hf_to_gguf.py)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@dataclass
class TinySpec:
    arch: str = "llama"
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 128
    tied: bool = True
    pre: str = "gpt2"
    add_bos: bool = False
    # GGUF type per tensor kind: "embd", "attn", "ffn", "output".
    types: Dict[str, str] = field(
        default_factory=lambda: {"embd": "Q8_0", "attn": "Q4_0", "ffn": "Q4_1", "output": "F16"}
    )
    seed: int = 0
    # Per-head width when not hidden / heads (attention.key_length); gemma3 writes it always.
    head_dim: Optional[int] = None
    # gemma3's attention.sliding_window (None: not written).
    window: Optional[int] = None
    # A SentencePiece ('llama') vocabulary (tokens, scores, types) instead of byte-level BPE.
    spm: Optional[tuple] = None
    # Metadata values written instead of the consistent ones (hostile files), by key without the arch prefix.
    overrides: Dict[str, int] = field(default_factory=dict)


def write_tiny_gguf(path: Path, spec: Optional[TinySpec] = None, tokens=None, merges=None) -> Dict[str, np.ndarray]:
    """Write a tiny model as llama.cpp would; returns its float32 weights (HF layout, pre-quantization)."""
    import gguf
    from gguf.quants import quantize

    spec = spec or TinySpec()
    if tokens is None:
        tokens, merges = bpe_vocabulary()
    rng = np.random.default_rng(spec.seed)
    h, hd = spec.hidden, spec.head_dim or spec.hidden // spec.heads
    gemma = spec.arch == "gemma3"
    w = gguf.GGUFWriter(str(path), spec.arch)
    a = spec.arch
    w.add_name("tiny")

    def size(key, value):
        w.add_uint32(f"{a}.{key}", spec.overrides.get(key, value))

    size("context_length", 256)
    size("embedding_length", h)
    size("block_count", spec.layers)
    size("feed_forward_length", spec.intermediate)
    size("attention.head_count", spec.heads)
    size("attention.head_count_kv", spec.kv_heads)
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_float32(f"{a}.rope.freq_base", 10000.0)
    w.add_uint32(f"{a}.rope.dimension_count", hd)
    w.add_uint32(f"{a}.vocab_size", len(tokens))
    if spec.arch in ("qwen3", "gemma3") or spec.head_dim:
        w.add_uint32(f"{a}.attention.key_length", hd)
        w.add_uint32(f"{a}.attention.value_length", hd)
    if spec.window is not None:
        w.add_uint32(f"{a}.attention.sliding_window", spec.window)
    if spec.spm is not None:
        tokens, scores, types = spec.spm
        w.add_tokenizer_model("llama")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types(types)
        w.add_unk_token_id(0)
        w.add_add_space_prefix(not gemma)
    else:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(spec.pre)
        w.add_token_list(tokens)
        w.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
        w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(0)
    w.add_add_bos_token(spec.add_bos)
    w.add_chat_template(CHATML)

    hf: Dict[str, np.ndarray] = {}

    def tensor(gguf_name, hf_name, shape, kind, scale=0.08, permute_heads=None, norm=False, value=None):
        x = (1.0 + 0.1 * rng.standard_normal(shape) if norm else scale * rng.standard_normal(shape)).astype(np.float32)
        if value is not None:
            x = value
        t = "F32" if norm else spec.types[kind]
        stored = llama_cpp_permute(x, permute_heads) if permute_heads else x
        if norm and gemma:  # llama.cpp stores Gemma's norms as 1 + weight
            x = x - 1.0
        if t in K_FLOAT_FIELDS:  # blocks first; the reference weights are what they hold
            from gguf.quants import dequantize

            qt = gguf.GGMLQuantizationType[t]
            blocks = random_k_blocks(shape, t, rng)
            w.add_tensor(gguf_name, blocks, raw_dtype=qt)
            stored = dequantize(blocks, qt).reshape(shape).astype(np.float32)
            hf[hf_name] = llama_cpp_unpermute(stored, permute_heads) if permute_heads else stored
            return
        if t == "F32":
            w.add_tensor(gguf_name, stored)
        elif t == "F16":
            w.add_tensor(gguf_name, stored.astype(np.float16))
        else:
            qt = gguf.GGMLQuantizationType[t]
            w.add_tensor(gguf_name, quantize(stored, qt), raw_dtype=qt)
        hf[hf_name] = x

    tensor("token_embd.weight", "model.embed_tokens.weight", (len(tokens), h), "embd", scale=0.5)
    for i in range(spec.layers):
        p, q = f"blk.{i}.", f"model.layers.{i}."
        perm = spec.arch == "llama"
        tensor(p + "attn_norm.weight", q + "input_layernorm.weight", (h,), "attn", norm=True)
        if spec.arch == "phi3":  # fused projections, as llama.cpp stores phi3
            qkv = 0.08 * rng.standard_normal(((spec.heads + 2 * spec.kv_heads) * hd, h)).astype(np.float32)
            tensor(p + "attn_qkv.weight", q + "self_attn.qkv_proj.weight", qkv.shape, "attn", value=qkv)
        else:
            for n, heads in (("q", spec.heads), ("k", spec.kv_heads)):
                tensor(
                    p + f"attn_{n}.weight",
                    q + f"self_attn.{n}_proj.weight",
                    (heads * hd, h),
                    "attn",
                    permute_heads=heads if perm else None,
                )
            tensor(p + "attn_v.weight", q + "self_attn.v_proj.weight", (spec.kv_heads * hd, h), "attn")
        if spec.arch in ("qwen3", "gemma3"):  # per-head RMSNorm of q and k
            tensor(p + "attn_q_norm.weight", q + "self_attn.q_norm.weight", (hd,), "attn", norm=True)
            tensor(p + "attn_k_norm.weight", q + "self_attn.k_norm.weight", (hd,), "attn", norm=True)
        if spec.arch == "qwen2":
            for n, rows in (("q", spec.heads * hd), ("k", spec.kv_heads * hd), ("v", spec.kv_heads * hd)):
                x = (0.05 * rng.standard_normal(rows)).astype(np.float32)
                w.add_tensor(p + f"attn_{n}.bias", x)
                hf[q + f"self_attn.{n}_proj.bias"] = x
        tensor(p + "attn_output.weight", q + "self_attn.o_proj.weight", (h, spec.heads * hd), "attn")
        if gemma:  # the attention output and the MLP input and output are normed too
            tensor(p + "post_attention_norm.weight", q + "post_attention_layernorm.weight", (h,), "attn", norm=True)
            tensor(p + "ffn_norm.weight", q + "pre_feedforward_layernorm.weight", (h,), "ffn", norm=True)
            tensor(p + "post_ffw_norm.weight", q + "post_feedforward_layernorm.weight", (h,), "ffn", norm=True)
        else:
            tensor(p + "ffn_norm.weight", q + "post_attention_layernorm.weight", (h,), "ffn", norm=True)
        if spec.arch == "phi3":  # gate and up in one matrix, gate first
            gate_up = 0.08 * rng.standard_normal((2 * spec.intermediate, h)).astype(np.float32)
            tensor(p + "ffn_up.weight", q + "mlp.gate_up_proj.weight", gate_up.shape, "ffn", value=gate_up)
        else:
            tensor(p + "ffn_gate.weight", q + "mlp.gate_proj.weight", (spec.intermediate, h), "ffn")
            tensor(p + "ffn_up.weight", q + "mlp.up_proj.weight", (spec.intermediate, h), "ffn")
        tensor(p + "ffn_down.weight", q + "mlp.down_proj.weight", (h, spec.intermediate), "ffn")
    tensor("output_norm.weight", "model.norm.weight", (h,), "output", norm=True)
    if not spec.tied:
        tensor("output.weight", "lm_head.weight", (len(tokens), h), "output")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hf


def texts() -> List[str]:
    """Text with spaces, digits, punctuation, emoji and non-Latin script."""
    return [
        "Hello world",
        "  leading spaces and   runs of spaces  ",
        "It's 2024: 12345 apples cost $67.89 (not 1,000.5)!",
        "café naïve über — “quotes”, [brackets] and {braces}; ok?",
        "東京 北京 привет мир 🙂🚀 emoji",
        "def f(x):\n\treturn x * 2\n\n",
        "<|im_start|>user\nhi<|im_end|>",
    ]


def spm_vocabulary(tmp_dir: Path, vocab_size: int = 400):
    """(tokens, scores, types, sentencepiece processor) of a SentencePiece BPE model with
    byte fallback trained on the fixed corpus, in llama.cpp's token types."""
    import sentencepiece as spm

    corpus = Path(tmp_dir) / "corpus.txt"
    corpus.write_text("\n".join(CORPUS * 20) + "\n", encoding="utf-8")
    prefix = str(Path(tmp_dir) / "spm")
    spm.SentencePieceTrainer.train(
        input=str(corpus),
        model_prefix=prefix,
        vocab_size=vocab_size,
        model_type="bpe",
        byte_fallback=True,
        character_coverage=1.0,
        # as Llama's tokenizer: no normalization, whitespace runs kept
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        minloglevel=2,
    )
    sp = spm.SentencePieceProcessor(model_file=prefix + ".model")
    tokens, scores, types = [], [], []
    for i in range(sp.get_piece_size()):
        tokens.append(sp.id_to_piece(i))
        scores.append(sp.get_score(i))
        # llama.cpp: 1 normal, 2 unknown, 3 control, 6 byte
        types.append(2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i) else 1)
    return tokens, scores, types, sp


def write_spm_gguf(path: Path, tokens, scores, types) -> None:
    """A tiny llama with a SentencePiece-style ('llama') vocabulary."""
    import gguf

    rng = np.random.default_rng(1)
    h, layers, heads = 64, 1, 4
    w = gguf.GGUFWriter(str(path), "llama")
    for key, v in (
        ("context_length", 256),
        ("embedding_length", h),
        ("block_count", layers),
        ("feed_forward_length", 128),
        ("attention.head_count", heads),
        ("attention.head_count_kv", heads),
        ("vocab_size", len(tokens)),
    ):
        w.add_uint32(f"llama.{key}", v)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    for name, shape in (
        ("token_embd.weight", (len(tokens), h)),
        ("output_norm.weight", (h,)),
        ("blk.0.attn_norm.weight", (h,)),
        ("blk.0.ffn_norm.weight", (h,)),
        ("blk.0.attn_q.weight", (h, h)),
        ("blk.0.attn_k.weight", (h, h)),
        ("blk.0.attn_v.weight", (h, h)),
        ("blk.0.attn_output.weight", (h, h)),
        ("blk.0.ffn_gate.weight", (128, h)),
        ("blk.0.ffn_up.weight", (128, h)),
        ("blk.0.ffn_down.weight", (h, 128)),
    ):
        w.add_tensor(name, (0.1 * rng.standard_normal(shape)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
