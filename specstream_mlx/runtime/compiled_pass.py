"""The speculative pass as one compiled graph per tree shape.

:func:`~specstream_mlx.method.msa.ss_forward` builds its graph op by op in
Python for every pass; on small models that building and the per-operation
dispatch cost more than the arithmetic. :class:`SSPass` traces the same pass
(the same layer code: :func:`lower_layers`, :func:`msa_layers`,
:func:`pass_outputs`) once per shape with ``mx.compile``, which also fuses its
element-wise operations. What varies from pass to pass is data, not shape:

* the cache offset is an input array, and the pass writes its main rows into
  the whole KV buffer at that offset (:class:`OffsetWriter`), so one graph
  serves every offset up to the buffer's capacity (it grows 256 rows at a time);
* attention reads the buffer's first rows up to the tree's end rounded up to 64
  (:func:`~.cache.attention_span`, given by an input of that many key positions);
  masks cover that span: the cached prefix, the tree part at the offset, nothing
  beyond. The tree parts are cached per tree shape;
* tokens, positions and which nodes host streams are inputs.

A shape is (tree nodes, hosts, streams per host, cache capacity, span): a dynamic
tree of budget b always has b + 1 nodes, so each budget compiles once per
capacity step. Early-exit pruning needs a host sync between the lower and the
top layers (the kept nodes decide the top layers' shape), so pruned passes and
passes without a filled cache run :func:`ss_forward` as before.

Whether compiling pays depends on the device and the model's size; passes run op by op
unless ``SPECSTREAM_COMPILE=1`` (docs/DESIGN.md, decision 18).
"""

from __future__ import annotations

from functools import lru_cache
from typing import List, Optional

import mlx.core as mx
import numpy as np

from ..method.msa import (
    SSOutput,
    kept_hosts,
    lower_layers,
    msa_layers,
    msa_part_for,
    pass_gamma,
    pass_outputs,
    ss_forward,
)
from ..method.streams import StreamParams
from ..method.tree import Tree, tree_buffers
from .cache import KVCache, OffsetWriter, attention_span, key_positions


@lru_cache(maxsize=256)
def _ancestor_part(parents: tuple) -> mx.array:
    return mx.array(tree_buffers(parents).ancestor_mask)


def span_mask(offset: mx.array, part: mx.array, n: int, span_positions: mx.array) -> mx.array:
    """[prefix | tree part | hidden] over the buffer's first ``len(span_positions)`` rows,
    then the part's columns past ``n`` (stream rows, which are never cached).

    ``part``: (rows, n [+ stream rows]) tree block of the mask; ``offset``: (1,) int32;
    ``span_positions``: (span,) int32, 0 .. span - 1, span >= offset + n."""
    rows, span = part.shape[0], span_positions.shape[0]
    prefix = mx.broadcast_to(span_positions[None] < offset, (rows, span))
    m = mx.slice_update(prefix, part[:, :n], offset, axes=(1,))
    return mx.concatenate([m, part[:, n:]], axis=1) if part.shape[1] > n else m


def smallest_window(model) -> Optional[int]:
    """The shortest sliding window of any layer, or None when every layer attends globally."""
    windows = [w for w in (getattr(layer.self_attn, "window", None) for layer in model.layers) if w]
    return min(windows) if windows else None


