"""Checkpoints during training and the model directory written at the end."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import asdict
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from ..io.files import TOKENIZER_FILES
from ..method.streams import find_linear, lora_key, save_streams
from .config import TrainConfig, TrainError


def mlx_optimizer_arrays(optimizer) -> dict:
    return {k: v for k, v in tree_flatten(optimizer.state) if isinstance(v, mx.array)}


def save_checkpoint(ckpt_dir: Path, trainable, optimizer_arrays: dict, step: int, cfg: TrainConfig) -> None:
    """Atomic: written to a temporary directory, then renamed over the old one.

    ``optimizer_arrays``: the optimizer state as flat named arrays (the backend's own layout)."""
    ckpt_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".ckpt-", dir=ckpt_dir.parent))
    mx.save_safetensors(str(tmp / "trainable.safetensors"), dict(tree_flatten(trainable.parameters())))
    mx.save_safetensors(str(tmp / "optimizer.safetensors"), optimizer_arrays)
    (tmp / "state.json").write_text(json.dumps({"step": step, "config": asdict(cfg)}, indent=2))
    old = None
    if ckpt_dir.exists():
        old = ckpt_dir.with_name(ckpt_dir.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        os.rename(ckpt_dir, old)
    os.rename(tmp, ckpt_dir)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def find_checkpoint(ckpt_dir: Path):
    """The checkpoint to resume from: ``ckpt_dir``, or ``ckpt_dir.old`` when a crash
    fell between the two renames of :func:`save_checkpoint`; None if neither is complete."""
    for d in (ckpt_dir, ckpt_dir.with_name(ckpt_dir.name + ".old")):
        if all((d / f).exists() for f in ("state.json", "trainable.safetensors", "optimizer.safetensors")):
            return d
    return None


def load_checkpoint(ckpt_dir: Path, trainable, backend: str) -> "tuple[int, dict]":
    """Load the trained weights into ``trainable``; returns (step, the optimizer's flat arrays)."""
    state = json.loads((ckpt_dir / "state.json").read_text())
    written_by = state.get("config", {}).get("backend", "mlx")
    if written_by != backend:
        raise TrainError(f"{ckpt_dir}: written by the {written_by} backend; resume it with --backend {written_by}")
    trainable.load_weights(list(mx.load(str(ckpt_dir / "trainable.safetensors")).items()), strict=True)
    return int(state["step"]), mx.load(str(ckpt_dir / "optimizer.safetensors"))


def restore_mlx_optimizer(optimizer, arrays: dict) -> None:
    optimizer.state = tree_unflatten(list(arrays.items()))


def fuse_base_lora(model, base_lora: dict) -> None:
    """Shared mode export: W <- W + scale·(a @ b)ᵀ in every adapted Linear."""
    for i, layer in enumerate(model.layers):
        for name, lora in (base_lora.get(lora_key(i)) or {}).items():
            lin = find_linear(layer, name)
            if isinstance(lin, nn.QuantizedLinear):
                raise TrainError("shared-mode export into quantized weights is not supported; train on a float model")
            delta = (lora.scale * (lora.a @ lora.b)).T.astype(lin.weight.dtype)
            lin.weight = lin.weight + delta


def write_model_dir(base_dir: Path, out_dir: Path, model, trainable, cfg: TrainConfig, extra: dict) -> None:
    """A complete model directory, written into ``out_dir`` (a fresh temporary
    directory the caller renames into place): base files (fused weights in shared
    mode) and the trained streams."""
    out_dir = Path(out_dir)
    for f in sorted(Path(base_dir).iterdir()):
        if f.is_file() and (
            f.name == "config.json"
            or f.name in TOKENIZER_FILES
            or (cfg.mode == "lossless" and f.name.startswith("model") and f.suffix in (".safetensors", ".json"))
        ):
            shutil.copy2(f, out_dir / f.name)
    if cfg.mode == "shared":
        fuse_base_lora(model, trainable.base_lora)
        weights = dict(tree_flatten(model.parameters()))
        base_cfg = json.loads((Path(base_dir) / "config.json").read_text())
        dtype = {"float16": mx.float16, "bfloat16": mx.bfloat16}.get(base_cfg.get("torch_dtype"), mx.float32)
        weights = {k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v for k, v in weights.items()}
        mx.save_safetensors(str(out_dir / "model.safetensors"), weights, metadata={"format": "mlx"})
    if cfg.streams:
        streams = trainable.streams
        streams.config.trained = True
        streams.config.extra = extra
        save_streams(streams, out_dir)
