"""One pipeline from a checkpoint as read to an MLX model directory.

build -> sanitize -> check shapes -> load -> cast -> dequantize / requantize / quantize ->
streams -> atomic write. ``convert`` (Hugging Face directories and GGUF files) and the
bundled-model builder all write through :func:`write_model_directory`, so a conversion
rule (the quantization entry, the config keys older readers need, the atomic write) is
written once; the readers only say what a source holds (:class:`Source`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, Optional, Tuple, Type

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..method.streams import MAX_STREAMS, StreamConfig, StreamParams, new_streams, save_streams
from ..models import UnsupportedModelError, build_model
from .files import atomic_directory

DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}
# Keys of a source's config that describe the source, not the directory written.
SOURCE_KEYS = ("quantization", "quantization_config", "speculative_streaming")


@dataclass
class Source:
    """A checkpoint as a reader found it.

    Attributes:
        config: ``config.json`` (Hugging Face keys; ``quantization`` when weights are stored quantized).
        weights: Hugging Face parameter names -> arrays.
        where: the file or directory, named in every message.
        write_tokenizer: writes the tokenizer files into a directory.
        shapes_from: what the expected shapes come from, for messages ("config.json").
        dequantized: module path -> GGUF block type, for weights read as float from blocks.
        streams: builds the checkpoint's own streams for the built model (None: it has none).
    """

    config: dict
    weights: Dict[str, mx.array]
    where: Path
    write_tokenizer: Callable[[Path], None]
    shapes_from: str = "config.json"
    dequantized: Dict[str, str] = field(default_factory=dict)
    streams: Optional[Callable[[nn.Module], StreamParams]] = None


@dataclass
class Target:
    """What to write.

    Args:
        dtype: float16, bfloat16 or float32 for every floating tensor; None keeps each as stored.
        quantize: (bits, group size) for the float Linear/Embedding weights; None leaves them.
        dequantize: store quantized weights as float (``dtype``, float16 unless given).
        num_streams: attach this many untrained streams when the source has none (0: none).
        stream_layers: top layers with multi-stream attention.
        force: replace an existing destination.
    """

    dtype: Optional[str] = None
    quantize: Optional[Tuple[int, int]] = None
    dequantize: bool = False
    num_streams: int = 0
    stream_layers: int = 4
    force: bool = False


def write_model_directory(
    src: Source, dst: Path, target: Target, error: Type[Exception], log: Callable[[str], None] = lambda s: None
) -> Path:
    """Write ``src`` as an MLX model directory at ``dst`` (atomically); returns ``dst``.
    Every failure is one ``error`` naming the source (or the option) and the cause."""
    from .quantization import QuantizationConfigError, apply_quantization

    model = _build(src, error)
    weights = model.sanitize(src.weights)
    try:
        apply_quantization(model, src.config, weights, src.where)
    except QuantizationConfigError as e:
        raise error(str(e)) from None
    check_shapes(model, weights, src, error)
    if target.dtype is not None:
        dt = DTYPES[target.dtype]
        weights = {k: v.astype(dt) if mx.issubdtype(v.dtype, mx.floating) else v for k, v in weights.items()}
    model.load_weights(list(weights.items()), strict=True)
    dtype_name = target.dtype or _stored_dtype(weights)
    dtype_name = _reshape_weights(model, src, target, dtype_name, error, log)
    config = {k: v for k, v in src.config.items() if k not in SOURCE_KEYS}
    config["torch_dtype"] = dtype_name
    config.update(legacy_rope_keys(src.config))
    from .quantization import model_quantization, stored_widths

    q = model_quantization(model)
    if q is not None:
        config["quantization"] = q
        log(f"[convert] stored weights: {stored_widths(model)}")
    streams = _streams(model, src, target, error, log)
    with atomic_directory(dst, target.force, error) as tmp:
        mx.save_safetensors(
            str(tmp / "model.safetensors"), dict(tree_flatten(model.parameters())), metadata={"format": "mlx"}
        )
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
        if streams is not None:
            save_streams(streams, tmp)
        src.write_tokenizer(tmp)
    log(f"[convert] wrote {dst}")
    return dst


def _build(src: Source, error) -> nn.Module:
    where = src.where / "config.json" if src.where.is_dir() else src.where
    try:
        return build_model(src.config)
    except UnsupportedModelError as e:
        raise error(f"{where}: {e}") from e
    except (TypeError, KeyError, ValueError) as e:
        raise error(f"{where}: cannot build the model its config describes ({e})") from e


def check_shapes(model: nn.Module, weights: Dict[str, mx.array], src: Source, error) -> None:
    """Every parameter present, none extra, each of the shape the config implies."""
    expected = dict(tree_flatten(model.parameters()))
    missing = sorted(set(expected) - set(weights))
    extra = sorted(set(weights) - set(expected))
    if missing:
        raise error(f"{src.where}: checkpoint lacks {len(missing)} weights, e.g. {missing[:3]}")
    if extra:
        raise error(f"{src.where}: checkpoint has {len(extra)} unexpected weights, e.g. {extra[:3]}")
    for k, v in weights.items():
        if tuple(v.shape) != tuple(expected[k].shape):
            raise error(
                f"{src.where}: shape mismatch for {k}: checkpoint {tuple(v.shape)}, "
                f"{src.shapes_from} implies {tuple(expected[k].shape)}"
            )


def _stored_dtype(weights: Dict[str, mx.array]) -> str:
    floats = {v.dtype for v in weights.values() if mx.issubdtype(v.dtype, mx.floating)}
    return "float32" if floats <= {mx.float32} else "float16"


def _reshape_weights(model, src: Source, target: Target, dtype_name: str, error, log) -> str:
    """Dequantize, requantize GGUF blocks read as float, or quantize, as ``target`` asks;
    returns the dtype name the directory's floats now have."""
    from .quantization import cast_floating, dequantize_model, quantize_or_refuse, requantize

    if target.dequantize:
        dequantize_model(model)
        dtype_name = target.dtype or "float16"
        cast_floating(model, DTYPES[dtype_name])
        log(f"[convert] quantized blocks dequantized to {dtype_name}")
    elif src.dequantized and target.dtype != "float32":  # float32: the parity path keeps floats
        done = requantize(model, src.dequantized)
        if done is not None:
            log(f"[convert] {done.line()}")
    if target.quantize is not None:
        bits, group = target.quantize
        quantize_or_refuse(model, bits, group, log, error)
    return dtype_name


def _streams(model, src: Source, target: Target, error, log) -> Optional[StreamParams]:
    if src.streams is not None:
        streams = src.streams(model)
        log(
            f"[convert] imported {streams.num_streams} speculative streams "
            f"({'trained' if streams.config.trained else 'untrained'})"
        )
        if target.num_streams:
            log("[convert] --num-streams ignored: the checkpoint has its own streams")
        return streams
    if target.num_streams <= 0:
        return None
    if not 1 <= target.stream_layers <= len(model.layers):
        raise error(f"--stream-layers must be in 1..{len(model.layers)}, got {target.stream_layers}")
    if target.num_streams > MAX_STREAMS:
        raise error(f"--num-streams must be at most {MAX_STREAMS}, got {target.num_streams}")
    streams = new_streams(model, StreamConfig(num_streams=target.num_streams, stream_layers=target.stream_layers))
    log(
        f"[convert] attached {target.num_streams} untrained streams in the top {target.stream_layers} layers "
        f"({streams.extra_parameters():,} extra parameters); train them with `specstream-mlx train`"
    )
    return streams


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
