"""The decoder shared by every supported architecture.

What is notable here:

* Attention takes ``(x, mask, cache, positions)``. RoPE is applied from an
  explicit per-token position array, so a flattened draft tree (whose nodes sit
  at ``offset + depth``) and speculative streams (``p + j``) get the right
  rotations. A forward computes the angles of its rows once (:class:`Rotation`)
  and passes them as the layers' ``positions``; each rotation is one fused
  element-wise kernel.
* One attention call per layer, with whatever mask the caller built (``None``,
  ``"causal"`` or an array): ``mx.fast.scaled_dot_product_attention``, or the same
  arithmetic composed of products where that measured faster (:mod:`.attention`).
* Parameters keep Hugging Face names, so conversion is load -> sanitize ->
  cast/quantize -> save, and mlx-lm directories of the same architecture load.
* Architecture differences (q/k norms, qkv bias, fused projections) are flags
  on :class:`ModelArgs`, set by the per-architecture modules.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field
from functools import lru_cache, partial
from typing import Any, Callable, Dict, List, Optional, Union

import mlx.core as mx
import mlx.nn as nn

from . import stored
from .attention import attention_fn

# adapter(projection name, input, output) -> output with a delta added.
Adapter = Callable[[str, mx.array, mx.array], mx.array]


def _no_adapter(name: str, x: mx.array, y: mx.array) -> mx.array:
    return y


@dataclass
class ModelArgs:
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    num_key_value_heads: Optional[int] = None
    head_dim: Optional[int] = None
    max_position_embeddings: Optional[int] = None
    rope_theta: float = 10000.0
    rope_scaling: Optional[Dict[str, Any]] = None
    # transformers >= 5 writes theta, scaling and partial rotary here instead.
    rope_parameters: Optional[Dict[str, Any]] = None
    partial_rotary_factor: Optional[float] = 1.0
    # HF's PretrainedConfig default; save_pretrained omits it when equal.
    tie_word_embeddings: bool = True
    attention_bias: bool = False
    mlp_bias: bool = False
    # Architecture flags, set by the per-architecture modules, never by config.json.
    qkv_bias: bool = False  # bias on q/k/v only (qwen2)
    o_bias: bool = False
    qk_norm: bool = False  # RMSNorm on each head of q and k before RoPE (qwen3)
    fused_qkv: bool = False  # one qkv_proj and one gate_up_proj (phi3)
    # Every layer attends to the last ``sliding_window`` positions only (mistral, phi3).
    window_every_layer: bool = False
    sliding_window: Optional[int] = None

    @classmethod
    def from_dict(cls, params: Dict[str, Any]) -> "ModelArgs":
        names = inspect.signature(cls).parameters
        return cls(**{k: v for k, v in params.items() if k in names})

    def __post_init__(self):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.attention_bias:
            self.qkv_bias = True
            self.o_bias = True
        if self.rope_parameters:
            rp = self.rope_parameters
            self.rope_theta = rp.get("rope_theta", self.rope_theta)
            if rp.get("partial_rotary_factor") is not None:
                self.partial_rotary_factor = rp["partial_rotary_factor"]
            scaling = {k: v for k, v in rp.items() if k not in ("rope_theta", "partial_rotary_factor")}
            if scaling.get("rope_type", scaling.get("type", "default")) != "default":
                self.rope_scaling = scaling
        if self.partial_rotary_factor is None:
            self.partial_rotary_factor = 1.0
        # Older configs spell the RoPE scaling kind "type" instead of "rope_type".
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
            if kind == "default":
                self.rope_scaling = None
            else:
                self.rope_scaling = {**self.rope_scaling, "rope_type": kind}


@dataclass
class Rotation:
    """RoPE angles of a set of rows, computed once per forward and shared by every layer.

    Attributes:
        cos: (B, L, 1, 1, dims/2) cosines.
        sin: (B, L, 1, 2, dims/2) sines, negated for the first half of each head.
        positions: (B, L) the rows' positions (what sliding-window layers mask by).
    """

    cos: mx.array
    sin: mx.array
    positions: Optional[mx.array] = None
    # Window masks built for this forward, by (mask, key count, window): every sliding
    # layer of a forward asks for the same one, so it is built once, not once per layer.
    windows: Dict[tuple, Any] = field(default_factory=dict, repr=False, compare=False)


@lru_cache(maxsize=None)
def _compiled_rms_norm(eps: float) -> Callable[[mx.array, mx.array], mx.array]:
    # Where MLX has no kernel of its own for it (the CPU backend) mx.fast.rms_norm is composed
    # of some eight operations; compiled, a sum of squares and one fused element-wise kernel
    # (the same values). Where it has one (Metal) it stays one launch.
    return mx.compile(partial(mx.fast.rms_norm, eps=eps))


def rms_norm(x: mx.array, weight: mx.array, eps: float) -> mx.array:
    """``mx.fast.rms_norm``; on two-dimensional rows (:meth:`Attention.rows`' callers, a pass
    op by op) compiled, traced once per shape. Batched inputs, whose shapes follow every
    prompt's length, keep the call as it is: a compiled function's traces are kept per shape."""
    return _compiled_rms_norm(eps)(x, weight) if x.ndim == 2 else mx.fast.rms_norm(x, weight, eps)


class RMSNorm(nn.RMSNorm):
    """``nn.RMSNorm`` (the same parameter and values), compiled on two-dimensional rows
    (:func:`rms_norm`)."""

    def __call__(self, x: mx.array) -> mx.array:
        return rms_norm(x, self["weight"], self.eps)


@mx.compile
def _rotate(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    # Non-interleaved RoPE on (B, L, H, 2, d/2): [x1, x2] -> [x1 c - x2 s, x2 c + x1 s].
    # Compiled: one fused element-wise kernel on every backend.
    return x * cos + x[..., ::-1, :] * sin


class RoPE(nn.Module):
    """Rotary embedding over explicit positions (non-interleaved, HF layout).

    Supports plain RoPE and the ``linear`` and ``llama3`` scalings. The angles of a
    forward's rows are computed once (:meth:`angles`) and every layer's queries and
    keys are rotated by one fused element-wise kernel: ``mx.fast.rope`` with
    per-token offsets runs as a composition of some fifteen operations per call
    where it has no kernel of its own (the CPU backend), twice per layer.
    """

    def __init__(self, head_dim: int, args: ModelArgs):
        super().__init__()
        self.dims = int(head_dim * args.partial_rotary_factor)
        base = args.rope_theta
        scale = 1.0
        scaling = args.rope_scaling
        if scaling is None:
            periods = None
        elif scaling["rope_type"] == "linear":
            scale = 1.0 / float(scaling["factor"])
            periods = None
        elif scaling["rope_type"] == "llama3":
            periods = _llama3_freqs(self.dims, args.rope_theta, scaling)
        else:
            raise ValueError(f"unsupported rope_scaling type {scaling['rope_type']!r}; supported: linear, llama3")
        if periods is None:
            inv = 1.0 / (base ** (mx.arange(0, self.dims, 2, dtype=mx.float32) / self.dims))
        else:
            inv = 1.0 / periods
        # Not a parameter (leading underscore): derived from the config, never saved.
        self._inv_freq = inv * scale

    def angles(self, positions: mx.array) -> Rotation:
        """The rotation of rows at ``positions`` (B, L)."""
        ang = positions.astype(mx.float32)[..., None] * self._inv_freq  # (B, L, d/2)
        cos, sin = mx.cos(ang)[:, :, None, None, :], mx.sin(ang)[:, :, None, None, :]
        return Rotation(cos, mx.concatenate([-sin, sin], axis=3), positions)

    def heads(self, x: mx.array, n: int, rot: Rotation) -> mx.array:
        """Rotate the ``n`` heads of each of L rows, ``x`` (L, n·D) as projected (or any
        shape of that order), each row by its own rotation; returns (1, n, L, D), the
        (B, heads, L, D) of attention. The arithmetic of :meth:`__call__`, without its
        batch axis."""
        L = rot.cos.shape[1]
        D, d = x.size // (L * n), self.dims
        cos, sin = rot.cos.astype(x.dtype), rot.sin.astype(x.dtype)
        if d == D:
            y = _rotate(x.reshape(L, n, 2, d // 2), cos, sin)
        else:  # partial rotary: the rest of each head passes through
            x = x.reshape(L, n, D)
            y = _rotate(x[..., :d].reshape(L, n, 2, d // 2), cos, sin).reshape(1, L, n, d)
            y = mx.concatenate([y, x[None, ..., d:]], axis=-1)
        return y.reshape(1, n, 1, D) if L == 1 else y.reshape(1, L, n, D).transpose(0, 2, 1, 3)

    def __call__(self, x: mx.array, positions: Union[mx.array, Rotation]) -> mx.array:
        """Rotate ``x`` of shape (B, L, H, D) at ``positions`` (B, L) or by a precomputed
        :class:`Rotation`; returns (B, H, L, D)."""
        rot = positions if isinstance(positions, Rotation) else self.angles(positions)
        B, L, H, D = x.shape
        d = self.dims
        # Angles in float32 (as mx.fast.rope computes them), the rotation in x's dtype.
        cos, sin = rot.cos.astype(x.dtype), rot.sin.astype(x.dtype)
        if d == D:
            y = _rotate(x.reshape(B, L, H, 2, d // 2), cos, sin).reshape(B, L, H, D)
        else:  # partial rotary: the rest of each head passes through
            y = _rotate(x[..., :d].reshape(B, L, H, 2, d // 2), cos, sin).reshape(B, L, H, d)
            y = mx.concatenate([y, x[..., d:]], axis=-1)
        return y.transpose(0, 2, 1, 3)


def _llama3_freqs(dims: int, base: float, scaling: Dict[str, Any]) -> mx.array:
    # Same arithmetic as transformers' _compute_llama3_parameters, expressed as
    # wavelengths (mx.fast.rope takes periods, the inverse of inv_freq).
    factor = scaling["factor"]
    low = scaling.get("low_freq_factor", 1.0)
    high = scaling.get("high_freq_factor", 4.0)
    old_ctx = scaling.get("original_max_position_embeddings", 8192)
    inv_freq = [1.0 / base ** (i / dims) for i in range(0, dims, 2)]
    out = []
    for f in inv_freq:
        wavelen = 2 * math.pi / f
        if wavelen > old_ctx / low:
            f = f / factor
        elif wavelen >= old_ctx / high:
            smooth = (old_ctx / wavelen - low) / (high - low)
            f = (1 - smooth) * f / factor + smooth * f
        out.append(1.0 / f)
    return mx.array(out, dtype=mx.float32)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        dim = args.hidden_size
        self.n_heads = args.num_attention_heads
        self.n_kv_heads = args.num_key_value_heads
        self.head_dim = hd = args.head_dim
        self.scale = hd**-0.5
        self.fused_qkv = args.fused_qkv
        if args.fused_qkv:
            out = (self.n_heads + 2 * self.n_kv_heads) * hd
            self.qkv_proj = nn.Linear(dim, out, bias=args.qkv_bias)
        else:
            self.q_proj = nn.Linear(dim, self.n_heads * hd, bias=args.qkv_bias)
            self.k_proj = nn.Linear(dim, self.n_kv_heads * hd, bias=args.qkv_bias)
            self.v_proj = nn.Linear(dim, self.n_kv_heads * hd, bias=args.qkv_bias)
        self.o_proj = nn.Linear(self.n_heads * hd, dim, bias=args.o_bias)
        if args.qk_norm:
            self.q_norm = RMSNorm(hd, eps=args.rms_norm_eps)
            self.k_norm = RMSNorm(hd, eps=args.rms_norm_eps)
        self.qk_norm = args.qk_norm
        self.rope = RoPE(hd, args)
        # Keys a query may reach, counting itself (sliding-window layers); None: all.
        self.window: Optional[int] = args.sliding_window if args.window_every_layer else None
        # MLX's fused kernel, or the same arithmetic composed of products (models/attention.py),
        # for queries of several rows and for one; a loaded model decodes with the forms
        # measured faster here (runtime/attention_choice.py).
        self.attention_form = "fused"
        self.one_row_form = "fused"

    def project(self, x: mx.array, positions: mx.array, adapter: Optional[Adapter] = None):
        """Queries, keys and values of ``x`` (B, L, dim), rotated; each (B, heads, L, D).

        ``adapter(name, x, y)`` may add a delta to a projection's output (the
        speculative streams' LoRA, on stream rows only)."""
        B, L, _ = x.shape
        hd = self.head_dim
        ad = adapter or _no_adapter
        if self.fused_qkv:
            qkv = ad("qkv_proj", x, self.qkv_proj(x))
            nq, nk = self.n_heads * hd, self.n_kv_heads * hd
            q, k, v = qkv[..., :nq], qkv[..., nq : nq + nk], qkv[..., nq + nk :]
            if adapter is not None:  # fused at load (models/fusion.py): LoRAs of the parts
                q, k, v = ad("q_proj", x, q), ad("k_proj", x, k), ad("v_proj", x, v)
        else:
            q = ad("q_proj", x, self.q_proj(x))
            k = ad("k_proj", x, self.k_proj(x))
            v = ad("v_proj", x, self.v_proj(x))
        q = q.reshape(B, L, self.n_heads, hd)
        k = k.reshape(B, L, self.n_kv_heads, hd)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        positions = self.own_rotation(positions)
        q = self.rope(q, positions)
        k = self.rope(k, positions)
        v = v.reshape(B, L, self.n_kv_heads, hd).transpose(0, 2, 1, 3)
        return q, k, v

    def own_rotation(self, positions: Union[mx.array, Rotation]) -> Union[mx.array, Rotation]:
        """The rotation this layer applies, of a forward's (Gemma's sliding layers have their own)."""
        return positions

    def rows(self, x: mx.array, mask: Union[None, str, mx.array], cache: Any, rot: Rotation) -> mx.array:
        """Attention of the L rows ``x`` (L, dim) of one sequence, every row cached and
        no adapter (a plain step's one row, a pass's main rows below its streams); (L, dim).

        The arithmetic of :meth:`__call__` in some forty operations a layer instead of
        sixty: each costs the host time to build and dispatch (op by op, Python's too),
        and on a CPU that time is taken from the products' threads (two cores, three
        threads). The rows stay two-dimensional (no product flattens and unflattens
        them), fused q/k/v come apart in splits instead of slices, and the query and key
        heads rotate in one kernel (where no per-head norm comes between), straight into
        attention's (B, heads, L, D) layout."""
        hd, H, Hkv = self.head_dim, self.n_heads, self.n_kv_heads
        L = x.shape[0]
        if self.fused_qkv:
            qk, v = mx.split(self.qkv_proj(x), [(H + Hkv) * hd], axis=-1)
        else:
            qk, v = None, self.v_proj(x)
        rot = self.own_rotation(rot)
        if qk is not None and not self.qk_norm:
            q, k = mx.split(self.rope.heads(qk, H + Hkv, rot), [H], axis=1)
        else:
            q, k = mx.split(qk, [H * hd], axis=-1) if qk is not None else (self.q_proj(x), self.k_proj(x))
            if self.qk_norm:
                q, k = self.q_norm(q.reshape(L, H, hd)), self.k_norm(k.reshape(L, Hkv, hd))
            q, k = self.rope.heads(q, H, rot), self.rope.heads(k, Hkv, rot)
        v = v.reshape(1, Hkv, 1, hd) if L == 1 else v.reshape(1, L, Hkv, hd).transpose(0, 2, 1, 3)
        keys, values = cache.update_and_fetch(k, v)
        if self.window is not None:
            mask = window_mask(mask, rot, keys.shape[2], self.window)
        out = attention_fn(self.one_row_form if L == 1 else self.attention_form)(q, keys, values, self.scale, mask)
        out = out.reshape(1, H * hd) if L == 1 else out.transpose(0, 2, 1, 3).reshape(L, H * hd)
        return self.o_proj(out)

    def attend(self, q, k, v, mask, adapter: Optional[Adapter] = None) -> mx.array:
        """One attention call (the form's), then the output projection; (B, L, dim)."""
        B, _, L, _ = q.shape
        out = attention_fn(self.attention_form if L > 1 else self.one_row_form)(q, k, v, self.scale, mask)
        out = out.transpose(0, 2, 1, 3).reshape(B, L, -1)
        y = self.o_proj(out)
        return adapter("o_proj", out, y) if adapter else y

    def __call__(
        self,
        x: mx.array,
        mask: Union[None, str, mx.array],
        cache: Optional[Any],
        positions: mx.array,
        adapter: Optional[Adapter] = None,
        cached_rows: Optional[int] = None,
    ) -> mx.array:
        if x.ndim == 2:  # the rows of one sequence, all cached (see rows)
            if adapter is not None or cached_rows is not None or cache is None:
                raise ValueError("rows (L, dim) attend without an adapter and are all cached")
            return self.rows(x, mask, cache, positions)
        q, k, v = self.project(x, positions, adapter)
        if cache is not None:
            if cached_rows is None:
                k, v = cache.update_and_fetch(k, v)
            else:
                # Rows past ``cached_rows`` (speculative streams) attend but are
                # never stored: keys are [cache | cached rows | the other rows].
                kc, vc = cache.update_and_fetch(k[:, :, :cached_rows], v[:, :, :cached_rows])
                k = mx.concatenate([kc, k[:, :, cached_rows:]], axis=2)
                v = mx.concatenate([vc, v[:, :, cached_rows:]], axis=2)
        if self.window is not None:
            mask = window_mask(mask, positions, k.shape[2], self.window)
        return self.attend(q, k, v, mask, adapter)


