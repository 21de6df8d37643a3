"""Checkpoint conversion: Hugging Face directories and GGUF files, read here (or by
:mod:`specstream_mlx.io.gguf`) and written by the one pipeline every model directory
goes through (:func:`specstream_mlx.io.conversion.write_model_directory`: build ->
sanitize -> check shapes -> cast/quantize -> streams -> an atomic write, so a failure or
Ctrl-C never leaves a half-written model).
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Optional

import mlx.core as mx

from specstream_mlx.io.conversion import DTYPES, Source, Target, write_model_directory
from specstream_mlx.io.files import check_replaceable, check_writable, copy_tokenizer_files

__all__ = ["ConvertError", "ConvertOptions", "convert", "convert_gguf"]


class ConvertError(RuntimeError):
    """A conversion failure; the message names the file and the cause."""


@dataclass
class ConvertOptions:
    """What to produce.

    Args:
        dtype: float16, bfloat16 or float32; None keeps the checkpoint's
            ``torch_dtype`` (float16 if it names none).
        quantize: quantize Linear and Embedding weights.
        q_bits: 4 or 8. Default 4.
        q_group_size: quantization group size. Default 64.
        force: overwrite an existing destination.
        num_streams: attach this many freshly initialised (untrained)
            speculative streams; 0 attaches none.
        stream_layers: top layers running multi-stream attention.
        adapter: a PEFT LoRA adapter directory to fuse into the base.
        dequantize: GGUF only: store quantized blocks as float weights.
    """

    dtype: Optional[str] = None
    quantize: bool = False
    q_bits: int = 4
    q_group_size: int = 64
    force: bool = False
    num_streams: int = 0
    stream_layers: int = 4
    adapter: Optional[str] = None
    dequantize: bool = False


def _resolve_source(hf_path: str) -> Path:
    p = Path(hf_path).expanduser()
    if p.exists():
        if not p.is_dir():
            hint = "; GGUF files import with --gguf" if p.suffix.lower() == ".gguf" else ""
            raise ConvertError(f"{p}: not a directory{hint}")
        return p
    if hf_path.count("/") == 1 and not hf_path.startswith((".", "/", "~")):
        try:
            from huggingface_hub import snapshot_download

            return Path(
                snapshot_download(
                    hf_path,
                    allow_patterns=["*.json", "*.safetensors", "*.bin", "tokenizer.model", "*.txt", "*.jinja"],
                )
            )
        except Exception as e:  # network, auth, missing repo
            raise ConvertError(f"{hf_path}: cannot download from the Hugging Face hub ({e})") from e
    raise ConvertError(f"{hf_path}: no such directory")


def read_config(src: Path) -> dict:
    """``src/config.json``, checked, after every file of ``src`` a conversion reads is
    (regular files inside the directory, text files under their size limits)."""
    from specstream_mlx.io.limits import UnsafeFileError, check_directory_files, read_json
    from specstream_mlx.io.loading import ModelLoadError, check_config

    cfg_path = src / "config.json"
    try:
        check_directory_files(src)
        if not cfg_path.exists():
            raise ModelLoadError(f"{cfg_path}: missing config.json")
        return check_config(text_model_config(read_json(cfg_path, root=src), cfg_path), cfg_path)
    except (ModelLoadError, UnsafeFileError) as e:
        raise ConvertError(str(e)) from None


def _load_safetensors(path: str) -> Dict[str, mx.array]:
    try:
        return mx.load(path)
    except Exception as e:  # mlx raises several types on corrupt/truncated files
        raise ConvertError(f"{path}: cannot read safetensors ({e})") from e


def read_weights(src: Path) -> Dict[str, mx.array]:
    """All weights of a checkpoint: an index's shards, plain safetensors, or .bin via torch."""
    index = src / "model.safetensors.index.json"
    weights: Dict[str, mx.array] = {}
    if index.exists():
        from specstream_mlx.io.limits import UnsafeFileError, read_json

        try:
            weight_map = read_json(index)["weight_map"]
            shards = set(weight_map.values())
        except UnsafeFileError as e:
            raise ConvertError(str(e)) from None
        except (KeyError, TypeError, AttributeError) as e:
            raise ConvertError(f"{index}: invalid index (no 'weight_map' object: {e})") from None
        bad = [s for s in shards if not isinstance(s, str) or not s]
        if bad:
            raise ConvertError(f"{index}: 'weight_map' values must be file names, got {bad[0]!r}")
        for shard in sorted(shards):
            path = src / shard
            # An index names files inside its own directory, never anything else on disk.
            if not path.resolve().is_relative_to(src.resolve()):
                raise ConvertError(f"{index}: shard {shard!r} is outside the model directory")
            if not path.exists():
                raise ConvertError(f"{path}: shard listed in {index.name} is missing")
            weights.update(_load_safetensors(str(path)))
        return weights
    files = [
        f
        for f in sorted(glob.glob(str(src / "*.safetensors")))
        if not os.path.basename(f).startswith(("streams", "adapter_model"))
    ]
    if files:
        for f in files:
            weights.update(_load_safetensors(f))
        return weights
    bins = sorted(glob.glob(str(src / "pytorch_model*.bin")))
    if bins:
        return _read_torch_bins(bins)
    raise ConvertError(f"{src}: no *.safetensors or pytorch_model*.bin weights")


