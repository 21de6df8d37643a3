"""Phi-3: fused ``qkv_proj`` and ``gate_up_proj``, optional partial rotary, every layer
limited to ``sliding_window`` positions when the config sets one."""

from dataclasses import dataclass

from .base import Model
from .base import ModelArgs as _BaseArgs


@dataclass
class ModelArgs(_BaseArgs):
    window_every_layer: bool = True
    rms_norm_eps: float = 1e-5
    fused_qkv: bool = True
    # Phi3Config's default, unlike PretrainedConfig's.
    tie_word_embeddings: bool = False


__all__ = ["Model", "ModelArgs"]
