"""Llama (Llama 2/3/3.1/3.2 shape): q/k/v/o projections, SwiGLU MLP, RMSNorm, RoPE."""

from dataclasses import dataclass

from .base import Model
from .base import ModelArgs as _BaseArgs


@dataclass
class ModelArgs(_BaseArgs):
    pass


__all__ = ["Model", "ModelArgs"]
