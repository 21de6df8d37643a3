"""Mistral: the Llama layout (sliding_window is not applied; see README): q/k/v/o projections, SwiGLU MLP, RMSNorm, RoPE."""

from dataclasses import dataclass

from .base import Model, ModelArgs as _BaseArgs


@dataclass
class ModelArgs(_BaseArgs):
    pass


__all__ = ["Model", "ModelArgs"]
