"""Mistral: the Llama layout (q/k/v/o projections, SwiGLU MLP, RMSNorm, RoPE), every
layer limited to ``sliding_window`` positions when the config sets one."""

from dataclasses import dataclass

from .base import Model
from .base import ModelArgs as _BaseArgs


@dataclass
class ModelArgs(_BaseArgs):
    window_every_layer: bool = True


__all__ = ["Model", "ModelArgs"]