class SSPass:
    """Runs speculative passes for one model and its streams; compiled where possible.

    Args:
        model: the base model.
        streams: its speculative streams.
        compiled: True compiles what it can; False (default) runs every pass op by op
            (:func:`ss_forward`).
    """

    def __init__(self, model, streams: StreamParams, compiled: bool = False):
        self.model, self.streams, self.compiled = model, streams, compiled
        self._fns = {}

    def usable(self, cache, pruning_threshold: float, n: int) -> bool:
        """Whether this pass can run compiled: no pruning, and a cache that already holds
        the prefix (the compiled pass writes into existing buffers)."""
        if not self.compiled or not cache or (pruning_threshold > 0 and n > 1):
            return False
        # The whole-buffer layout gives the tree's rows their buffer index as position for a
        # sliding window's reach (base.window_mask): exact only while no window is shorter
        # than the rows can reach, so shorter ones run op by op.
        window = smallest_window(self.model)
        if window is not None and window <= n + self.streams.num_streams:
            return False
        return all(isinstance(c, KVCache) and c.keys is not None for c in cache)

    def __call__(
        self,
        tree: Tree,
        offset: int,
        cache,
        pruning_threshold: float = 0.0,
        num_streams: Optional[int] = None,
        hosts: Optional[np.ndarray] = None,
    ) -> SSOutput:
        """Same arguments and result as :func:`ss_forward`."""
        n = len(tree)
        if not self.usable(cache, pruning_threshold, n):
            return ss_forward(self.model, self.streams, tree, offset, cache, pruning_threshold, num_streams, hosts)
        buf = tree_buffers(tree.parents)
        gamma = pass_gamma(self.streams, num_streams)
        host_nodes = kept_hosts(np.arange(n), hosts)
        every = len(host_nodes) == n
        parents = tuple(int(p) for p in buf.parents)
        msa_part = msa_part_for(parents, gamma, None if every else tuple(int(h) for h in host_nodes))
        for c in cache:
            c.reserve(n)
        # One capacity for every layer: the graph builds all masks from layer 0's. Layers
        # can differ after a pruned pass, whose stream layers write only the kept rows.
        capacity = max(c.capacity for c in cache)
        for c in cache:
            c.grow_to(capacity)
        keys: List[mx.array] = [c.keys for c in cache]
        values: List[mx.array] = [c.values for c in cache]
        main_logits, stream_hidden, s_logits, new_keys, new_values = self._fn(every)(
            mx.array(np.asarray(tree.tokens, dtype=np.int32)[None]),
            mx.array((offset + buf.depths)[None].astype(np.int32)),
            mx.array([offset], dtype=mx.int32),
            key_positions(attention_span(offset + n, capacity)),
            _ancestor_part(parents),
            msa_part,
            mx.array(host_nodes.astype(np.int32)),
            keys,
            values,
        )
        # Drop the old buffers' last references before evaluation, so the writes can reuse them.
        del keys, values
        for c, k, v in zip(cache, new_keys, new_values):
            c.adopt(k, v, n)
        return SSOutput(
            tree,
            buf,
            np.arange(n),
            main_logits,
            stream_hidden,
            0,
            offset,
            host_nodes,
            s_logits if s_logits.ndim == 3 else None,  # (0,): the pass left them for later
        )

    def _fn(self, every: bool):
        if every not in self._fns:
            model, streams = self.model, self.streams

            def body(tokens, positions, offset, span_positions, anc, msa_part, host_nodes, keys, values):
                n, span = tokens.shape[1], span_positions.shape[0]
                n_hosts = host_nodes.shape[0]
                gamma = (msa_part.shape[0] - n) // max(n_hosts, 1)
                writers = [OffsetWriter(k, v, offset, span) for k, v in zip(keys, values)]
                h = lower_layers(model, streams, tokens, positions, span_mask(offset, anc, n, span_positions), writers)
                mask = span_mask(offset, msa_part, n, span_positions)
                rows = None if every else host_nodes
                x = msa_layers(model, streams, h, positions, rows, n_hosts, gamma, mask, writers)
                main_logits, stream_hidden, s_logits = pass_outputs(model, streams, x, n, n_hosts, gamma)
                if s_logits is None:
                    s_logits = mx.zeros((0,), dtype=main_logits.dtype)  # compiled outputs are always arrays
                return main_logits, stream_hidden, s_logits, [w.keys for w in writers], [w.values for w in writers]

            # Weights are implicit inputs, read at every call: updating them (training) is seen.
            self._fns[every] = mx.compile(body, inputs=[model.state, streams.state])
        return self._fns[every]