def window_mask(mask: Union[None, str, mx.array], rot: Union[mx.array, Rotation], n_keys: int, window: int):
    """``mask`` restricted to keys less than ``window`` positions behind each query.

    Keys are laid out as every caller lays them out: a prefix whose index is its
    position (the cache, a training tape, or a whole KV buffer) followed by the rows
    themselves at their own positions. When there are at most ``window`` keys no query
    can reach past the window (no row sits further ahead than the number of keys), so
    the mask is returned as it is, which keeps short contexts on the fused paths."""
    if n_keys <= window:
        return mask
    if not isinstance(rot, Rotation):  # raw positions: nothing to share the mask with
        return _window_mask(mask, rot, n_keys, window)
    if rot.positions is None:
        raise ValueError("a sliding-window layer needs the rows' positions (Rotation.positions)")
    key = (mask if isinstance(mask, str) or mask is None else id(mask), n_keys, window)
    if key not in rot.windows:
        rot.windows[key] = _window_mask(mask, rot.positions, n_keys, window)
    return rot.windows[key]


def _window_mask(mask, positions: mx.array, n_keys: int, window: int):
    q = positions.astype(mx.int32)
    B, L = q.shape
    prefix = n_keys - L
    kpos = mx.concatenate([mx.broadcast_to(mx.arange(prefix, dtype=mx.int32)[None], (B, prefix)), q], axis=1)
    dist = q[:, None, :, None] - kpos[:, None, None, :]  # (B, 1, L, K)
    near = dist < window
    if mask is None:
        return near
    if isinstance(mask, str):  # "causal" over contiguous positions: a key at or before its query
        return near & (dist >= 0)
    if mask.dtype == mx.bool_:
        return mask & near
    return mx.where(near, mask, mx.array(-mx.inf, mask.dtype))


