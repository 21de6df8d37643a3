"""Attention's two forms: MLX's fused kernel, and the same arithmetic composed of products.

``fused`` is one ``mx.fast.scaled_dot_product_attention`` call. Where MLX has a kernel of its
own for it (Metal) that is one launch; where it has none, MLX composes it from operations at
graph-building time, and its softmax is MLX's own build: on the Linux x86 wheel (baseline
x86-64) a scalar loop with a libm call per multiply-add of every ``exp``. On a 9-node tree
pass of SmolLM2 on a 2-core CPU that softmax and its calls were a tenth of the stream thread.

``composed`` computes the same attention as matrix products around a softmax whose
exponentials are one compiled element-wise kernel (which :mod:`specstream_mlx.cpu_jit`
builds with the CPU's vector instructions). The queries of a key/value head, every row of
each query head, are the rows of one product against the head's keys and one against its
values: grouped-query attention needs no repeated keys, and a layer is 2 x Hkv products of
H/Hkv x L rows, where MLX's composition runs 2 x H products of L rows (for one query row,
single-row products). The probabilities are normalised after the second product (L x D
divisions instead of L x S). The same values to rounding.

Which form a loaded model decodes with is a measured choice per machine and head layout
(:mod:`specstream_mlx.runtime.attention_choice`), never a check of the device: on a GPU
with MLX's kernel, ``fused`` is expected to win and is kept unless the measurement says
otherwise. Training and conversion use ``fused``.
"""

from __future__ import annotations

from functools import partial
from typing import Union

import mlx.core as mx

FORMS = ("fused", "composed")
# Raised when a form's arithmetic changes, so that verdicts stored for the previous one
# (runtime.attention_choice) are measured again. 2: several query rows folded as one;
# 3: the masked scores scaled in one compiled kernel.
FORMS_VERSION = 3


def fused_attention(q: mx.array, k: mx.array, v: mx.array, scale: float, mask: Union[None, str, mx.array]):
    """MLX's scaled dot-product attention; q (B, H, L, D), k/v (B, Hkv, S, D) -> (B, H, L, D)."""
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)


# Element-wise work around the row's largest score, compiled: op by op (a tree pass) MLX's
# CPU backend runs a select or an add whose mask broadcasts over heads and rows as a general
# strided loop, and the two compiled kernels took 2.35 against 2.97 ms over SmolLM2's 30
# layers at 9 rows. Shapeless (the key count grows every step). The reduction stays outside:
# with it inside the compiled function too, the HTTP server crashed on its first request, in
# a segfault inside MLX's max reduction (tests/test_hostile.py), where only element-wise
# kernels compiled this way have ever run. A Python float scale is a constant of the trace.
@partial(mx.compile, shapeless=True)
def _exp(s: mx.array, top: mx.array, scale: float) -> mx.array:
    return mx.exp((s - top) * scale)


@partial(mx.compile, shapeless=True)
def _scaled_kept(s: mx.array, keep: mx.array, scale: float) -> mx.array:
    # Masked keys at -inf: their exponential is 0, and every row keeps at least one key.
    return mx.where(keep, s * scale, -mx.inf)


@partial(mx.compile, shapeless=True)
def _scaled_added(s: mx.array, added: mx.array, scale: float) -> mx.array:
    return s * scale + added


def _folded_mask(mask: mx.array, rep: int, rows: int) -> mx.array:
    """A mask that broadcasts to (B, H, L, S) as one that broadcasts to (B, Hkv, rep·L, S):
    the rows of a key/value head's query heads one after another, as the queries are folded."""
    b, heads, mask_rows, keys = (1,) * (4 - mask.ndim) + mask.shape
    if heads == 1 and mask_rows == 1:
        return mask  # the same keys for every head and row (a plain step's): it broadcasts as it is
    groups = 1 if heads == 1 else heads // rep
    m = mask.reshape(b, groups, heads // groups, mask_rows, keys)
    return mx.broadcast_to(m, (b, groups, rep, rows, keys)).reshape(b, groups, rep * rows, keys)


def _softmax_numerators(s: mx.array, scale: float, mask: Union[None, mx.array]) -> mx.array:
    """exp(scale * s - the row's largest) where ``mask`` keeps (0 elsewhere); ``mask``
    broadcasts to ``s``: boolean (True: attend) or added to the scaled scores."""
    if mask is None:
        return _exp(s, s.max(axis=-1, keepdims=True), scale)
    if mask.dtype == mx.bool_:
        z = _scaled_kept(s, mask, scale)
    else:
        z = _scaled_added(s, mask.astype(mx.float32), scale)
    return _exp(z, z.max(axis=-1, keepdims=True), 1.0)


# Causal queries in blocks of this many rows (a prompt's chunk): each block attends to the keys
# up to its own last row only. The composed form computes every score of its (L x S) square,
# masked ones included, so a 512-row chunk of a prompt computed nearly twice the scores it
# needed, and each intermediate was the whole square. In blocks of 64, SmolLM2's prompts of
# 300 / 512 / 1,024 tokens took 0.89x / 0.77x / 0.79x as long on an Intel Xeon (32: 0.95x /
# 0.82x / 0.83x; 128: 0.95x / 0.83x / 0.82x; bench/README.md). Each row sees the same keys as
# in the whole square; masked ones only ever added zeros.
CAUSAL_BLOCK = 64


def composed_attention(q: mx.array, k: mx.array, v: mx.array, scale: float, mask: Union[None, str, mx.array]):
    """The same as :func:`fused_attention`, composed of two products and a compiled softmax.

    ``mask``: None, ``"causal"`` (a key at or before its query, the queries being the last L
    of the S keys) or an array that broadcasts to (B, H, L, S): boolean (True: attend) or
    added to the scores. Every query must see at least one key."""
    B, H, L, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    rep = H // Hkv
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"unknown attention mask {mask!r}")
        if L > CAUSAL_BLOCK + CAUSAL_BLOCK // 2:
            # Rows [i, j) are the last j - i queries of the first S - L + j keys: causal again.
            blocks = []
            for i in range(0, L, CAUSAL_BLOCK):
                j = min(i + CAUSAL_BLOCK, L)
                keys = S - L + j
                blocks.append(composed_attention(q[:, :, i:j], k[:, :, :keys], v[:, :, :keys], scale, "causal"))
            return mx.concatenate(blocks, axis=2)
        # A key at or before its query (one query: the last key's, it sees them all).
        mask = None if L == 1 else mx.arange(S)[None] <= mx.arange(S - L, S)[:, None]
    # The queries of a key/value head, every row of each, are the rows of one product
    # against the head's keys and one against its values: (B, Hkv, rep·L, D) @ (B, Hkv, D, S).
    s = (q.reshape(B, Hkv, rep * L, D) @ k.swapaxes(-1, -2)).astype(mx.float32)
    p = _softmax_numerators(s, scale, None if mask is None else _folded_mask(mask, rep, L))
    out = p.astype(v.dtype) @ v
    return (out / p.sum(axis=-1, keepdims=True).astype(v.dtype)).reshape(B, H, L, D)


def attention_fn(form: str):
    """The attention function of ``form`` (one of :data:`FORMS`)."""
    if form == "fused":
        return fused_attention
    if form == "composed":
        return composed_attention
    raise ValueError(f"unknown attention form {form!r}; available: {', '.join(FORMS)}")
