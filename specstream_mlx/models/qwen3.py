"""Qwen3: the Llama layout with RMSNorm on every query and key head before RoPE."""

from dataclasses import dataclass

from .base import Model
from .base import ModelArgs as _BaseArgs


@dataclass
class ModelArgs(_BaseArgs):
    rms_norm_eps: float = 1e-6
    qk_norm: bool = True


__all__ = ["Model", "ModelArgs"]
