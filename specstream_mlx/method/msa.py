"""One speculative-streaming forward pass over a flattened draft tree.

Lower layers (0 .. N-Ns-1) run the tree's main rows under the ancestor mask.
At the input of layer N-Ns, optional pruning drops low-probability subtrees
(early-exit adapter through the LM head), then every kept node hosts γ
streams ``S[t, j] = M[t] + P[j]``. The top Ns layers run multi-stream
attention on ``[kept main rows | their streams]`` with one fused mask:

* main row t sees the cached prefix and its kept ancestors (never a stream,
  docs/DESIGN.md §2.1, so main logits equal the model without streams);
* stream (t, j) sees the prefix, t's kept ancestors and t, and streams
  (t, 1..j) of its own node.

Positions: node at depth d -> offset + d; stream j of a node at p -> p + j.
Only main rows are written to the KV cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import mlx.core as mx
import numpy as np

from .streams import LoRAAdapter, StreamParams, stream_row_mask
from .tree import Tree, TreeBuffers, restrict, subtree_keep, tree_buffers


def prefix_tree_mask(offset: int, tree_part: np.ndarray) -> Optional[mx.array]:
    """Boolean mask [all of the cached prefix | tree_part]; None when trivially full."""
    rows = tree_part.shape[0]
    if rows == 1 and tree_part.all():
        return None
    part = mx.array(tree_part)
    if offset == 0:
        return part
    return mx.concatenate([mx.ones((rows, offset), dtype=mx.bool_), part], axis=1)


def msa_tree_part(anc: np.ndarray, gamma: int) -> np.ndarray:
    """The tree block of the MSA mask: rows [main n | streams n*γ], keys likewise.

    Streams are laid out node-major: stream (t, j) (j = 1..γ) is row n + t*γ + j-1."""
    n = anc.shape[0]
    R = n * (1 + gamma)
    m = np.zeros((R, R), dtype=bool)
    m[:n, :n] = anc
    m[n:, :n] = np.repeat(anc, gamma, axis=0)
    # Streams of one node: a lower-triangular γ x γ block on the diagonal.
    blocks = np.kron(np.eye(n, dtype=bool), np.tril(np.ones((gamma, gamma), dtype=bool)))
    m[n:, n:] = blocks
    return m


@dataclass
class SSOutput:
    """Result of :func:`ss_forward`.

    Attributes:
        tree: the kept (pruned) tree, re-indexed.
        buffers: its tree buffers.
        kept: original index of each kept node.
        main_logits: (n_kept, V) target logits at each kept node.
        stream_hidden: (n_kept, γ, h) normed-later hidden states of the streams.
        pruned: nodes dropped by pruning.
        offset: cached prefix length when the pass started (the root's position).
    """

    tree: Tree
    buffers: TreeBuffers
    kept: np.ndarray
    main_logits: mx.array
    stream_hidden: mx.array
    pruned: int
    offset: int = 0


def ss_forward(
    model,
    streams: StreamParams,
    tree: Tree,
    offset: int,
    cache,
    pruning_threshold: float = 0.0,
    num_streams: Optional[int] = None,
) -> SSOutput:
    """Verify ``tree`` (main rows) and host streams at its nodes, in one pass.

    ``num_streams``: host only streams 1..g (default all γ) when the next tree
    cannot be deeper than g. Stream j attends to streams <= j of its node only,
    so the hosted streams compute exactly what they would with all γ present."""
    buf = tree_buffers(tree.parents)
    n = len(tree)
    gamma = streams.num_streams if num_streams is None else max(1, min(num_streams, streams.num_streams))
    layers = model.layers
    s0 = streams.first_layer
    positions = mx.array((offset + buf.depths)[None].astype(np.int32))
    h = model.model.embed_tokens(mx.array(tree.tokens, dtype=mx.int32)[None])
    mask = prefix_tree_mask(offset, buf.ancestor_mask)
    for i in range(s0):
        h = layers[i](h, mask, cache[i] if cache else None, positions)

    kept = np.arange(n)
    kept_tree, kept_buf = tree, buf
    if pruning_threshold > 0 and n > 1:
        keep = _early_exit_keep(model, streams, h, tree, buf, pruning_threshold)
        if not keep.all():
            kept_tree, kept = restrict(tree, keep)
            kept_buf = tree_buffers(kept_tree.parents)
            idx = mx.array(kept.astype(np.int32))
            h = h[:, idx]
            positions = positions[:, idx]
    nk = len(kept)

    # Stream insertion: S[t, j] = M[t] + P[j], node-major.
    S = (h[0][:, None, :] + streams.embeddings[None, :gamma]).reshape(1, nk * gamma, -1)
    x = mx.concatenate([h, S], axis=1)
    stream_pos = (positions[0][:, None] + mx.arange(1, gamma + 1, dtype=mx.int32)[None]).reshape(1, -1)
    pos_all = mx.concatenate([positions, stream_pos], axis=1)
    mask = prefix_tree_mask(offset, msa_tree_part(kept_buf.ancestor_mask, gamma))
    row_mask = stream_row_mask(nk, x.shape[1], x.dtype) if streams.lora else None
    for i in range(s0, len(layers)):
        loras = streams.layer_lora(i)
        adapter = LoRAAdapter(loras, row_mask) if loras else None
        x = layers[i](x, mask, cache[i] if cache else None, pos_all, adapter, cached_rows=nk)
    main_logits = model.lm_logits(x[:, :nk])[0]
    stream_hidden = x[0, nk:].reshape(nk, gamma, -1)
    return SSOutput(kept_tree, kept_buf, kept, main_logits, stream_hidden, n - nk, offset)


def _early_exit_keep(model, streams: StreamParams, h, tree: Tree, buf: TreeBuffers, threshold: float) -> np.ndarray:
    """Nodes kept by early-exit pruning (paper §3.1.3): the transition probability
    parent -> child of the early-exit head at the insertion layer must reach
    ``threshold`` for the child and for each of its ancestors."""
    ee = model.lm_logits(streams.pruning(h))[0]  # (n, V)
    logp = ee - mx.logsumexp(ee, axis=-1, keepdims=True)
    par = mx.array(buf.parents[1:].astype(np.int32))
    tok = mx.array(np.asarray(tree.tokens[1:], dtype=np.int32))
    trans = np.array(mx.exp(logp[par, tok]))
    return subtree_keep(tree.parents, np.concatenate([[True], trans >= threshold]))


def stream_logits(model, out: SSOutput, node: int) -> mx.array:
    """(γ, V) logits of the streams hosted at kept node ``node`` (int or device scalar)."""
    return model.lm_logits(out.stream_hidden[node][None])[0]


def commit_ss(cache, streams: StreamParams, out: SSOutput, path) -> None:
    """Keep the accepted path: lower layers index the full tree, MSA layers the kept rows."""
    s0 = streams.first_layer
    lower = [int(out.kept[i]) for i in path]
    for i, c in enumerate(cache):
        c.commit(lower if i < s0 else path)