@partial(mx.compile, shapeless=True)
def swiglu(gate: mx.array, up: mx.array) -> mx.array:
    # Compiled so the activation and product fuse into one kernel.
    return nn.silu(gate) * up


class MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        dim, hidden = args.hidden_size, args.intermediate_size
        self.fused = args.fused_qkv
        if self.fused:
            self.gate_up_proj = nn.Linear(dim, 2 * hidden, bias=args.mlp_bias)
        else:
            self.gate_proj = nn.Linear(dim, hidden, bias=args.mlp_bias)
            self.up_proj = nn.Linear(dim, hidden, bias=args.mlp_bias)
        self.down_proj = nn.Linear(hidden, dim, bias=args.mlp_bias)

    def gate_up(self, x: mx.array, adapter: Optional[Adapter] = None):
        """The gate and up projections of ``x``, with the adapter's deltas."""
        if not self.fused:
            if adapter is None:
                return self.gate_proj(x), self.up_proj(x)
            return adapter("gate_proj", x, self.gate_proj(x)), adapter("up_proj", x, self.up_proj(x))
        if adapter is None:
            return mx.split(self.gate_up_proj(x), 2, axis=-1)
        gate, up = mx.split(adapter("gate_up_proj", x, self.gate_up_proj(x)), 2, axis=-1)
        # Fused at load (models/fusion.py): the LoRAs of the parts.
        return adapter("gate_proj", x, gate), adapter("up_proj", x, up)

    def __call__(self, x: mx.array, adapter: Optional[Adapter] = None) -> mx.array:
        act = swiglu(*self.gate_up(x, adapter))
        return self.down_proj(act) if adapter is None else adapter("down_proj", act, self.down_proj(act))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.self_attn = Attention(args)
        self.mlp = MLP(args)
        self.input_layernorm = RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(
        self,
        x: mx.array,
        mask: Union[None, str, mx.array],
        cache: Optional[Any],
        positions: mx.array,
        adapter: Optional[Adapter] = None,
        cached_rows: Optional[int] = None,
    ) -> mx.array:
        """The one decoder block, shared by plain decoding, the speculative pass
        and both training passes.

        Args:
            x: (B, L, dim) rows: tokens, tree nodes, or [main rows | stream rows]; or
                (L, dim), the rows of one sequence, all cached and without an adapter
                (a plain step's, a pass's lower layers'), in fewer operations
                (:meth:`Attention.rows`).
            mask: attention mask over [cache contents | rows]; None, "causal" or an array.
            cache: anything with ``update_and_fetch(k, v)`` (a KV cache, or the
                training tape of main keys/values), or None.
            positions: (B, L) RoPE positions of the rows, or their :class:`Rotation`.
            adapter: adds a low-rank delta to projections (the stream LoRA on
                stream rows only, or a LoRA on every row); None for the base.
            cached_rows: how many leading rows are written to ``cache``; None
                writes all. The rest attend to the cache and each other only.
        """
        h = x + self.self_attn(self.input_layernorm(x), mask, cache, positions, adapter, cached_rows)
        return h + self.mlp(self.post_attention_layernorm(h), adapter)


