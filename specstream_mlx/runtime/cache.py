"""Preallocated KV cache with commit of an accepted path.

A step writes ``n`` rows (a token, a prompt chunk, or a flattened draft tree) at
``offset .. offset+n`` and advances ``offset``. After verification,
``commit(slots)`` gathers the accepted rows of that step into
``start .. start+len(slots)`` and sets the offset there, so nothing of a
rejected path stays visible. Storage grows in chunks of ``step`` rows and is
never copied as a whole per decoding step.
"""

from __future__ import annotations

from functools import lru_cache
from typing import List, Optional, Sequence, Union

import mlx.core as mx

from ..method.msa import slot_index


class KVCache:
    """One layer's keys and values, shaped (B, kv_heads, capacity, head_dim)."""

    step = 256

    def __init__(self):
        self.keys: Optional[mx.array] = None
        self.values: Optional[mx.array] = None
        self.offset = 0
        # Where the last update_and_fetch started writing; commit() is relative to it.
        self._last_start = 0
        self._last_len = 0

    @property
    def capacity(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def _grow(self, needed: int, like_k: mx.array, like_v: mx.array) -> None:
        B, H, _, Dk = like_k.shape
        Dv = like_v.shape[3]
        new_cap = (needed + self.step - 1) // self.step * self.step
        keep = self.offset if self.keys is not None else 0
        new_k = mx.zeros((B, H, new_cap - keep, Dk), like_k.dtype)
        new_v = mx.zeros((B, H, new_cap - keep, Dv), like_v.dtype)
        if self.keys is None:
            self.keys, self.values = new_k, new_v
        else:
            # Only growth copies the stored rows; it happens once per `step` tokens.
            self.keys = mx.concatenate([self.keys[..., :keep, :], new_k], axis=2)
            self.values = mx.concatenate([self.values[..., :keep, :], new_v], axis=2)

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """Write (B, H, n, D) rows at the offset, advance it, return all visible rows."""
        n = keys.shape[2]
        start = self.offset
        if self.keys is None or start + n > self.capacity:
            self._grow(start + n, keys, values)
        self.keys[..., start : start + n, :] = keys
        self.values[..., start : start + n, :] = values
        self.offset = start + n
        self._last_start, self._last_len = start, n
        return self.keys[..., : self.offset, :], self.values[..., : self.offset, :]

    def reserve(self, n: int) -> None:
        """Make room for ``n`` more rows after the offset in the existing buffers (the
        compiled pass writes into them in place)."""
        if self.offset + n > self.capacity:
            self._grow(self.offset + n, self.keys, self.values)

    def grow_to(self, capacity: int) -> None:
        """Grow the buffers to at least ``capacity`` rows (stored rows are kept)."""
        if self.capacity < capacity:
            self._grow(capacity, self.keys, self.values)

    def adopt(self, keys: mx.array, values: mx.array, n: int) -> None:
        """Take buffers in which a step wrote ``n`` rows at the offset (see :class:`OffsetWriter`)."""
        self.keys, self.values = keys, values
        self._last_start, self._last_len = self.offset, n
        self.offset += n

    def trim(self, n: int) -> int:
        """Forget the last ``n`` rows; returns how many were trimmed."""
        n = max(0, min(self.offset, n))
        self.offset -= n
        return n

    def commit(self, slots: Union[Sequence[int], mx.array], index: Optional[mx.array] = None) -> None:
        """Keep rows ``slots`` (indices into the last step's rows, in path order)
        at ``start .. start+len(slots)`` and make that the new offset. ``index``: the
        same slots as an int32 array, built once for every layer by the caller."""
        slots = slots.tolist() if isinstance(slots, mx.array) else [int(i) for i in slots]
        a = len(slots)
        if a > self._last_len:
            raise ValueError(f"commit of {a} slots after a step of {self._last_len} rows")
        start = self._last_start
        # A path 0..a-1 is already in place (a chain draft accepted from its root).
        if slots != list(range(a)):
            src = start + (index if index is not None else mx.array(slots, dtype=mx.int32))
            self.keys[..., start : start + a, :] = mx.take(self.keys, src, axis=2)
            self.values[..., start : start + a, :] = mx.take(self.values, src, axis=2)
        self.offset = start + a
        self._last_len = a


# Compiled graphs attend over the buffer's first rows in multiples of this many.
SPAN_GRANULE = 64


def attention_span(end: int, capacity: int, granule: int = SPAN_GRANULE) -> int:
    """How many leading buffer rows a compiled graph attends over when its rows end at
    ``end``: ``end`` rounded up to ``granule``, at most ``capacity``.

    Attention's cost grows with the keys it reads and scores (on MLX's CPU backend a
    scalar softmax over each), so rows the buffer holds for later are not paid for; each
    span is a shape, traced once."""
    return min(capacity, -(-end // granule) * granule)


@lru_cache(maxsize=1024)
def key_positions(span: int) -> mx.array:
    """0 .. span - 1 (int32), the input whose shape tells a compiled graph its span;
    made once per span."""
    return mx.arange(span, dtype=mx.int32)


class OffsetWriter:
    """A layer's whole KV buffers, written at an offset held on the device.

    What a compiled graph uses instead of :class:`KVCache`: the offset is an input
    array, not a Python int, so one compiled graph serves every offset; keys are
    returned up to ``span`` rows (default: the whole capacity) and the caller's mask
    hides rows past the written ones."""

    def __init__(self, keys: mx.array, values: mx.array, offset: mx.array, span: Optional[int] = None):
        self.keys, self.values, self.offset = keys, values, offset
        self.span = span

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        self.keys = mx.slice_update(self.keys, keys, self.offset, axes=(2,))
        self.values = mx.slice_update(self.values, values, self.offset, axes=(2,))
        if self.span is None or self.span >= self.keys.shape[2]:
            return self.keys, self.values
        return self.keys[:, :, : self.span], self.values[:, :, : self.span]


def make_cache(model) -> List[KVCache]:
    """One cache per decoder layer."""
    return [KVCache() for _ in model.layers]


def trim_cache(cache: List[KVCache], n: int) -> None:
    for c in cache:
        c.trim(n)


def commit_cache(cache: List[KVCache], slots: Sequence[int]) -> None:
    slots = [int(i) for i in slots]
    index = slot_index(slots)
    for c in cache:
        c.commit(slots, index)
