"""Checkpoint conversion: load -> sanitize -> check shapes -> cast/quantize -> save.

The output is written into a temporary sibling directory and renamed into place
at the end, so a failure or Ctrl-C never leaves a half-written model.
"""

from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..io.files import atomic_directory, check_replaceable, copy_tokenizer_files
from ..method.streams import StreamConfig, new_streams, save_streams
from ..models import UnsupportedModelError, build_model

DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}


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
    from ..io.limits import UnsafeFileError, check_directory_files
    from ..io.loading import ModelLoadError, load_config

    try:
        check_directory_files(src)
        return load_config(src)
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
        from ..io.limits import UnsafeFileError, read_json

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


def check_shapes(model: nn.Module, weights: Dict[str, mx.array], src: Path) -> None:
    expected = dict(tree_flatten(model.parameters()))
    missing = sorted(set(expected) - set(weights))
    extra = sorted(set(weights) - set(expected))
    if missing:
        raise ConvertError(f"{src}: checkpoint lacks {len(missing)} weights, e.g. {missing[:3]}")
    if extra:
        raise ConvertError(f"{src}: checkpoint has {len(extra)} unexpected weights, e.g. {extra[:3]}")
    for k, v in weights.items():
        if tuple(v.shape) != tuple(expected[k].shape):
            raise ConvertError(
                f"{src}: shape mismatch for {k}: checkpoint {tuple(v.shape)}, "
                f"config.json implies {tuple(expected[k].shape)}"
            )


def legacy_rope_keys(config: dict) -> dict:
    """Top-level ``rope_theta`` / ``rope_scaling`` / ``partial_rotary_factor`` for a
    config that keeps them under ``rope_parameters`` (transformers >= 5): readers
    that predate that key (mlx-lm among them) would otherwise silently fall back
    to a default RoPE base and produce garbage."""
    rp = config.get("rope_parameters")
    if not isinstance(rp, dict):
        return {}
    if "full_attention" in rp or "sliding_attention" in rp:
        return _layered_rope_keys(config, rp)
    out = {}
    if "rope_theta" in rp and "rope_theta" not in config:
        out["rope_theta"] = rp["rope_theta"]
    if rp.get("partial_rotary_factor") is not None and "partial_rotary_factor" not in config:
        out["partial_rotary_factor"] = rp["partial_rotary_factor"]
    scaling = {k: v for k, v in rp.items() if k not in ("rope_theta", "partial_rotary_factor")}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind != "default" and config.get("rope_scaling") is None:
        out["rope_scaling"] = {**scaling, "rope_type": kind, "type": kind}
    return out


def _layered_rope_keys(config: dict, rp: dict) -> dict:
    """The same for a config with RoPE parameters per layer kind (gemma3): the global
    layers' base and scaling, the local layers' base, and the layer pattern as the one
    integer older readers take, when the layer kinds follow one."""
    full, local = rp.get("full_attention") or {}, rp.get("sliding_attention") or {}
    out = {}
    if "rope_theta" in full and "rope_theta" not in config:
        out["rope_theta"] = full["rope_theta"]
    if "rope_theta" in local and "rope_local_base_freq" not in config:
        out["rope_local_base_freq"] = local["rope_theta"]
    scaling = {k: v for k, v in full.items() if k != "rope_theta"}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind != "default" and config.get("rope_scaling") is None:
        out["rope_scaling"] = {**scaling, "rope_type": kind, "type": kind}
    kinds = config.get("layer_types")
    if isinstance(kinds, list) and "full_attention" in kinds and "sliding_window_pattern" not in config:
        p = kinds.index("full_attention") + 1
        if kinds == ["sliding_attention" if (i + 1) % p else "full_attention" for i in range(len(kinds))]:
            out["sliding_window_pattern"] = p
    return out


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
    _check_quantize_args(opts)
    src = _resolve_source(hf_path)
    config = read_config(src)
    from ..io.adapters import fuse_peft_adapter
    from ..io.limits import UnsafeFileError, check_against_shapes
    from .hf_layout import CONFIG_KEY, split_stream_weights, streams_from_hf

    all_weights = read_weights(src)
    try:  # before a layer is built: a config must not ask for more than its weights hold
        check_against_shapes(config, {k: tuple(v.shape) for k, v in all_weights.items()}, src / "config.json")
    except UnsafeFileError as e:
        raise ConvertError(str(e)) from None
    try:
        model = build_model(config)
    except UnsupportedModelError as e:
        raise ConvertError(f"{src / 'config.json'}: {e}") from e
    except (TypeError, KeyError) as e:
        raise ConvertError(f"{src / 'config.json'}: incomplete config ({e})") from e
    log(f"[convert] {src} ({config['model_type']})")
    sfile = (config.get(CONFIG_KEY) or {}).get("weights_file") if isinstance(config.get(CONFIG_KEY), dict) else None
    if sfile and not any(k.startswith("speculative_streaming.") for k in all_weights):
        if not (src / sfile).exists():
            raise ConvertError(f"{src / sfile}: missing (named by config.json's {CONFIG_KEY}.weights_file)")
        all_weights.update(_load_safetensors(str(src / sfile)))
    weights, stream_tensors = split_stream_weights(all_weights)
    weights = model.sanitize(weights)
    check_shapes(model, weights, src)
    if opts.adapter:
        try:
            weights, n = fuse_peft_adapter(weights, Path(opts.adapter))
        except (ValueError, KeyError) as e:
            raise ConvertError(str(e)) from e
        log(f"[convert] fused {n} LoRA matrices from {opts.adapter}")
    dtype_name = _target_dtype(config, opts)
    dtype = DTYPES[dtype_name]
    weights = {k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v for k, v in weights.items()}
    model.load_weights(list(weights.items()), strict=True)
    out_config = {k: v for k, v in config.items() if k not in ("quantization_config", CONFIG_KEY)}
    out_config["torch_dtype"] = dtype_name
    out_config.update(legacy_rope_keys(config))
    if opts.quantize:
        quantize_or_refuse(model, opts.q_bits, opts.q_group_size, log, ConvertError)
        out_config["quantization"] = {"group_size": opts.q_group_size, "bits": opts.q_bits}
    streams = None
    if CONFIG_KEY in config:
        try:
            streams = streams_from_hf(model, config[CONFIG_KEY], stream_tensors, str(src))
        except (ValueError, TypeError, KeyError) as e:
            raise ConvertError(str(e)) from e
        log(
            f"[convert] imported {streams.num_streams} speculative streams "
            f"({'trained' if streams.config.trained else 'untrained'})"
        )
        if opts.num_streams:
            log("[convert] --num-streams ignored: the checkpoint has its own streams")
    elif stream_tensors:
        raise ConvertError(f"{src}: has speculative_streaming tensors but config.json lacks '{CONFIG_KEY}'")
    elif opts.num_streams > 0:
        if not 1 <= opts.stream_layers <= len(model.layers):
            raise ConvertError(f"--stream-layers must be in 1..{len(model.layers)}, got {opts.stream_layers}")
        streams = new_streams(model, StreamConfig(num_streams=opts.num_streams, stream_layers=opts.stream_layers))
        log(
            f"[convert] attached {opts.num_streams} untrained streams in the top {opts.stream_layers} layers "
            f"({streams.extra_parameters():,} extra parameters); train them with `specstream-mlx train`"
        )
    _write_atomically(dst, model, out_config, src, opts.force, streams)
    log(f"[convert] wrote {dst}")
    return dst


