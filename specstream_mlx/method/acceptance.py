"""Verification of a draft tree against the target (main-stream) distributions.

Both rules walk the tree from the root: at each node they decide which child
(if any) continues the output, and end with one "bonus" token from the target
at the last accepted node, so every pass yields at least one token. The greedy
rule is a host walk over the target's argmax (:func:`greedy_accepted_node` finds
the same node on the device); the sampled rule runs on the device for every node
at once (:func:`rrs_decisions`, randomness from an explicit MLX key) and the host
only walks its per-node results.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import List, Optional, Sequence

import mlx.core as mx
import numpy as np

from .tree import TreeBuffers, tree_buffers


@dataclass(frozen=True)
class Verdict:
    """``path``: accepted node indices starting with the root; ``bonus``: the
    token that follows the last accepted node."""

    path: List[int]
    bonus: int

    @property
    def accepted(self) -> int:
        """Draft tokens accepted (root excluded)."""
        return len(self.path) - 1


def greedy_verify(tokens: Sequence[int], children: Sequence[Sequence[int]], target_argmax: np.ndarray) -> Verdict:
    """Follow the child whose token is the target's argmax at its parent.

    Equals plain greedy decoding because every accepted token is exactly the
    token plain decoding would have picked given the same prefix."""
    cur, path = 0, [0]
    while True:
        want = int(target_argmax[cur])
        nxt = next((c for c in children[cur] if tokens[c] == want), None)
        if nxt is None:
            return Verdict(path, want)
        path.append(nxt)
        cur = nxt


def child_table(values: Sequence[int], buffers: TreeBuffers) -> "tuple[np.ndarray, np.ndarray]":
    """(n, W) the children's ``values`` (their tokens, say) of every node in trial order (0
    past the last), and (n,) how many each node has; W is the most children any node has.
    One gather over the tree shape's cached child index."""
    index = buffers.child_index
    table = np.where(index >= 0, np.asarray(values, dtype=np.int32)[np.maximum(index, 0)], 0)
    return table.astype(np.int32, copy=False), buffers.child_count


def rrs_decisions(
    target: mx.array,
    draft_q: Optional[mx.array],
    kid_tokens: np.ndarray,
    kid_count: np.ndarray,
    rows: np.ndarray,
    key: mx.array,
) -> "tuple[mx.array, mx.array]":
    """Recursive rejection sampling at every node of a tree at once, on the device.

    At a node whose children were drawn i.i.d. (with replacement) from ``q``, the
    proposal at its depth, try them in order: accept x with probability
    min(1, p(x)/q(x)); on rejection replace p by the residual norm(max(p - q, 0))
    and try the next; if all are rejected, draw the bonus token from what is left.
    Why lossless: each trial is one standard speculative-sampling step whose target
    is the current residual, and the next draft is independent of the previous
    trials, so the token that leaves a node is distributed exactly as p (Chen et al.
    2023; Yang et al. 2024, multi-draft RRS). A node's trials depend only on its own
    target and children, and the draws of different nodes are independent, so every
    node's are run at once and the host walks from the root (:func:`walk_decisions`):
    it sees exactly the sequential procedure, and only ``2n`` integers leave the device.

    Args:
        target: (n, V) target probabilities per node.
        draft_q: (D, V) the distribution the children at each depth were drawn from
            (None when the tree has no children).
        kid_tokens, kid_count: :func:`child_table` of the tree.
        rows: which row of ``draft_q`` each child was drawn from: (n,) per node, for
            children drawn alike (a node's depth d: stream d + 1's proposal), or (n, W) per
            child (hybrid trees: a lookup child's row is the one-hot of its token, a
            point-mass proposal, accepted with probability p(x)).
        key: the PRNG key of this verification.

    Returns:
        Lazy (n,) int32 arrays: the index of the first accepted child (-1: none) and a
        token drawn from the residual left after every child was rejected (the
        target itself at a leaf).
    """
    n, W = kid_tokens.shape
    k_trials, k_bonus = mx.random.split(key)
    p = target.astype(mx.float32)
    first = mx.full((n,), -1, dtype=mx.int32)
    if W and draft_q is not None:
        rows = np.asarray(rows)
        rows = np.repeat(rows[:, None], W, axis=1) if rows.ndim == 1 else rows
        rows = np.minimum(rows, draft_q.shape[0] - 1).astype(np.int32)
        q = draft_q.astype(mx.float32)
        u = mx.random.uniform(shape=(n, W), key=k_trials)
        for k in range(W):
            # Trial k runs only at the nodes with more than k children (the host knows which).
            at = np.flatnonzero(kid_count > k)
            if at.size == 0:
                break
            idx = mx.array(at.astype(np.int32))
            x = mx.array(kid_tokens[at, k : k + 1])
            pk, qk = p[idx], q[mx.array(rows[at, k])]
            px, qx = mx.take_along_axis(pk, x, axis=1)[:, 0], mx.take_along_axis(qk, x, axis=1)[:, 0]
            first[idx] = mx.where((first[idx] < 0) & (u[idx, k] * qx < px), k, first[idx])
            r = mx.maximum(pk - qk, 0.0)
            s = r.sum(axis=1, keepdims=True)
            # s == 0 only when p == q, where the draft was accepted with probability 1 anyway.
            p[idx] = mx.where(s > 0, r / mx.maximum(s, 1e-30), pk)
    bonus = draw_rows(p, mx.random.uniform(shape=(n, 1), key=k_bonus))[:, 0]
    return first, bonus


