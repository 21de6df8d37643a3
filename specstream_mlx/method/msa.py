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
from functools import lru_cache
from typing import Optional

import mlx.core as mx
import numpy as np

from .streams import LoRAAdapter, StreamParams, own_streams_block, stream_row_mask
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


@lru_cache(maxsize=256)
def msa_part_for(parents: tuple, gamma: int, hosts: Optional[tuple]) -> mx.array:
    anc = tree_buffers(parents).ancestor_mask
    return mx.array(msa_tree_part(anc, gamma, None if hosts is None else np.array(hosts)))


def msa_mask(offset: int, buffers: TreeBuffers, gamma: int, hosts: np.ndarray) -> mx.array:
    """The fused MSA mask [prefix | tree part]; the tree part is built once per tree shape."""
    key = None if len(hosts) == len(buffers.parents) else tuple(int(h) for h in hosts)
    part = msa_part_for(tuple(int(p) for p in buffers.parents), gamma, key)
    if offset == 0:
        return part
    return mx.concatenate([mx.ones((part.shape[0], offset), dtype=mx.bool_), part], axis=1)


def msa_tree_part(anc: np.ndarray, gamma: int, hosts: Optional[np.ndarray] = None) -> np.ndarray:
    """The tree block of the MSA mask: rows [main n | streams of the hosts], keys likewise.

    ``hosts``: the nodes that host streams, in order (default all n). Streams are
    laid out host-major: stream (hosts[s], j) (j = 1..γ) is row n + s*γ + j-1; it
    sees its host's ancestors and the host (through their main rows) and streams
    1..j of its own host."""
    n = anc.shape[0]
    hosts = np.arange(n) if hosts is None else np.asarray(hosts, dtype=np.int64)
    h = len(hosts)
    R = n + h * gamma
    m = np.zeros((R, R), dtype=bool)
    m[:n, :n] = anc
    m[n:, :n] = np.repeat(anc[hosts], gamma, axis=0)
    m[n:, n:] = own_streams_block(h, gamma)
    return m


def stream_sources(parents: np.ndarray, depths: np.ndarray, hosts: np.ndarray) -> "tuple[np.ndarray, np.ndarray]":
    """Where the next draft comes from when each node is the last accepted one.

    Returns (slot, shift) per node: ``slot`` is the position in ``hosts`` of the
    node itself or, when it hosts no streams, of its nearest hosting ancestor
    (-1 if none); ``shift`` is the depth difference. Stream j of an ancestor at
    depth d predicts the token at depth d + 1 + j, so from a node ``shift``
    levels below it streams ``shift + 1 .. γ`` still draft the next tree."""
    n = len(parents)
    slot_of = {int(hn): s for s, hn in enumerate(hosts)}
    slot = np.full(n, -1, dtype=np.int32)
    shift = np.zeros(n, dtype=np.int32)
    for i in range(n):
        a = i
        while a >= 0 and a not in slot_of:
            a = int(parents[a])
        if a >= 0:
            slot[i] = slot_of[a]
            shift[i] = depths[i] - depths[a]
    return slot, shift


