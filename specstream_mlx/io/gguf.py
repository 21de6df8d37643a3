"""GGUF import: a llama.cpp file -> the config, weights and tokenizer of an MLX model directory.

What is notable here:

* ``mx.load`` reads GGUF natively and returns Q4_0, Q4_1 and Q8_0 tensors as MLX
  affine quantization (group size 32: ``weight`` packed in uint32, ``scales``,
  ``biases``), so they stay 4/8-bit on a Mac GPU. Files holding other tensor types
  (K-quants, Q5_0/Q5_1, IQ*) are dequantized exactly with the ``gguf`` package's
  reference dequantizers, and the block-quantized weights among them are requantized to
  MLX affine quantization at the nearest width (:data:`REQUANT_BITS`; group size by
  measured error), unless float weights are asked for.
* llama.cpp permutes the rows of the llama family's ``attn_q``/``attn_k`` for its
  interleaved RoPE; :func:`unpermute_rows` undoes it (for K with the KV head count)
  on packed weights, scales and biases alike, since quantization groups run along a row.
* The tokenizer is rebuilt from the metadata as a ``tokenizers`` ``tokenizer.json``:
  byte-level BPE (``gpt2``: tokens, merges, llama.cpp's pre-tokenizer name) and
  SentencePiece-style BPE (``llama``: tokens, scores, byte fallback).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import mlx.core as mx
import numpy as np

from .quantization import REQUANT_BITS, quantization_entry

GROUP_SIZE = 32  # every GGUF block format MLX reads has 32-element blocks
NATIVE_TYPES = {"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q8_0"}
FLOAT_TYPES = {"F32", "F16", "BF16", "F64"}

# general.architecture -> our model_type. Mistral models are stored as 'llama'.
ARCHITECTURES = {
    "llama": "llama",
    "mistral": "mistral",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "phi3": "phi3",
    "gemma3": "gemma3_text",
}
PERMUTED_QK = {"llama", "mistral"}

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Gemma 3 norms every sub-layer's input and output: llama.cpp's ffn_norm is its pre-MLP norm.
_GEMMA3_NAMES = {
    **_LAYER_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# llama.cpp's Gemma 3 defaults where the file is silent (llama-model.cpp): every sixth
# layer global, the local layers' RoPE base.
GEMMA3_PATTERN = 6
GEMMA3_LOCAL_BASE = 10000.0
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# Tensors llama.cpp stores that a Hugging Face checkpoint computes instead.
_DERIVED = {"rope_freqs", "rope_factors_long", "rope_factors_short"}


class GGUFError(ValueError):
    """A GGUF file this converter cannot import; the message names the file and the key."""


@dataclass
class GGUFCheckpoint:
    """What a GGUF file holds, in the layout of an MLX model directory.

    Attributes:
        config: ``config.json`` (Hugging Face keys; ``quantization`` when tensors stay quantized).
        weights: Hugging Face parameter names -> arrays (quantized ones as weight/scales/biases).
        tokenizer_files: file name -> JSON object (``tokenizer.json``, ``tokenizer_config.json``, ...).
        chat_template: the template text, or None.
        notes: one-line remarks for the user (dequantized types, tokenizer fall-backs).
        dequantized: module path -> GGUF block type, for weights dequantized on reading.
    """

    config: Dict[str, Any]
    weights: Dict[str, mx.array]
    tokenizer_files: Dict[str, Any]
    chat_template: Optional[str] = None
    notes: List[str] = field(default_factory=list)
    dequantized: Dict[str, str] = field(default_factory=dict)


def _scalar(v):
    if isinstance(v, mx.array):
        return v.item() if v.ndim == 0 else v.tolist()
    return v


def read_tensors(path: Path) -> Tuple[Dict[str, mx.array], Dict[str, Any], List[str]]:
    """(tensors, metadata, notes) of a GGUF file, natively or dequantized with ``gguf``."""
    return _read_tensors(path, _tensor_types(path))


def _read_tensors(path: Path, types: Dict[str, str]) -> Tuple[Dict[str, mx.array], Dict[str, Any], List[str]]:
    foreign = sorted({t for t in types.values() if t not in NATIVE_TYPES})
    try:
        tensors, metadata = mx.load(str(path), return_metadata=True)
    except Exception as e:  # mlx raises RuntimeError/ValueError on truncated or foreign files
        if not foreign:
            raise GGUFError(f"{path}: cannot read GGUF ({e})") from e
        tensors, metadata = None, None
    notes = []
    if foreign:
        tensors = _dequantized_tensors(path)
        notes.append(
            f"tensor types {', '.join(foreign)} are not MLX formats: all {len(types)} tensors dequantized "
            "exactly (gguf's reference dequantizers)"
        )
        if metadata is None:
            metadata = _metadata_with_gguf(path)
    return tensors, {k: _scalar(v) for k, v in metadata.items()}, notes


def _reader(path: Path):
    try:
        import gguf
    except ImportError as e:  # a runtime dependency; only a broken install lacks it
        raise GGUFError(f"{path}: reading GGUF needs the 'gguf' package (pip install gguf)") from e
    try:
        return gguf.GGUFReader(str(path))
    except Exception as e:  # truncated header, bad magic, short tensor data
        raise GGUFError(f"{path}: cannot read GGUF ({type(e).__name__}: {e})") from e


def _tensor_types(path: Path) -> Dict[str, str]:
    """Tensor name -> GGUF type name, after checking that every tensor's bytes (as its type
    and shape need them) lie inside the file and before the next tensor's: a shape that
    disagrees with the bytes stored would otherwise be read from its neighbour's data."""
    tensors = sorted(_reader(path).tensors, key=lambda t: t.data_offset)
    size = path.stat().st_size
    out = {}
    for i, t in enumerate(tensors):
        kind = getattr(t.tensor_type, "name", None)
        if kind is None:
            raise GGUFError(f"{path}: tensor '{t.name}' has an unknown quantization type ({t.tensor_type})")
        end = tensors[i + 1].data_offset if i + 1 < len(tensors) else size
        if t.data_offset + t.n_bytes > end:
            shape = tuple(int(d) for d in reversed(t.shape))
            raise GGUFError(
                f"{path}: tensor '{t.name}' ({kind}): its shape {shape} needs {t.n_bytes:,} bytes, "
                f"but {max(end - t.data_offset, 0):,} are stored"
            )
        out[t.name] = kind
    return out


