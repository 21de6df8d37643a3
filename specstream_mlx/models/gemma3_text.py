"""Gemma 3 (text): local sliding-window layers between global ones.

What differs from the Llama layout, as ``transformers``' ``Gemma3ForCausalLM`` computes it:

* ``layer_types`` (or every ``sliding_window_pattern``-th layer global, 6 by default):
  a sliding layer's query sees the keys less than ``sliding_window`` positions behind
  it (:func:`~.base.window_mask`), and rotates by the local RoPE base
  (``rope_local_base_freq``, 10,000) while global layers use ``rope_theta`` and any
  ``rope_scaling``. A forward computes both rotations once (:class:`LayeredRotation`).
* RMSNorm multiplies by ``1 + weight`` (zero-centred weights, as stored by HF), on
  q/k per head too; four norms per block: the attention and MLP outputs are normed
  before their residual adds.
* Scores are scaled by ``query_pre_attn_scalar ** -0.5``; the MLP is GELU(tanh)-gated;
  the embedding is multiplied by ``sqrt(hidden_size)``; the head is tied.

Sliding layers keep a full KV cache (the mask, not the cache, enforces the window), so
the tree pass, the commit and the training passes use the one cache layout of every
architecture; a context far beyond the window costs the memory of a global layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Dict, List, Optional, Union

import mlx.core as mx
import mlx.nn as nn

from . import base
from .base import Adapter, Rotation


@dataclass
class ModelArgs(base.ModelArgs):
    head_dim: Optional[int] = 256
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_local_base_freq: float = 10_000.0
    query_pre_attn_scalar: float = 256.0
    sliding_window: Optional[int] = 4096
    sliding_window_pattern: int = 6
    layer_types: Optional[List[str]] = None
    final_logit_softcapping: Optional[float] = None
    attn_logit_softcapping: Optional[float] = None
    use_bidirectional_attention: Optional[bool] = False
    hidden_activation: str = "gelu_pytorch_tanh"
    qk_norm: bool = True
    # The local layers' RoPE (base and any scaling of their own), from rope_parameters.
    local_rope: Optional[Dict[str, Any]] = None

    def __post_init__(self):
        rp = self.rope_parameters
        if isinstance(rp, dict) and ("full_attention" in rp or "sliding_attention" in rp):
            # transformers >= 5: one entry per layer kind.
            full, local = dict(rp.get("full_attention") or {}), dict(rp.get("sliding_attention") or {})
            self.rope_theta = full.pop("rope_theta", self.rope_theta)
            self.rope_local_base_freq = local.pop("rope_theta", self.rope_local_base_freq)
            self.rope_parameters = full or None
            self.local_rope = local or None
        super().__post_init__()
        for name in ("final_logit_softcapping", "attn_logit_softcapping"):
            if getattr(self, name) is not None:
                raise ValueError(f"gemma3: {name} is not supported (Gemma 3 has none)")
        if self.use_bidirectional_attention:
            raise ValueError("gemma3: use_bidirectional_attention (an encoder) is not a causal LM")
        if self.hidden_activation not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ValueError(f"gemma3: hidden_activation {self.hidden_activation!r} is not supported")
        if self.layer_types is None:
            p = self.sliding_window_pattern
            self.layer_types = [
                "sliding_attention" if (i + 1) % p else "full_attention" for i in range(self.num_hidden_layers)
            ]
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"gemma3: layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers"
            )
        kinds = set(self.layer_types) - {"sliding_attention", "full_attention"}
        if kinds:
            raise ValueError(f"gemma3: unknown layer_types {sorted(kinds)}; known: sliding_attention, full_attention")
        if "sliding_attention" in self.layer_types and (
            not isinstance(self.sliding_window, int) or self.sliding_window < 1
        ):
            raise ValueError(f"gemma3: sliding_window must be a positive integer, got {self.sliding_window!r}")

    def local_args(self) -> "ModelArgs":
        """The arguments a sliding layer's RoPE is built from."""
        scaling = self.local_rope if (self.local_rope or {}).get("rope_type", "default") != "default" else None
        return base.ModelArgs(
            model_type=self.model_type,
            hidden_size=self.hidden_size,
            num_hidden_layers=self.num_hidden_layers,
            intermediate_size=self.intermediate_size,
            num_attention_heads=self.num_attention_heads,
            vocab_size=self.vocab_size,
            head_dim=self.head_dim,
            rope_theta=self.rope_local_base_freq,
            rope_scaling=scaling,
        )