def _read_torch_bins(paths) -> Dict[str, mx.array]:
    try:
        import torch
    except ImportError:
        raise ConvertError(
            f"{paths[0]}: .bin checkpoints need PyTorch to read; install it "
            "(`pip install torch`) or convert the checkpoint to safetensors"
        ) from None
    import numpy as np

    weights = {}
    for p in paths:
        try:
            state = torch.load(p, map_location="cpu", weights_only=True)
        except Exception as e:
            raise ConvertError(f"{p}: cannot read PyTorch checkpoint ({e})") from e
        for k, v in state.items():
            weights[k] = mx.array(v.to(torch.float32).numpy().astype(np.float32))
    return weights


# Multimodal wrappers whose language model is one of ours: model_type -> (the text model's
# type, its class, the defaults of its config class that Hub configs leave out).
TEXT_MODELS = {
    "gemma3": (
        "gemma3_text",
        "Gemma3ForCausalLM",
        dict(
            vocab_size=262_208,
            hidden_size=2304,
            intermediate_size=9216,
            num_hidden_layers=26,
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=256,
            rms_norm_eps=1e-6,
            query_pre_attn_scalar=256,
            sliding_window=4096,
            max_position_embeddings=131_072,
        ),
    ),
}
# Where a wrapper keeps its language model's weights (transformers' saved layout, then its
# in-memory one) -> our names.
_TEXT_PREFIXES = (
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.language_model.", "model."),
    ("lm_head.", "lm_head."),
)


def text_model_config(config: dict, cfg_path: Path) -> dict:
    """A multimodal checkpoint's language-model config (Gemma 3 4B and up ship as
    ``Gemma3ForConditionalGeneration``): its ``text_config`` with the config class's defaults
    filled in, marked with where its weights are (``_text_of``); any other config as it is."""
    kind = config.get("model_type") if isinstance(config, dict) else None
    if kind not in TEXT_MODELS:
        return config
    text_type, arch, defaults = TEXT_MODELS[kind]
    text = config.get("text_config")
    if not isinstance(text, dict):
        raise ConvertError(f"{cfg_path}: model_type {kind!r} needs a 'text_config' object")
    out = {**defaults, **text, "model_type": text_type, "architectures": [arch], "_text_of": kind}
    for key in ("torch_dtype", "dtype", "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id"):
        if key in config and key not in text:
            out[key] = config[key]
    return out


def text_model_weights(config: dict, weights: Dict[str, mx.array], src: Path, log) -> Dict[str, mx.array]:
    """The language model's weights of a multimodal checkpoint, under our names (the vision
    tower and projector left out); other checkpoints' weights as they are."""
    kind = config.pop("_text_of", None)
    if kind is None:
        return weights
    kept = {}
    for name, v in weights.items():
        for old, new in _TEXT_PREFIXES:
            if name.startswith(old):
                kept[new + name[len(old) :]] = v
                break
    if not kept:
        raise ConvertError(f"{src}: no language-model weights (language_model.*) in this {kind} checkpoint")
    log(f"[convert] {kind}: the language model only ({len(weights) - len(kept)} vision weights left out)")
    return kept


def _target_dtype(config: dict, opts: ConvertOptions):
    if opts.dtype is not None:
        if opts.dtype not in DTYPES:
            raise ConvertError(f"unsupported dtype {opts.dtype!r}; choose one of {', '.join(DTYPES)}")
        return opts.dtype
    stored = config.get("torch_dtype") or config.get("dtype")
    return stored if stored in DTYPES else "float16"