def _dequantized_tensors(path: Path) -> Dict[str, mx.array]:
    from gguf.quants import dequantize

    out = {}
    for t in _reader(path).tensors:
        shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dimensions fastest-first
        kind = t.tensor_type.name
        try:
            arr = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
        except NotImplementedError:
            raise GGUFError(f"{path}: tensor '{t.name}': quantization type {kind} cannot be read") from None
        except ValueError as e:  # the bytes do not hold whole blocks of this shape
            raise GGUFError(
                f"{path}: tensor '{t.name}' ({kind}): {t.data.nbytes} bytes do not hold its shape {shape} ({e})"
            ) from None
        out[t.name] = mx.array(arr)
    return out


def _metadata_with_gguf(path: Path) -> Dict[str, Any]:
    import gguf

    out = {}
    for name, f in _reader(path).fields.items():
        if name.startswith("GGUF."):
            continue
        kind = f.types[0] if f.types else None
        if kind == gguf.GGUFValueType.ARRAY:
            sub = f.types[-1]
            vals = [f.parts[i] for i in f.data]
            if sub == gguf.GGUFValueType.STRING:
                out[name] = [bytes(v).decode("utf-8", errors="replace") for v in vals]
            else:
                out[name] = [v.tolist()[0] for v in vals]
        elif kind == gguf.GGUFValueType.STRING:
            out[name] = bytes(f.parts[f.data[0]]).decode("utf-8", errors="replace")
        else:
            out[name] = f.parts[f.data[0]].tolist()[0]
    return out


def unpermute_rows(w: mx.array, n_head: int) -> mx.array:
    """Undo llama.cpp's ``permute`` of Q/K rows (interleaved -> half-split RoPE layout)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_name(name: str, model_type: str = "llama") -> Optional[str]:
    """The Hugging Face name of a GGUF tensor (``.scales``/``.biases`` kept); None if the
    name is not one of the layout's."""
    stem, _, suffix = name.rpartition(".")
    if suffix not in ("weight", "bias", "scales", "biases"):
        return None
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)", stem)
    if m:
        mapped = (_GEMMA3_NAMES if model_type == "gemma3_text" else _LAYER_NAMES).get(m.group(2))
        return None if mapped is None else f"model.layers.{m.group(1)}.{mapped}.{suffix}"
    mapped = _GLOBAL_NAMES.get(stem)
    return None if mapped is None else f"{mapped}.{suffix}"


