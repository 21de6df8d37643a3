"""Mistral: the Llama layout (q/k/v/o projections, SwiGLU MLP, RMSNorm, RoPE).

``sliding_window`` is not applied (README, "Known limitations")."""

from dataclasses import dataclass

from .base import Model
from .base import ModelArgs as _BaseArgs


@dataclass
class ModelArgs(_BaseArgs):
    pass


__all__ = ["Model", "ModelArgs"]