@dataclass
class SSOutput:
    """Result of :func:`ss_forward`.

    Attributes:
        tree: the kept (pruned) tree, re-indexed.
        buffers: its tree buffers.
        kept: original index of each kept node.
        main_logits: (n_kept, V) target logits at each kept node.
        stream_hidden: (n_hosts, g, h) normed-later hidden states of the hosted streams.
        hosts: kept-node index of each host, in the order of ``stream_hidden``.
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
    hosts: Optional[np.ndarray] = None
    # (n_hosts, g, V') stream logits (over the draft vocabulary) when the pass computed them.
    stream_logits: Optional[mx.array] = None

    def sources(self) -> "tuple[np.ndarray, np.ndarray]":
        """Per kept node: the host slot its next draft comes from, and the stream shift."""
        n = len(self.kept)
        if self.hosts is not None and len(self.hosts) == n:  # every node hosts: itself, unshifted
            return np.arange(n, dtype=np.int32), np.zeros(n, dtype=np.int32)
        return stream_sources(self.buffers.parents, self.buffers.depths, self.hosts)

    @property
    def every_node_hosts(self) -> bool:
        return self.hosts is not None and len(self.hosts) == len(self.kept)


def ss_forward(
    model,
    streams: StreamParams,
    tree: Tree,
    offset: int,
    cache,
    pruning_threshold: float = 0.0,
    num_streams: Optional[int] = None,
    hosts: Optional[np.ndarray] = None,
) -> SSOutput:
    """Verify ``tree`` (main rows) and host streams at its nodes, in one pass.

    ``num_streams``: host only streams 1..g (default all γ) when the next tree
    cannot be deeper than g. Stream j attends to streams <= j of its node only,
    so the hosted streams compute exactly what they would with all γ present.

    ``hosts``: tree nodes that host streams (default every node). The next draft
    only needs the accepted node's streams, so hosting them at the likely
    endpoints only cuts top-layer rows; verification (main rows) is unchanged."""
    buf = tree_buffers(tree.parents)
    n = len(tree)
    gamma = pass_gamma(streams, num_streams)
    positions = mx.array((offset + buf.depths)[None].astype(np.int32))
    tokens = mx.array(tree.tokens, dtype=mx.int32)[None]
    mask = prefix_tree_mask(offset, buf.ancestor_mask)
    h = lower_layers(model, streams, tokens, positions, mask, cache, launch_every=LAUNCH_EVERY)

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
    host_nodes = kept_hosts(kept, hosts)
    every = len(host_nodes) == nk  # no gather when every kept node hosts
    hi = None if every else mx.array(host_nodes.astype(np.int32))
    x = msa_layers(
        model, streams, h, positions, hi, len(host_nodes), gamma, msa_mask(offset, kept_buf, gamma, host_nodes), cache
    )
    main_logits, stream_hidden, s_logits = pass_outputs(model, streams, x, nk, len(host_nodes), gamma)
    return SSOutput(kept_tree, kept_buf, kept, main_logits, stream_hidden, n - nk, offset, host_nodes, s_logits)


def pass_gamma(streams: StreamParams, num_streams: Optional[int]) -> int:
    """How many streams a pass hosts per node (all γ by default)."""
    return streams.num_streams if num_streams is None else max(1, min(num_streams, streams.num_streams))


def kept_hosts(kept: np.ndarray, hosts: Optional[np.ndarray]) -> np.ndarray:
    """Kept-node indices of the nodes that host streams (every kept node by default)."""
    if hosts is None:
        return np.arange(len(kept))
    return np.flatnonzero(np.isin(kept, np.asarray(hosts)))


# Layers built between two launches of an op-by-op pass's evaluation (see lower_layers).
LAUNCH_EVERY = 4


def lower_layers(
    model, streams: StreamParams, tokens: mx.array, positions: mx.array, mask, cache, launch_every: int = 0
) -> mx.array:
    """The tree's main rows through layers 0 .. N-Ns-1 (the input of the stream-insertion layer).

    ``launch_every``: queue the evaluation of the rows built so far (``mx.async_eval``) after
    the first layer and then after every that many layers, so the device computes the
    first layers while the host builds the rest of the pass; 0 (inside a compiled graph,
    which cannot evaluate) never. A pass cannot be queued ahead of its predecessor as a
    plain step is (its tree comes from the previous pass's verdict), and building
    SmolLM2's pass op by op takes ~2 ms before anything runs: launched every 4 layers, a
    9-node pass took 24.3 against 26.5 ms, a 1-node pass 18.5 against 20.3
    (``examples/pass_breakdown.py``); launched after the first layer too, greedy
    ``dynamic:8@1`` decoded 1.009-1.011x as fast (docs/DESIGN.md decision 38)."""
    rot = model.rotation(positions)  # once for every layer
    # With a cache the rows go through two-dimensional, (n, dim): fewer operations a layer
    # (Attention.rows); the same values.
    rows = bool(cache)
    h = model.embed(tokens[0] if rows else tokens)
    for i in range(streams.first_layer):
        h = model.layers[i](h, mask, cache[i] if rows else None, rot)
        if launch_every and (i == 0 or i % launch_every == launch_every - 1):
            mx.async_eval(h)
    return h[None] if rows else h


def msa_layers(
    model,
    streams: StreamParams,
    h: mx.array,
    positions: mx.array,
    host_nodes: Optional[mx.array],
    n_hosts: int,
    gamma: int,
    mask: mx.array,
    cache,
) -> mx.array:
    """Insert the streams of the hosts (``host_nodes``, None for every row) and run the
    top Ns layers on ``[main rows | streams]``; only main rows are cached."""
    nk = h.shape[1]
    if n_hosts:
        # Stream insertion: S[t, j] = M[t] + P[j], host-major.
        M, P = (h[0], positions[0]) if host_nodes is None else (h[0][host_nodes], positions[0][host_nodes])
        S = streams.insert(M)[:, :gamma].reshape(1, n_hosts * gamma, -1)
        x = mx.concatenate([h, S], axis=1)
        stream_pos = (P[:, None] + mx.arange(1, gamma + 1, dtype=mx.int32)[None]).reshape(1, -1)
        pos_all = mx.concatenate([positions, stream_pos], axis=1)
    else:  # no node hosts streams: the top layers run the main rows only
        x, pos_all = h, positions
    # The LoRA confined to stream rows: none without them (a lookup branch's pass), where
    # every delta would be masked to zero after its products.
    lora = bool(streams.lora) and n_hosts > 0
    row_mask = stream_row_mask(nk, x.shape[1], x.dtype) if lora else None
    rot = model.rotation(pos_all)
    for i in range(streams.first_layer, len(model.layers)):
        loras = streams.layer_lora(i) if lora else None
        adapter = LoRAAdapter(loras, row_mask) if loras else None
        x = model.layers[i](x, mask, cache[i] if cache else None, rot, adapter, cached_rows=nk)
    return x


# Hosted stream rows (hosts x γ) up to which every host's streams go through the LM head in
# the main rows' product. The next draft needs one host's streams only, chosen by the verdict;
# computed after it, the head's weights (SmolLM2: 113 MB, a fifth of what a step reads) are
# read a second time. Sharing the read pays while the extra rows' arithmetic costs less than
# that read: greedy SmolLM2 at dynamic:8@1 (2 hosts, 8 rows) took 1.64-1.69 against
# 1.79-1.95 plain steps a pass (examples/tree_sweep.py, docs/DESIGN.md decision 39). Streams
# with a draft vocabulary have a head of their own, a fraction of the vocabulary's rows: up to
# as many rows, every host's streams go through it in the pass (decision 41).
MERGED_STREAM_ROWS = 8


def pass_outputs(model, streams: StreamParams, x: mx.array, nk: int, n_hosts: int, gamma: int):
    """(main logits, stream hidden states, stream logits or None) of the top layers' output."""
    stream_hidden = x[0, nk:].reshape(n_hosts, gamma, x.shape[-1])
    few = n_hosts == 1 or 0 < n_hosts * gamma <= MERGED_STREAM_ROWS
    if few and streams.draft_vocab is not None:
        s_logits = streams.draft_logits(model, x[:, nk:])[0].reshape(n_hosts, gamma, -1)
        return model.lm_logits(x[:, :nk])[0], stream_hidden, s_logits
    if few:
        # One host's rows are the only ones the next draft can use, a few hosts' cost less
        # than a second read of the head: one LM-head product over every row.
        logits = model.lm_logits(x)[0]
        return logits[:nk], stream_hidden, logits[nk:].reshape(n_hosts, gamma, -1)
    return model.lm_logits(x[:, :nk])[0], stream_hidden, None


def _early_exit_keep(model, streams: StreamParams, h, tree: Tree, buf: TreeBuffers, threshold: float) -> np.ndarray:
    """Nodes kept by early-exit pruning (paper §3.1.3): the transition probability
    parent -> child of the early-exit head at the insertion layer must reach
    ``threshold`` for the child and for each of its ancestors.

    With a draft vocabulary the early-exit logits are normalised over its head's rows, not
    the whole vocabulary's, and each child's logit comes from its own token's row (a copied
    token may lie outside the draft vocabulary). A normaliser over fewer entries is smaller,
    so every transition probability is at least the one the threshold was calibrated on
    (the whole vocabulary's), and pruning keeps at least the calibrated share of the
    children verification would accept. It reads 8,192 rows of SmolLM2's head instead of 49,152:
    greedy smollm2-fc at dynamic:8+lookup@1 1.585x ``ar`` pruned this way against 1.270x
    pruned over the whole vocabulary and 1.467x unpruned (docs/DESIGN.md decision 41)."""
    ee_h = streams.pruning(h)
    par = mx.array(buf.parents[1:].astype(np.int32))
    tok = mx.array(np.asarray(tree.tokens[1:], dtype=np.int32))
    if streams.draft_vocab is None:
        ee = model.lm_logits(ee_h)[0]  # (n, V)
        logp = ee - mx.logsumexp(ee, axis=-1, keepdims=True)
        trans = np.array(mx.exp(logp[par, tok]))
    else:
        lse = mx.logsumexp(streams.draft_logits(model, ee_h)[0], axis=-1)  # (n,)
        trans = np.array(mx.exp(model.token_logits(ee_h[0][par], tok) - lse[par]))
    return subtree_keep(tree.parents, np.concatenate([[True], trans >= threshold]))


def stream_logits(model, streams: StreamParams, out: SSOutput, slot) -> mx.array:
    """(g, V') logits of the streams of host ``slot`` (int or device scalar; with every
    node hosting, the slot is the kept node index) over the streams' draft vocabulary."""
    if out.stream_logits is not None:
        return out.stream_logits[slot]
    return streams.draft_logits(model, out.stream_hidden[slot][None])[0]


def all_stream_logits(model, streams: StreamParams, out: SSOutput) -> mx.array:
    """(n_hosts, g, V') logits of every hosted stream over the streams' draft vocabulary."""
    return out.stream_logits if out.stream_logits is not None else streams.draft_logits(model, out.stream_hidden)


def slot_index(slots: "list[int]") -> Optional[mx.array]:
    """``slots`` as the int32 array every layer's commit gathers with (None: already in place)."""
    return None if slots == list(range(len(slots))) else mx.array(slots, dtype=mx.int32)


def commit_ss(cache, streams: StreamParams, out: SSOutput, path) -> None:
    """Keep the accepted path: lower layers index the full tree, MSA layers the kept rows."""
    s0 = streams.first_layer
    lower, top = [int(out.kept[i]) for i in path], [int(i) for i in path]
    lower_index, top_index = slot_index(lower), slot_index(top)  # built once, not once per layer
    for i, c in enumerate(cache):
        if i < s0:
            c.commit(lower, lower_index)
        else:
            c.commit(top, top_index)
