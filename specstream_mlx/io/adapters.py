"""LoRA adapters fused into base weights: PEFT (``adapter_model.safetensors``) and
mlx-lm (``adapters.safetensors``) directories, for ``convert --adapter`` and the
``--adapter-path`` flag of ``generate``, ``chat`` and ``serve``."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Dict, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from .limits import read_json


def fuse_peft_adapter(weights: Dict[str, mx.array], adapter_dir: Path) -> Tuple[Dict[str, mx.array], int]:
    """Fuse a PEFT LoRA adapter into base weights: W += scale · B @ A. Returns (weights, fused count)."""
    adapter_dir = Path(adapter_dir)
    cfg_path = adapter_dir / "adapter_config.json"
    w_path = adapter_dir / "adapter_model.safetensors"
    if not cfg_path.exists():
        raise ValueError(f"{cfg_path}: missing (not a PEFT adapter directory)")
    if not w_path.exists():
        raise ValueError(f"{w_path}: missing (only safetensors adapters are supported)")
    cfg = _adapter_config(cfg_path)
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{cfg_path}: peft_type {cfg.get('peft_type')!r} is not LORA")
    r = cfg.get("r")
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise ValueError(f"{cfg_path}: r must be a positive integer, got {r!r}")
    alpha = _finite(cfg_path, "lora_alpha", cfg.get("lora_alpha", r))
    scale = alpha / (r**0.5) if cfg.get("use_rslora") else alpha / r
    ad = _read_adapter(w_path)
    weights = dict(weights)
    fused = 0
    for k, A in ad.items():
        if ".lora_A." not in k:
            continue
        B = ad.get(k.replace(".lora_A.", ".lora_B."))
        if B is None:
            raise ValueError(f"{w_path}: {k} has no matching lora_B")
        target = k.split(".lora_A.")[0]
        for prefix in ("base_model.model.", "base_model."):
            if target.startswith(prefix):
                target = target[len(prefix) :]
                break
        _check_pair(w_path, k, B, A)
        _add_delta(weights, target + ".weight", scale * (B.astype(mx.float32) @ A.astype(mx.float32)), w_path, k)
        fused += 1
    if not fused:
        raise ValueError(f"{w_path}: no lora_A/lora_B pairs found")
    return weights, fused


def _adapter_config(cfg_path: Path) -> Dict[str, Any]:
    """adapter_config.json, read as a model directory's JSON files are (a regular file under
    the size limit, nesting bounded): any failure one line naming it."""
    cfg = read_json(cfg_path, cfg_path.parent)
    if not isinstance(cfg, dict):
        raise ValueError(f"{cfg_path}: must be a JSON object")
    return cfg


def _finite(cfg_path: Path, key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{cfg_path}: {key} must be a finite number, got {value!r}")
    return float(value)


def _read_adapter(w_path: Path) -> Dict[str, mx.array]:
    try:
        return mx.load(str(w_path))
    except Exception as e:  # corrupt file
        raise ValueError(f"{w_path}: cannot read safetensors ({e})") from e


def _check_pair(w_path: Path, key: str, left: mx.array, right: mx.array) -> None:
    """``left @ right`` is a LoRA update: two matrices sharing the rank."""
    if left.ndim != 2 or right.ndim != 2 or left.shape[1] != right.shape[0]:
        raise ValueError(f"{w_path}: {key}: shapes {left.shape} and {right.shape} do not make a rank-r update")


def _add_delta(weights: Dict[str, mx.array], wk: str, delta: mx.array, w_path: Path, key: str) -> None:
    """weights[wk] += delta, after checking the base has ``wk`` with the delta's shape."""
    if wk not in weights:
        raise ValueError(f"{w_path}: adapter targets {wk}, which the base model does not have")
    W = weights[wk]
    if delta.shape != W.shape:
        raise ValueError(f"{w_path}: {key} gives a {delta.shape} update for {wk} of shape {W.shape}")
    weights[wk] = W + delta.astype(W.dtype)


def fuse_mlx_lm_adapter(weights: Dict[str, mx.array], adapter_dir: Path) -> Tuple[Dict[str, mx.array], int]:
    """Fuse an mlx-lm LoRA adapter (``adapters.safetensors`` with ``<module>.lora_a`` (in, r)
    and ``.lora_b`` (r, out), ``lora_parameters.scale`` in adapter_config.json) into base
    weights: W += scale · (a @ b)ᵀ. Returns (weights, fused count)."""
    adapter_dir = Path(adapter_dir)
    cfg_path = adapter_dir / "adapter_config.json"
    w_path = adapter_dir / "adapters.safetensors"
    cfg = _adapter_config(cfg_path) if cfg_path.exists() else {}
    kind = cfg.get("fine_tune_type", "lora")
    if kind != "lora":
        raise ValueError(f"{cfg_path}: fine_tune_type {kind!r} is not supported (only lora)")
    params = cfg.get("lora_parameters") or {}
    if not isinstance(params, dict):
        raise ValueError(f"{cfg_path}: lora_parameters must be a JSON object")
    scale = _finite(cfg_path, "lora_parameters.scale", params.get("scale", 20.0))  # mlx-lm's default
    ad = _read_adapter(w_path)
    weights = dict(weights)
    fused = 0
    for k, a in ad.items():
        if not k.endswith(".lora_a"):
            continue
        b = ad.get(k[: -len("lora_a")] + "lora_b")
        if b is None:
            raise ValueError(f"{w_path}: {k} has no matching lora_b")
        wk = k[: -len(".lora_a")] + ".weight"
        _check_pair(w_path, k, a, b)
        _add_delta(weights, wk, (scale * (a.astype(mx.float32) @ b.astype(mx.float32))).T, w_path, k)
        fused += 1
    if not fused:
        raise ValueError(f"{w_path}: no lora_a/lora_b pairs found")
    return weights, fused


def fuse_adapter_into(model: nn.Module, adapter_dir: Path) -> int:
    """Fuse the PEFT or mlx-lm LoRA adapter in ``adapter_dir`` into ``model``'s
    weights (float weights only); returns how many matrices changed."""
    adapter_dir = Path(adapter_dir)
    if not adapter_dir.is_dir():
        raise ValueError(f"{adapter_dir}: no such adapter directory")
    if any(isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) for _, m in model.named_modules()):
        raise ValueError(f"{adapter_dir}: adapters fuse into float weights; this model is quantized")
    weights = dict(tree_flatten(model.parameters()))
    if (adapter_dir / "adapter_model.safetensors").exists():
        weights, n = fuse_peft_adapter(weights, adapter_dir)
    elif (adapter_dir / "adapters.safetensors").exists():
        weights, n = fuse_mlx_lm_adapter(weights, adapter_dir)
    else:
        raise ValueError(f"{adapter_dir}: neither adapter_model.safetensors (PEFT) nor adapters.safetensors (mlx-lm)")
    model.update(tree_unflatten(list(weights.items())))
    mx.eval(model.parameters())
    return n
