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
from ..method.streams import find_linear, lora_key, one_line_mismatch, save_streams
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


# The settings that give the trained arrays their shapes, with the flag that sets each.
_SHAPE_SETTINGS = (
    ("mode", "--mode"),
    ("num_streams", "--num-streams"),
    ("stream_layers", "--stream-layers"),
    ("lora_rank", "--lora-rank"),
    ("lora_targets", "the LoRA targets"),
)


def load_checkpoint(ckpt_dir: Path, trainable, cfg) -> "tuple[int, dict]":
    """Load the trained weights into ``trainable``; returns (step, the optimizer's flat arrays).

    A checkpoint resumes only under the settings it was written with: a stream shape
    that differs is named in one line (not left to a shape error from the loader)."""
    state = _checkpoint_state(ckpt_dir / "state.json")
    written = state.get("config", {})
    written_by = written.get("backend", "mlx")
    if written_by != cfg.backend:
        raise TrainError(f"{ckpt_dir}: written by the {written_by} backend; resume it with --backend {written_by}")
    for key, flag in _SHAPE_SETTINGS:
        old, new = written.get(key), getattr(cfg, key, None)
        if old is not None and new is not None and _as_list(old) != _as_list(new):
            raise TrainError(
                f"{ckpt_dir}: the checkpoint was written with {key} {_shown(old)}, this run has {_shown(new)}; "
                f"resume with the settings the run started with ({flag}; --new-streams if it started fresh streams "
                "on a model that has some)"
            )
    weights = _checkpoint_arrays(ckpt_dir / "trainable.safetensors")
    try:
        trainable.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise TrainError(_damaged(ckpt_dir / "trainable.safetensors", one_line_mismatch(str(e)))) from None
    return state["step"], _checkpoint_arrays(ckpt_dir / "optimizer.safetensors")


def _damaged(path: Path, why) -> str:
    return f"{path}: unreadable ({why}); the checkpoint is damaged: run without --resume to start afresh"


def _checkpoint_state(path: Path) -> dict:
    """A checkpoint's state.json, or one TrainError naming it (a disk that filled up, a file
    edited by hand: had been a traceback, or a JSON message without the file)."""
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError) as e:
        raise TrainError(_damaged(path, e)) from None
    if not (isinstance(state, dict) and isinstance(state.get("config", {}), dict) and _is_step(state.get("step"))):
        raise TrainError(_damaged(path, "not a checkpoint's state: no step count"))
    return state


def _is_step(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _checkpoint_arrays(path: Path) -> dict:
    try:
        return mx.load(str(path))
    except Exception as e:  # MLX's RuntimeError for a truncated file, ValueError for a bad header
        raise TrainError(_damaged(path, e)) from None


def _as_list(v):
    return list(v) if isinstance(v, (list, tuple)) else v


def _shown(v) -> str:
    return ",".join(map(str, v)) if isinstance(v, (list, tuple)) else str(v)


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


ADAPTER_FILE = "adapters.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


def save_base_lora(model, base_lora: dict, out_dir: Path, base_fingerprint: str) -> int:
    """The shared-mode LoRA as an mlx-lm adapter (``<module>.lora_a`` (in, r), ``.lora_b``
    (r, out), float16; ``adapter_config.json``), so a fine-tune can ship as a small file
    beside a base it names by fingerprint. Returns the parameter count."""
    paths = {id(m): p for p, m in model.named_modules()}
    arrays, rank, scale, keys = {}, 0, 1.0, set()
    for i, layer in enumerate(model.layers):
        for name, lora in (base_lora.get(lora_key(i)) or {}).items():
            path = paths[id(find_linear(layer, name))]
            arrays[f"{path}.lora_a"] = lora.a.astype(mx.float16)
            arrays[f"{path}.lora_b"] = lora.b.astype(mx.float16)
            rank, scale = lora.a.shape[1], float(lora.scale)
            keys.add(path.split(".", 3)[-1] if path.count(".") >= 3 else name)
    if not arrays:
        return 0
    mx.save_safetensors(str(out_dir / ADAPTER_FILE), arrays, metadata={"format": "mlx"})
    config = {
        "fine_tune_type": "lora",
        "num_layers": len(model.layers),
        "lora_parameters": {"rank": rank, "scale": scale, "keys": sorted(keys)},
        "base_fingerprint": base_fingerprint,
    }
    (out_dir / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return sum(v.size for v in arrays.values())


def fused_as_shipped(base_dir: Path, adapter_dir: Path):
    """The base's weights as stored plus the adapter as saved (float16), fused by the
    function a bundle that ships the adapter fuses with (io/adapters.py), so that the
    fine-tune evaluated from the output directory is the model users get (to the bit
    where the same BLAS computes the products).
    None where that cannot apply (quantized or unmatched base weights): the caller then
    writes the trained model's own fused weights."""
    from ..io.adapters import fuse_mlx_lm_adapter

    weights = {}
    for f in sorted(Path(base_dir).glob("model*.safetensors")):
        weights.update(mx.load(str(f)))
    if not weights or any(not mx.issubdtype(v.dtype, mx.floating) for v in weights.values()):
        return None
    try:
        return fuse_mlx_lm_adapter(weights, adapter_dir)[0]
    except ValueError:
        return None


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
        adapter = 0
        if trainable.base_lora:
            from ..io.fingerprint import base_fingerprint

            adapter = save_base_lora(model, trainable.base_lora, out_dir, base_fingerprint(base_dir))
        fuse_base_lora(model, trainable.base_lora)
        weights = fused_as_shipped(base_dir, out_dir) if adapter else None
        if weights is None:
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
