"""Qwen2 / Qwen2.5: the Llama layout with a bias on the q, k and v projections."""

from dataclasses import dataclass

from .base import Model
from .base import ModelArgs as _BaseArgs


@dataclass
class ModelArgs(_BaseArgs):
    rms_norm_eps: float = 1e-6
    qkv_bias: bool = True


__all__ = ["Model", "ModelArgs"]