class DecoderModel(nn.Module):
    """``model.*`` in HF naming: embeddings, blocks and the final norm."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [TransformerBlock(args) for _ in range(args.num_hidden_layers)]
        self.norm = RMSNorm(args.hidden_size, eps=args.rms_norm_eps)


def default_positions(length: int, cache: Optional[List[Any]], batch: int = 1) -> mx.array:
    """Contiguous positions after whatever the cache already holds; (B, L) int32."""
    offset = cache[0].offset if cache else 0
    pos = mx.arange(offset, offset + length, dtype=mx.int32)[None]
    return mx.broadcast_to(pos, (batch, length)) if batch > 1 else pos


class Model(nn.Module):
    """A causal LM. ``Model(args)(inputs, cache)`` returns logits (B, L, vocab)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.model = DecoderModel(args)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    @property
    def layers(self):
        return self.model.layers

    def embed(self, tokens: mx.array) -> mx.array:
        """Input rows of ``tokens`` (B, L): the embedding lookup (scaled where the
        architecture scales it)."""
        return self.model.embed_tokens(tokens)

    def lm_logits(self, h: mx.array) -> mx.array:
        """Final norm and LM head on hidden states."""
        h = self.model.norm(h)
        if self.args.tie_word_embeddings:
            return self.model.embed_tokens.as_linear(h)
        return self.lm_head(h)

    def head_rows(self, ids: mx.array) -> "HeadRows":
        """The final norm and the LM head restricted to the vocabulary entries ``ids``:
        ``head_rows(ids)(h)`` is ``lm_logits(h)[..., ids]`` (to rounding), reading and
        multiplying ``len(ids)`` rows of the head's weights instead of the vocabulary's.
        The rows are copied now, float or quantized as the head is, and where the head is a
        float32 expansion that keeps its stored form, so do the rows."""
        layer = self.model.embed_tokens if self.args.tie_word_embeddings else self.lm_head
        rows = {k: layer[k][ids] for k in ("weight", "scales", "biases", "bias") if k in layer}
        form = stored.stored_form(layer) if "scales" not in rows else None
        if form is not None:
            form = stored.StoredForm(form.weight[ids], form.scales[ids], form.biases[ids], form.bits, form.group_size)
        mx.eval(rows, *(() if form is None else (form.weight, form.scales, form.biases)))
        return HeadRows(self.model.norm, rows, layer, form)

    def token_logits(self, h: mx.array, ids: mx.array) -> mx.array:
        """(n,) logit of token ``ids[i]`` at hidden state ``h[i]`` ((n, hidden) before the
        final norm): ``lm_logits(h)[i, ids[i]]`` to rounding, from the ``n`` head rows alone."""
        layer = self.model.embed_tokens if self.args.tie_word_embeddings else self.lm_head
        w = layer["weight"][ids]
        if "scales" in layer:
            biases = layer["biases"][ids] if "biases" in layer else None
            mode = getattr(layer, "mode", "affine")
            w = mx.dequantize(w, layer["scales"][ids], biases, layer.group_size, layer.bits, mode)
        y = (self.model.norm(h) * w).sum(axis=-1)
        return y + layer["bias"][ids] if "bias" in layer else y

    def __call__(
        self,
        inputs: mx.array,
        cache: Optional[List[Any]] = None,
        positions: Optional[mx.array] = None,
        mask: Union[None, str, mx.array] = None,
    ) -> mx.array:
        """Logits for ``inputs`` (B, L).

        Args:
            inputs: token ids (B, L).
            cache: one KV cache per layer, or None.
            positions: RoPE positions (B, L); default contiguous after the cache.
            mask: attention mask over [cached prefix | inputs]; default causal.
        """
        B, L = inputs.shape
        if positions is None:
            positions = default_positions(L, cache, B)
        if mask is None and L > 1:
            mask = "causal"
        h = self.embed(inputs)
        layer_caches = cache if cache is not None else [None] * len(self.layers)
        rot = self.rotation(positions)
        for layer, c in zip(self.layers, layer_caches):
            h = layer(h, mask, c, rot)
        return self.lm_logits(h)

    def rotation(self, positions: Union[mx.array, Rotation]) -> Rotation:
        """RoPE angles of rows at ``positions`` (B, L), shared by every layer."""
        if isinstance(positions, Rotation):
            return positions
        return self.layers[0].self_attn.rope.angles(positions)

    def sanitize(self, weights: Dict[str, mx.array]) -> Dict[str, mx.array]:
        """Drop what HF checkpoints carry but this model does not use."""
        weights = {k: v for k, v in weights.items() if "rotary_emb.inv_freq" not in k}
        if self.args.tie_word_embeddings:
            weights.pop("lm_head.weight", None)
        return weights


class HeadRows:
    """A model's final norm and the rows ``ids`` of its LM head (:meth:`Model.head_rows`):
    ``head(h)`` is the logits of those entries. ``weight`` is the copied rows as the head
    holds them; ``form`` their stored form where the head is a float32 expansion that keeps
    one (the CPU product kernel can then read the rows as stored,
    :func:`~specstream_mlx.runtime.stored_weights.register`), else None."""

    def __init__(self, norm: nn.Module, rows: Dict[str, mx.array], layer: nn.Module, form=None):
        self.norm, self.rows, self.form = norm, rows, form
        self.weight = rows["weight"]
        if "scales" in rows:
            self._quantized = (getattr(layer, "mode", "affine"), layer.group_size, layer.bits)
        else:
            self._quantized = None
            self._weight_t = self.weight.T

    def product(self, x: mx.array) -> mx.array:
        if self._quantized is None:
            return x @ self._weight_t
        mode, group_size, bits = self._quantized
        rows = self.rows
        return mx.quantized_matmul(x, rows["weight"], rows["scales"], rows.get("biases"), True, group_size, bits, mode)

    def __call__(self, h: mx.array) -> mx.array:
        y = self.product(self.norm(h))
        return y + self.rows["bias"] if "bias" in self.rows else y