def _f32(v) -> float:
    """A float32 metadata value as the decimal it was written from (9.99999975e-06 -> 1e-05)."""
    return float(f"{float(v):.7g}")


def _get(metadata: Dict[str, Any], key: str, path: Path, default=None, required=True):
    if key in metadata:
        return metadata[key]
    if required and default is None:
        raise GGUFError(f"{path}: missing metadata key '{key}'")
    return default


def _count(metadata: Dict[str, Any], key: str, path: Path, default=None, bound: Optional[str] = None) -> int:
    """A size from the metadata: a positive integer under the config limit ``bound`` names."""
    from .limits import CONFIG_BOUNDS

    v = _get(metadata, key, path, default)
    if isinstance(v, (bool, float)) or not isinstance(v, (int, np.integer)) or int(v) < 1:
        raise GGUFError(f"{path}: metadata key '{key}' must be a positive integer, got {v!r}")
    hi = CONFIG_BOUNDS.get(bound or "")
    if hi is not None and int(v) > hi:
        raise GGUFError(f"{path}: metadata key '{key}' is {int(v):,}, above the limit of {hi:,}")
    return int(v)


def hf_config(metadata: Dict[str, Any], tensors: Dict[str, mx.array], path: Path) -> Dict[str, Any]:
    """config.json for the architecture a GGUF's metadata describes."""
    arch = metadata.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFError(
            f"{path}: general.architecture {arch!r} is not supported; supported: {', '.join(ARCHITECTURES)}"
        )
    p = f"{arch}."
    heads = _count(metadata, p + "attention.head_count", path, bound="num_attention_heads")
    hidden = _count(metadata, p + "embedding_length", path, bound="hidden_size")
    tokens = metadata.get("tokenizer.ggml.tokens")
    if p + "vocab_size" not in metadata and not tokens:
        raise GGUFError(f"{path}: missing metadata key '{p}vocab_size' (and no tokenizer.ggml.tokens)")
    vocab = _count(metadata, p + "vocab_size", path, len(tokens) if tokens else None, bound="vocab_size")
    cfg: Dict[str, Any] = {
        "model_type": ARCHITECTURES[arch],
        "architectures": [
            {
                "llama": "LlamaForCausalLM",
                "mistral": "MistralForCausalLM",
                "qwen2": "Qwen2ForCausalLM",
                "qwen3": "Qwen3ForCausalLM",
                "phi3": "Phi3ForCausalLM",
                "gemma3": "Gemma3ForCausalLM",
            }[arch]
        ],
        "hidden_size": hidden,
        "intermediate_size": _count(metadata, p + "feed_forward_length", path, bound="intermediate_size"),
        "num_hidden_layers": _count(metadata, p + "block_count", path, bound="num_hidden_layers"),
        "num_attention_heads": heads,
        "num_key_value_heads": _count(metadata, p + "attention.head_count_kv", path, heads, "num_key_value_heads"),
        "vocab_size": int(vocab),
        "rms_norm_eps": _f32(_get(metadata, p + "attention.layer_norm_rms_epsilon", path, 1e-5)),
        "rope_theta": _f32(_get(metadata, p + "rope.freq_base", path, 10000.0)),
        "tie_word_embeddings": "output.weight" not in tensors,
    }
    if metadata.get(p + "context_length"):
        cfg["max_position_embeddings"] = _count(metadata, p + "context_length", path, bound="max_position_embeddings")
    key_len = (
        _count(metadata, p + "attention.key_length", path, bound="head_dim")
        if metadata.get(p + "attention.key_length")
        else None
    )
    if key_len and int(key_len) != hidden // heads:
        cfg["head_dim"] = int(key_len)
    head_dim = int(key_len or hidden // heads)
    rot = metadata.get(p + "rope.dimension_count")
    if rot and int(rot) != head_dim:
        cfg["partial_rotary_factor"] = int(rot) / head_dim
    if arch == "qwen2":
        cfg["attention_bias"] = False  # q/k/v biases are implied by the architecture
    if arch == "phi3" and metadata.get(p + "attention.sliding_window"):
        cfg["sliding_window"] = int(metadata[p + "attention.sliding_window"])
    if arch == "gemma3":
        cfg.update(_gemma3_config(metadata, path, cfg, head_dim))
    kind = metadata.get(p + "rope.scaling.type")
    if kind == "linear":
        cfg["rope_scaling"] = {
            "type": "linear",
            "rope_type": "linear",
            "factor": float(metadata[p + "rope.scaling.factor"]),
        }
    elif kind not in (None, "none"):
        raise GGUFError(f"{path}: '{p}rope.scaling.type' {kind!r} is not supported; supported: linear")
    if "rope_freqs.weight" in tensors:
        cfg["rope_scaling"] = _llama3_scaling(tensors["rope_freqs.weight"], cfg, head_dim, path)
    for key in ("rope_factors_long.weight", "rope_factors_short.weight"):
        if key in tensors:
            raise GGUFError(f"{path}: tensor '{key}' (LongRoPE) is not supported")
    for name, key in (
        ("bos_token_id", "bos_token_id"),
        ("eos_token_id", "eos_token_id"),
        ("pad_token_id", "padding_token_id"),
    ):
        v = metadata.get(f"tokenizer.ggml.{key}")
        if v is not None:
            cfg[name] = int(v)
    return cfg


def _gemma3_config(metadata: Dict[str, Any], path: Path, cfg: Dict[str, Any], head_dim: int) -> Dict[str, Any]:
    """What a Gemma 3 config adds, as llama.cpp reads the same file: the window (required),
    which layers are local, the local RoPE base, and the score scale (1/sqrt(head_dim),
    except the 62-layer 27B's 1/sqrt(hidden/heads))."""
    p = "gemma3."
    layers = cfg["num_hidden_layers"]
    pattern = metadata.get(p + "attention.sliding_window_pattern", GEMMA3_PATTERN)
    if isinstance(pattern, list):  # per layer: true where the layer is local
        if len(pattern) != layers:
            raise GGUFError(f"{path}: '{p}attention.sliding_window_pattern' has {len(pattern)} entries for {layers}")
        kinds = ["sliding_attention" if bool(x) else "full_attention" for x in pattern]
    else:
        n = _count(metadata, p + "attention.sliding_window_pattern", path, GEMMA3_PATTERN)
        kinds = ["sliding_attention" if (i + 1) % n else "full_attention" for i in range(layers)]
    scalar = cfg["hidden_size"] // cfg["num_attention_heads"] if layers == 62 else head_dim
    return {
        "head_dim": head_dim,  # always written: the architecture's default (256) is not the file's
        "sliding_window": _count(metadata, p + "attention.sliding_window", path, bound="max_position_embeddings"),
        "layer_types": kinds,
        "rope_local_base_freq": _f32(metadata.get(p + "rope.freq_base_swa", GEMMA3_LOCAL_BASE)),
        "query_pre_attn_scalar": scalar,
    }


def _llama3_scaling(freqs: mx.array, cfg: dict, head_dim: int, path: Path) -> dict:
    """Llama 3.1+ stores its RoPE frequency factors as a tensor; recover the config that
    produces them (Llama 3's published low/high frequency factors and original context)
    and refuse a file whose factors it does not reproduce."""
    from ..models.base import _llama3_freqs

    factors = np.asarray(freqs.astype(mx.float32))
    scaling = {
        "rope_type": "llama3",
        "type": "llama3",
        "factor": float(factors.max()),
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    plain = cfg["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    got = np.asarray(_llama3_freqs(head_dim, cfg["rope_theta"], scaling).astype(mx.float32)) / plain
    if got.shape != factors.shape or not np.allclose(got, factors, rtol=1e-3):
        raise GGUFError(f"{path}: tensor 'rope_freqs.weight' does not match Llama 3 RoPE scaling; not supported")
    return scaling


def _quantized_bits(weights: Dict[str, mx.array], name: str) -> int:
    packed = weights[name + ".weight"].shape[-1]
    in_dims = weights[name + ".scales"].shape[-1] * GROUP_SIZE
    return packed * 32 // in_dims


def convert_tensors(tensors: Dict[str, mx.array], cfg: Dict[str, Any], path: Path) -> Dict[str, mx.array]:
    """GGUF tensors -> Hugging Face names, Q/K rows un-permuted for the llama family."""
    out: Dict[str, mx.array] = {}
    for name, v in tensors.items():
        if name.rpartition(".")[0] in _DERIVED:
            continue  # read into the config (RoPE factors), not a parameter
        hf = _hf_name(name, cfg["model_type"])
        if hf is None:
            raise GGUFError(f"{path}: unexpected tensor '{name}' for architecture {cfg['model_type']}")
        if cfg["model_type"] == "gemma3_text" and hf.endswith("norm.weight"):
            v = v - 1.0  # llama.cpp stores Gemma's 1 + weight; HF (and the model) the weight
        out[hf] = v
    if cfg["model_type"] in PERMUTED_QK:
        for i in range(cfg["num_hidden_layers"]):
            for proj, n in (("q_proj", cfg["num_attention_heads"]), ("k_proj", cfg["num_key_value_heads"])):
                for suffix in ("weight", "scales", "biases", "bias"):
                    key = f"model.layers.{i}.self_attn.{proj}.{suffix}"
                    if key in out:
                        out[key] = unpermute_rows(out[key], n)
    if cfg["model_type"] == "phi3":
        # llama.cpp calls phi3's fused gate_up projection ffn_up.
        for k in [k for k in out if ".mlp.up_proj." in k]:
            out[k.replace(".mlp.up_proj.", ".mlp.gate_up_proj.")] = out.pop(k)
    return out


def stored_quantization(weights: Dict[str, mx.array]) -> Optional[Dict[str, Any]]:
    """The entry for weights as stored (GGUF blocks: group size 32, bits from the packing)."""
    names = [k[: -len(".scales")] for k in weights if k.endswith(".scales")]
    return quantization_entry({n: (GROUP_SIZE, _quantized_bits(weights, n)) for n in names})


def read_gguf(path: Path) -> GGUFCheckpoint:
    """Everything :func:`~specstream_mlx.convert.converter.convert` needs from a GGUF file."""
    path = Path(path)
    if not path.is_file():
        raise GGUFError(f"{path}: no such file")
    from .limits import UnsafeFileError, check_against_shapes

    types = _tensor_types(path)
    tensors, metadata, notes = _read_tensors(path, types)
    cfg = hf_config(metadata, tensors, path)
    weights = convert_tensors(tensors, cfg, path)
    dequantized = {}
    if any(t not in NATIVE_TYPES for t in types.values()):  # every tensor was read as float
        for name, kind in types.items():
            hf = _hf_name(name, cfg["model_type"])
            if kind in REQUANT_BITS and hf is not None and hf.endswith(".weight"):
                module = hf[: -len(".weight")]
                if cfg["model_type"] == "phi3":
                    module = module.replace(".mlp.up_proj", ".mlp.gate_up_proj")
                dequantized[module] = kind
    try:  # before anything is built from the metadata
        check_against_shapes(cfg, {k: tuple(v.shape) for k, v in weights.items()}, path)
    except UnsafeFileError as e:
        raise GGUFError(str(e)) from None
    q = stored_quantization(weights)
    if q is not None:
        cfg["quantization"] = q
    from .gguf_tokenizer import GGUFTokenizerError, tokenizer_files

    try:
        files, template, tok_notes = tokenizer_files(metadata, path)
    except GGUFTokenizerError as e:
        raise GGUFError(str(e)) from e
    return GGUFCheckpoint(cfg, weights, files, template, notes + tok_notes, dequantized)


def write_tokenizer(ckpt: GGUFCheckpoint, dst: Path) -> None:
    for name, obj in ckpt.tokenizer_files.items():
        with open(Path(dst) / name, "w", encoding="utf-8") as f:
            json.dump(obj, f, ensure_ascii=False, indent=1 if name != "tokenizer.json" else None)
    if ckpt.chat_template is not None:
        (Path(dst) / "chat_template.jinja").write_text(ckpt.chat_template, encoding="utf-8")


def gguf_source(path: Path, log=lambda s: None):
    """The file as a :class:`~.conversion.Source` (what the one conversion pipeline writes)."""
    from .conversion import Source

    ckpt = read_gguf(Path(path))
    config = ckpt.config
    shape = f"{config['model_type']}, {config['num_hidden_layers']} layers, vocab {config['vocab_size']:,}"
    log(f"[convert] {path} ({shape})")
    for note in ckpt.notes:
        log(f"[convert] note: {note}")
    return Source(
        config,
        ckpt.weights,
        Path(path),
        lambda dst: write_tokenizer(ckpt, dst),
        shapes_from="the metadata",
        dequantized=ckpt.dequantized,
    )