def draw_rows(probs: mx.array, u: mx.array) -> mx.array:
    """Inverse-CDF draws: for each row of ``probs`` (..., V), one token per uniform in ``u``
    (..., k): the first whose cumulative probability exceeds u times the row's total.
    (Cheaper than Gumbel-max over the vocabulary: one cumulative sum, no V random numbers.)
    A token of probability 0 is never drawn, even where rounding puts u at the very end."""
    cdf = mx.cumsum(probs.astype(mx.float32), axis=-1)
    at = (cdf[..., None, :] <= (u * cdf[..., -1:])[..., None]).sum(axis=-1)
    V = probs.shape[-1]
    last = V - 1 - mx.argmax((probs > 0)[..., ::-1], axis=-1, keepdims=True)  # the last possible token
    return mx.minimum(at, last).astype(mx.int32)


def walk_decisions(children: Sequence[Sequence[int]], first: np.ndarray, bonus: np.ndarray) -> Verdict:
    """The verdict of sampled verification from :func:`rrs_decisions`' per-node results:
    from the root, follow the accepted child until a node accepts none; its bonus ends it."""
    cur, path = 0, [0]
    while first[cur] >= 0:
        cur = children[cur][int(first[cur])]
        path.append(cur)
    return Verdict(path, int(bonus[cur]))


def greedy_accepted_node(tokens: Sequence[int], buffers, target_argmax: mx.array) -> mx.array:
    """The last node greedy verification will accept, computed on the device so
    that the next draft's stream logits join the verification sync.

    Siblings carry distinct tokens, so the nodes whose own token and every
    ancestor's token match the target's argmax at their parent form one chain
    from the root; its deepest node is the answer. :func:`greedy_verify` on the
    host remains the authority (the ss engine checks that both agree)."""
    if len(tokens) == 1:
        return mx.array(0, dtype=mx.int32)
    par, ancestors, depths = _device_shape(tuple(int(p) for p in buffers.parents))
    toks = mx.array(np.asarray(tokens[1:], dtype=np.int32))
    bad = mx.concatenate([mx.zeros((1,)), (toks != target_argmax[par]).astype(mx.float32)])
    on_path = (ancestors @ bad) == 0
    return mx.argmax(mx.where(on_path, depths, -1)).astype(mx.int32)


@lru_cache(maxsize=1024)
def _device_shape(parents: tuple) -> "tuple[mx.array, mx.array, mx.array]":
    """A tree shape's device arrays for :func:`greedy_accepted_node`, built once per shape:
    the parents of nodes 1.., the ancestor mask as float32, the depths."""
    b = tree_buffers(parents)
    return mx.array(b.parents[1:].astype(np.int32)), mx.array(b.ancestor_mask.astype(np.float32)), mx.array(b.depths)