class RMSNorm(nn.Module):
    """Gemma's RMSNorm: zero-centred weight, scale ``1 + weight``."""

    offset = 1.0  # what a frozen copy of the norm adds to its weight (train/objective.py)

    def __init__(self, dims: int, eps: float = 1e-6):
        super().__init__()
        self.weight = mx.zeros((dims,))
        self.eps = eps

    def __call__(self, x: mx.array) -> mx.array:
        return base.rms_norm(x, 1.0 + self.weight, self.eps)


@dataclass
class LayeredRotation(Rotation):
    """The global layers' rotation, with the sliding layers' own (another RoPE base)."""

    local: Optional[Rotation] = None


class Attention(base.Attention):
    def __init__(self, args: ModelArgs, sliding: bool):
        super().__init__(args)
        self.scale = args.query_pre_attn_scalar**-0.5
        self.q_norm = RMSNorm(args.head_dim, eps=args.rms_norm_eps)
        self.k_norm = RMSNorm(args.head_dim, eps=args.rms_norm_eps)
        self.sliding = sliding
        if sliding:
            self.rope = base.RoPE(args.head_dim, args.local_args())
            self.window = args.sliding_window

    def own_rotation(self, positions):
        if self.sliding and isinstance(positions, LayeredRotation):
            return positions.local
        return positions


@partial(mx.compile, shapeless=True)
def geglu(gate: mx.array, up: mx.array) -> mx.array:
    return nn.gelu_approx(gate) * up


@partial(mx.compile, shapeless=True)
def residual(x: mx.array, y: mx.array) -> mx.array:
    # Gemma's activations outgrow float16: add in float32 and clip (as mlx-lm does).
    if x.dtype != mx.float16:
        return x + y
    bound = mx.finfo(mx.float16).max
    return mx.clip(x.astype(mx.float32) + y.astype(mx.float32), -bound, bound).astype(mx.float16)


class MLP(base.MLP):
    def __call__(self, x: mx.array, adapter: Optional[Adapter] = None) -> mx.array:
        act = geglu(*self.gate_up(x, adapter))
        return self.down_proj(act) if adapter is None else adapter("down_proj", act, self.down_proj(act))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, sliding: bool):
        super().__init__()
        self.self_attn = Attention(args, sliding)
        self.mlp = MLP(args)
        dim, eps = args.hidden_size, args.rms_norm_eps
        self.input_layernorm = RMSNorm(dim, eps)
        self.post_attention_layernorm = RMSNorm(dim, eps)
        self.pre_feedforward_layernorm = RMSNorm(dim, eps)
        self.post_feedforward_layernorm = RMSNorm(dim, eps)

    def __call__(
        self,
        x: mx.array,
        mask: Union[None, str, mx.array],
        cache: Optional[Any],
        positions,
        adapter: Optional[Adapter] = None,
        cached_rows: Optional[int] = None,
    ) -> mx.array:
        """The block of :class:`~.base.TransformerBlock`'s contract, Gemma's norms."""
        a = self.self_attn(self.input_layernorm(x), mask, cache, positions, adapter, cached_rows)
        h = residual(x, self.post_attention_layernorm(a))
        m = self.mlp(self.pre_feedforward_layernorm(h), adapter)
        return residual(h, self.post_feedforward_layernorm(m))


class DecoderModel(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [TransformerBlock(args, kind == "sliding_attention") for kind in args.layer_types]
        self.norm = RMSNorm(args.hidden_size, eps=args.rms_norm_eps)


class Model(base.Model):
    def __init__(self, args: ModelArgs):
        nn.Module.__init__(self)
        self.args = args
        self.model_type = args.model_type
        self.model = DecoderModel(args)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self._global = next((i for i, k in enumerate(args.layer_types) if k == "full_attention"), None)
        self._local = next((i for i, k in enumerate(args.layer_types) if k == "sliding_attention"), None)

    def embed(self, tokens: mx.array) -> mx.array:
        h = self.model.embed_tokens(tokens)
        # HF casts the scale to the embedding's dtype before multiplying.
        return h * mx.array(self.args.hidden_size**0.5, dtype=h.dtype)

    def rotation(self, positions):
        if isinstance(positions, Rotation):
            return positions
        layers = self.layers
        local = layers[self._local].self_attn.rope.angles(positions) if self._local is not None else None
        if self._global is None:
            return local
        g = layers[self._global].self_attn.rope.angles(positions)
        return LayeredRotation(g.cos, g.sin, g.positions, local=local)


__all__ = ["Model", "ModelArgs"]