def convert_gguf(
    gguf_path: str,
    mlx_path: str,
    opts: Optional[ConvertOptions] = None,
    log: Callable[[str], None] = lambda s: None,
) -> Path:
    """Import a llama.cpp GGUF file into an MLX model directory at ``mlx_path``; returns it
    (:func:`specstream_mlx.io.gguf.import_gguf` with this converter's options and errors)."""
    from ..io.gguf import GGUFError, GGUFImport, import_gguf

    opts = opts or ConvertOptions()
    if opts.adapter:
        raise ConvertError("--adapter fuses into float weights; convert the GGUF first, then fuse with generate")
    if opts.dtype is not None and opts.dtype not in DTYPES:
        raise ConvertError(f"unsupported dtype {opts.dtype!r}; choose one of {', '.join(DTYPES)}")
    _check_quantize_args(opts)
    how = GGUFImport(
        dtype=opts.dtype,
        quantize=(opts.q_bits, opts.q_group_size) if opts.quantize else None,
        num_streams=opts.num_streams,
        stream_layers=opts.stream_layers,
        force=opts.force,
        dequantize=opts.dequantize,
    )
    try:
        return import_gguf(Path(gguf_path).expanduser(), Path(mlx_path).expanduser(), how, log)
    except GGUFError as e:
        raise ConvertError(str(e)) from e


def _check_quantize_args(opts: ConvertOptions) -> None:
    from ..io.quantization import quantize_args_error

    problem = quantize_args_error(opts.q_bits, opts.q_group_size) if opts.quantize else None
    if problem:
        raise ConvertError(problem)


def quantize_or_refuse(model: nn.Module, bits: int, group_size: int, log, error) -> None:
    """Quantize what ``group_size`` divides and say what was left float; refuse (``error``)
    when it divides no layer's width, rather than write a quantization entry for nothing."""
    from ..io.quantization import quantize_float_layers

    log(f"[convert] quantizing to {bits} bits, group size {group_size}")
    n, left = quantize_float_layers(model, bits, group_size)
    if n == 0 and left:
        widths = sorted({int(m.weight.shape[-1]) for p, m in model.named_modules() if p in set(left)})
        raise error(
            f"--q-group-size {group_size} divides none of this model's input widths "
            f"({', '.join(map(str, widths[:6]))}): nothing would be quantized; choose a group size that divides them"
        )
    if left:
        log(f"[convert] left {len(left)} layers float: their widths are not multiples of {group_size} (e.g. {left[0]})")


def _write_model(tmp: Path, model: nn.Module, config: dict, streams=None) -> None:
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
    with open(tmp / "config.json", "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    if streams is not None:
        save_streams(streams, tmp)


def _write_atomically(dst: Path, model: nn.Module, config: dict, src: Path, force: bool, streams=None) -> None:
    with atomic_directory(dst, force, ConvertError) as tmp:
        _write_model(tmp, model, config, streams)
        copy_tokenizer_files(src, tmp)
