"""Verification of a draft tree against the target (main-stream) distributions.

Pure functions over numpy arrays; randomness comes from an explicit
``numpy.random.Generator``. Both rules walk the tree from the root: at each
node they decide which child (if any) continues the output, and end with one
"bonus" token drawn from the target at the last accepted node, so every pass
yields at least one token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence

import mlx.core as mx
import numpy as np


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


def rrs_step(p: np.ndarray, q: np.ndarray, drafts: Sequence[int], rng: np.random.Generator):
    """Recursive rejection sampling over sibling drafts at one node.

    ``drafts`` were drawn i.i.d. from ``q`` (with replacement). Try them in
    order: accept x with probability min(1, p(x)/q(x)); on rejection replace p
    by the residual norm(max(p - q, 0)) and try the next. Why lossless: each
    trial is one standard speculative-sampling step whose target is the current
    residual, and the next draft is independent of the previous trials, so the
    returned token is distributed exactly as p (Chen et al. 2023; Yang et al.
    2024, multi-draft RRS). Returns (index of accepted draft or None, residual).
    """
    p = p.astype(np.float64)
    q = q.astype(np.float64)
    for i, x in enumerate(drafts):
        if rng.random() * q[x] < p[x]:
            return i, p
        r = np.maximum(p - q, 0.0)
        s = r.sum()
        # s == 0 only when p == q, in which case x is accepted with probability 1.
        if s > 0:
            p = r / s
    return None, p


def sample_verify(
    tokens: Sequence[int],
    children: Sequence[Sequence[int]],
    depths: Sequence[int],
    target_probs: np.ndarray,
    draft_probs: np.ndarray,
    rng: np.random.Generator,
) -> Verdict:
    """Lossless verification of a tree whose children at depth g+1 are i.i.d.
    draws from ``draft_probs[g]`` (the same draws under every parent).

    Args:
        target_probs: (n, V) target distribution at each node.
        draft_probs: (depth, V) distribution the children at each depth were drawn from.
    """
    cur, path = 0, [0]
    while True:
        kids = children[cur]
        p = target_probs[cur]
        if kids:
            q = draft_probs[depths[cur]]
            i, p = rrs_step(p, q, [tokens[c] for c in kids], rng)
            if i is not None:
                cur = kids[i]
                path.append(cur)
                continue
        p = np.asarray(p, dtype=np.float64)
        bonus = int(rng.choice(p.shape[0], p=p / p.sum()))
        return Verdict(path, bonus)


def greedy_accepted_node(tokens: Sequence[int], buffers, target_argmax: mx.array) -> mx.array:
    """The last node greedy verification will accept, computed on the device so
    that the next draft's stream logits join the verification sync.

    Siblings carry distinct tokens, so the nodes whose own token and every
    ancestor's token match the target's argmax at their parent form one chain
    from the root; its deepest node is the answer. :func:`greedy_verify` on the
    host remains the authority (the ss engine checks that both agree)."""
    if len(tokens) == 1:
        return mx.array(0, dtype=mx.int32)
    b = buffers
    par = mx.array(b.parents[1:].astype(np.int32))
    toks = mx.array(np.asarray(tokens[1:], dtype=np.int32))
    bad = mx.concatenate([mx.zeros((1,)), (toks != target_argmax[par]).astype(mx.float32)])
    on_path = (mx.array(b.ancestor_mask.astype(np.float32)) @ bad) == 0
    return mx.argmax(mx.where(on_path, mx.array(b.depths), -1)).astype(mx.int32)