def convert(
    hf_path: str,
    mlx_path: str,
    opts: Optional[ConvertOptions] = None,
    log: Callable[[str], None] = lambda s: None,
) -> Path:
    """Convert ``hf_path`` into an MLX model directory at ``mlx_path``; returns it."""
    opts = opts or ConvertOptions()
    dst = Path(mlx_path).expanduser()
    check_replaceable(dst, opts.force, ConvertError)
    check_writable(dst, ConvertError)  # before the work: its result has somewhere to go
    _check_quantize_args(opts)
    src = _resolve_source(hf_path)
    config = read_config(src)
    from specstream_mlx.io.adapters import fuse_peft_adapter
    from specstream_mlx.io.limits import UnsafeFileError, check_against_shapes

    from .hf_layout import CONFIG_KEY, split_stream_weights, streams_from_hf

    all_weights = read_weights(src)
    all_weights = text_model_weights(config, all_weights, src, log)
    try:  # before a layer is built: a config must not ask for more than its weights hold
        check_against_shapes(config, {k: tuple(v.shape) for k, v in all_weights.items()}, src / "config.json")
    except UnsafeFileError as e:
        raise ConvertError(str(e)) from None
    log(f"[convert] {src} ({config.get('model_type')})")
    sfile = (config.get(CONFIG_KEY) or {}).get("weights_file") if isinstance(config.get(CONFIG_KEY), dict) else None
    if sfile and not any(k.startswith("speculative_streaming.") for k in all_weights):
        if not (src / sfile).exists():
            raise ConvertError(f"{src / sfile}: missing (named by config.json's {CONFIG_KEY}.weights_file)")
        all_weights.update(_load_safetensors(str(src / sfile)))
    weights, stream_tensors = split_stream_weights(all_weights)
    if stream_tensors and CONFIG_KEY not in config:
        raise ConvertError(f"{src}: has speculative_streaming tensors but config.json lacks '{CONFIG_KEY}'")
    if opts.adapter:
        try:
            weights, n = fuse_peft_adapter(weights, Path(opts.adapter))
        except (ValueError, KeyError) as e:
            raise ConvertError(str(e)) from e
        log(f"[convert] fused {n} LoRA matrices from {opts.adapter}")

    def imported_streams(model):
        try:
            return streams_from_hf(model, config[CONFIG_KEY], stream_tensors, str(src))
        except (ValueError, TypeError, KeyError) as e:
            raise ConvertError(str(e)) from e

    source = Source(
        config,
        weights,
        src,
        lambda tmp: copy_tokenizer_files(src, tmp),
        streams=imported_streams if CONFIG_KEY in config else None,
    )
    return write_model_directory(source, dst, _target(opts, _target_dtype(config, opts)), ConvertError, log)


def _target(opts: ConvertOptions, dtype: Optional[str]) -> Target:
    return Target(
        dtype=dtype,
        quantize=(opts.q_bits, opts.q_group_size) if opts.quantize else None,
        dequantize=opts.dequantize,
        num_streams=opts.num_streams,
        stream_layers=opts.stream_layers,
        force=opts.force,
    )


def convert_gguf(
    gguf_path: str,
    mlx_path: str,
    opts: Optional[ConvertOptions] = None,
    log: Callable[[str], None] = lambda s: None,
) -> Path:
    """Import a llama.cpp GGUF file into an MLX model directory at ``mlx_path``; returns it
    (the file read by :func:`specstream_mlx.io.gguf.gguf_source`, written by the same
    pipeline as :func:`convert`)."""
    from specstream_mlx.io.gguf import GGUFError, gguf_source

    opts = opts or ConvertOptions()
    if opts.adapter:
        raise ConvertError("--adapter fuses into float weights; convert the GGUF first, then fuse with generate")
    if opts.dtype is not None and opts.dtype not in DTYPES:
        raise ConvertError(f"unsupported dtype {opts.dtype!r}; choose one of {', '.join(DTYPES)}")
    _check_quantize_args(opts)
    dst = Path(mlx_path).expanduser()
    check_replaceable(dst, opts.force, ConvertError)
    check_writable(dst, ConvertError)  # before the work: its result has somewhere to go
    try:
        source = gguf_source(Path(gguf_path).expanduser(), log)
    except GGUFError as e:
        raise ConvertError(str(e)) from e
    return write_model_directory(source, dst, _target(opts, opts.dtype), ConvertError, log)


def _check_quantize_args(opts: ConvertOptions) -> None:
    from specstream_mlx.io.quantization import quantize_args_error

    problem = quantize_args_error(opts.q_bits, opts.q_group_size) if opts.quantize else None
    if problem:
        raise ConvertError(problem)
