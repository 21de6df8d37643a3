"""The plain decoding step as one compiled graph.

A plain step runs some twenty operations per layer besides its matrix products
(norms, rotations, the cache write, attention, the activation, residuals); op by op,
each is built in Python and dispatched on its own. Compiled, the graph is traced
once and its element-wise work fuses into fewer kernels, on every backend.

What varies from step to step is data, not shape: the cache offset is an input
array, the step writes its key and value rows into the whole KV buffer at that
offset (:class:`~.cache.OffsetWriter`), and the mask hides every row past it. One
graph serves every offset up to the buffer's capacity, which grows 256 rows at a
time. Attention reads only the buffer's first rows, the offset rounded up to 64
(:func:`~.cache.attention_span`): the span is a shape, given by an input of that many
key positions, so each (capacity, span) traces once (about 10 ms for SmolLM2 here; at a
280-token context the whole-capacity step was 1.03–1.05× slower,
``examples/plain_step_ablation.py``). A cache without buffers yet (no prefix) takes the
op-by-op step.
"""

from __future__ import annotations

from typing import List

import mlx.core as mx

from .cache import KVCache, OffsetWriter, attention_span, key_positions


class PlainStep:
    """``step(token, cache)`` -> (1, V) logits of the next token, cache advanced by one.

    Args:
        model: the base causal LM (weights are read at every call, so updates are seen).
    """

    def __init__(self, model):
        self.model = model
        self._fn = mx.compile(self._body, inputs=[model.state])

    def _body(
        self, token: mx.array, offset: mx.array, span_positions: mx.array, keys: List[mx.array], values: List[mx.array]
    ):
        model = self.model
        writers = [OffsetWriter(k, v, offset, span_positions.shape[0]) for k, v in zip(keys, values)]
        mask = (span_positions <= offset)[None]  # (1, span): prefix and this row
        # The row stays (1, dim) through the layers: their one-row form (Attention.rows).
        h = model.embed(token.reshape(1))
        rot = model.rotation(offset.reshape(1, 1))
        for layer, w in zip(model.layers, writers):
            h = layer(h, mask, w, rot)
        return model.lm_logits(h), [w.keys for w in writers], [w.values for w in writers]

    def __call__(self, token: mx.array, cache: List[KVCache]) -> mx.array:
        if not cache or any(not isinstance(c, KVCache) or c.keys is None for c in cache):
            return self.model(token.reshape(1, 1), cache=cache)[:, -1, :]
        for c in cache:
            c.reserve(1)
        # One capacity for every layer (a pruned speculative pass can leave them apart).
        capacity = max(c.capacity for c in cache)
        for c in cache:
            c.grow_to(capacity)
        keys = [c.keys for c in cache]
        values = [c.values for c in cache]
        span_positions = key_positions(attention_span(cache[0].offset + 1, capacity))
        offset = mx.array(cache[0].offset, dtype=mx.int32)
        logits, new_keys, new_values = self._fn(token, offset, span_positions, keys, values)
        del keys, values  # the old buffers' last references: the writes can reuse them
        for c, k, v in zip(cache, new_keys, new_values):
            c.adopt(k, v, 1)
        return logits


# The attribute a model keeps its compiled step under: a plain attribute (outside the
# parameter tree). On the model, not in a table of this module: the step holds the model (its
# compiled graph reads the model's weights), so a table would keep every model that ever
# decoded alive; as the model's own attribute the two go together when the caller drops it.
ATTRIBUTE = "_plain_step"


def plain_step(model) -> PlainStep:
    """The compiled step of ``model``, made once per model object and kept while it lives
    (traced graphs are reused by every generation)."""
    step = getattr(model, ATTRIBUTE, None)
    if step is None:
        step = PlainStep(model)
        object.__setattr__(model, ATTRIBUTE, step)
    return step


def forget_plain_step(model) -> None:
    """Drops ``model``'s compiled step: the next one is traced anew (after its attention
    form changed)."""
    if getattr(model, ATTRIBUTE, None) is not None:
        object.__setattr__(model, ATTRIBUTE, None)
