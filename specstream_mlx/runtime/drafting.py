"""Drafting the next tree from the streams of the last accepted node.

:func:`stream_candidates` turns stream logits into device-side top-K
candidates (and, when sampling, the processed proposal distributions);
:func:`draft_tree` builds the next tree from them on the host: a Cartesian or
budgeted dynamic tree when greedy, i.i.d. draws from each stream's proposal
when sampling (what lossless verification needs).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, List, Optional

import mlx.core as mx
import numpy as np

from ..method.acceptance import draw_rows
from ..method.streams import DraftVocab
from ..method.tree import (
    Tree,
    TreeSpec,
    cartesian_tree,
    dynamic_candidates,
    dynamic_tree,
    merge_chain,
    tree_buffers,
)
from .sampling import SamplingParams, target_probs


@dataclass(frozen=True)
class Forecast:
    """What a draft's streams predicted, for the policy that judges trees (--tree auto).

    Attributes:
        predicted: expected accepted length of this tree if streams were calibrated.
        scores: path scores of the best-first candidates.
        candidate_depth: how many streams deep those candidates went.
        budget: the dynamic-tree budget it was drafted with (0 otherwise).
        from_hosting: hosting mode of the pass whose streams drafted it.
    """

    predicted: float = 0.0
    scores: Optional[List[float]] = None
    candidate_depth: int = 0
    budget: int = 0
    from_hosting: int = 0


@dataclass
class Draft:
    """The next tree and what verifying and hosting it need.

    Attributes:
        tree: the draft tree rooted at the bonus token.
        draft_q: (depth, V) distributions the sampled children were drawn from (on the device).
        reach: per node, the probability its path is accepted (stream estimates),
            which picks the nodes that host streams under a hosting policy.
        q_rows: sampled hybrid trees: the row of ``draft_q`` each node was drawn from
            (None: a node at depth d + 1 from row d).
        forecast: what the policy reads (never the method).
    """

    tree: Tree
    draft_q: Optional[mx.array] = None
    reach: Optional[np.ndarray] = None
    q_rows: Optional[np.ndarray] = None
    forecast: Forecast = field(default_factory=Forecast)


@dataclass
class Candidates:
    """Stream candidates: per stream (rows ..., γ), the top-K token ids and their
    probabilities in descending order and, when sampling, the processed proposal
    distributions (kept on the device) and i.i.d. draws from them. Device arrays when
    made by :func:`stream_candidates`, host arrays after :meth:`to_host`."""

    top: Any
    ptop: Any
    q: Optional[mx.array] = None
    drawn: Any = None

    def arrays(self) -> list:
        """Every array it holds, to evaluate in the same sync as verification."""
        return [a for a in (self.top, self.ptop, self.q, self.drawn) if a is not None]

    def map(self, f: Callable) -> "Candidates":
        """``f`` applied to every array it holds (a row, a slice)."""
        return Candidates(*(None if a is None else f(a) for a in (self.top, self.ptop, self.q, self.drawn)))

    def to_host(self) -> "Candidates":
        """Token ids, probabilities and draws as numpy; the distributions stay on the device."""
        return Candidates(
            np.array(self.top), np.array(self.ptop), self.q, None if self.drawn is None else np.array(self.drawn)
        )

    @staticmethod
    def empty(K: int) -> "Candidates":
        """No candidates (no ancestor of the accepted node hosted streams)."""
        return Candidates(np.zeros((0, K), np.int32), np.zeros((0, K), np.float32))


def stream_candidates(
    logits: mx.array,
    K: int,
    sampling: SamplingParams,
    key: Optional[mx.array] = None,
    draws: int = 0,
    vocab: Optional[DraftVocab] = None,
) -> Candidates:
    """Device-side candidates of stream logits (..., γ, V): the top-K token ids and
    their probabilities in descending order and, when sampling, the processed
    distributions the drafts are drawn from and ``draws`` i.i.d. draws from each (with
    ``key``), so only the draws leave the device. Lazy: the caller evaluates them in
    the same sync as verification.

    ``vocab``: the logits are over these draft-vocabulary entries (V = N), not the
    whole vocabulary: ids and draws are mapped to token ids, and the distributions
    spread over the whole vocabulary (0 outside the draft vocabulary), which is what
    lossless verification compares them with."""
    logits = logits.astype(mx.float32)
    K = min(K, logits.shape[-1])
    if sampling.greedy:
        cand = _greedy_candidates(logits, K)
        return cand if vocab is None else Candidates(vocab.tokens(cand.top), cand.ptop)
    # Sampled drafts are drawn from the processed distributions; their top-K are the candidates
    # (one softmax over the vocabulary, not two).
    probs = target_probs(logits, sampling)
    part = top_k_indices(probs, K)
    ptop = mx.take_along_axis(probs, part, axis=-1)
    order = mx.argsort(-ptop, axis=-1)
    top = mx.take_along_axis(part, order, axis=-1)
    ptop = mx.take_along_axis(ptop, order, axis=-1)
    drawn = draw_rows(probs, mx.random.uniform(shape=(*probs.shape[:-1], max(draws, 1)), key=key))
    if vocab is not None:
        return Candidates(vocab.tokens(top), ptop, vocab.spread(probs), vocab.tokens(drawn))
    return Candidates(top, ptop, probs, drawn)


@mx.compile
def _shift_and_normaliser(logits: mx.array):
    # One fused element-wise kernel between two reductions: where the softmax primitive has
    # no vector kernel of its own (MLX's CPU backend), compiled element-wise code does.
    top = logits.max(axis=-1, keepdims=True)
    return top, mx.exp(logits - top).sum(axis=-1, keepdims=True)


# Vocabulary blocks of the two-stage top-K (with fewer than 32 or 4·K blocks, one partition).
TOPK_BLOCK = 128


def top_k_indices(logits: mx.array, K: int) -> mx.array:
    """Indices of the K largest of (..., V) ``logits``, unordered.

    In two stages over blocks of ``TOPK_BLOCK`` entries: the K largest entries lie in
    the K blocks with the largest maxima (a block outside them is beaten by K block maxima,
    so by K entries), so the blocks' maxima are partitioned, then only those K blocks'
    entries. A partition of the whole vocabulary is a sort-like pass per row (1.4 ms for
    4 × 49,152 logits on MLX's CPU backend); the maxima are one reduction."""
    V = logits.shape[-1]
    if K >= V:
        return mx.broadcast_to(mx.arange(V), logits.shape)
    blocks = -(-V // TOPK_BLOCK)
    if blocks < max(32, 4 * K):
        return mx.argpartition(-logits, kth=K - 1, axis=-1)[..., :K]
    lead = logits.shape[:-1]
    if blocks * TOPK_BLOCK != V:  # pad the last block with -inf, never chosen over a real entry
        pad = mx.full((*lead, blocks * TOPK_BLOCK - V), -mx.inf, dtype=logits.dtype)
        logits = mx.concatenate([logits, pad], axis=-1)
    tiles = logits.reshape(*lead, blocks, TOPK_BLOCK)
    best = mx.argpartition(-tiles.max(axis=-1), kth=K - 1, axis=-1)[..., :K]  # (..., K) block ids
    cells = mx.take_along_axis(tiles, best[..., None], axis=-2).reshape(*lead, K * TOPK_BLOCK)
    pick = mx.argpartition(-cells, kth=K - 1, axis=-1)[..., :K]
    return mx.take_along_axis(best, pick // TOPK_BLOCK, axis=-1) * TOPK_BLOCK + pick % TOPK_BLOCK


def _greedy_candidates(logits: mx.array, K: int) -> Candidates:
    """Top-K tokens of (..., V) logits and their softmax probabilities, without the
    probabilities of the whole vocabulary: the top-K of the logits are the top-K of the
    probabilities, and each is exp(l - max) / sum(exp(logits - max))."""
    top, norm = _shift_and_normaliser(logits)
    part = top_k_indices(logits, K)
    ltop = mx.take_along_axis(logits, part, axis=-1)
    order = mx.argsort(-ltop, axis=-1)
    ids = mx.take_along_axis(part, order, axis=-1)
    return Candidates(ids, mx.exp(mx.take_along_axis(ltop, order, axis=-1) - top) / norm)


def num_candidates(spec: TreeSpec, score_budget: int = 0) -> int:
    """Top-K per stream that a tree of ``spec`` (and --tree auto's scoring) needs."""
    return max(spec.widths) if spec.kind == "cartesian" else min(max(spec.budget, score_budget), 8)


def draft_tree(root: int, cand: Candidates, spec: TreeSpec, sampling: SamplingParams, score_budget: int = 0) -> Draft:
    """Next draft tree from the stream candidates (host arrays) of the last accepted node.

    ``cand.top``/``cand.ptop``: (γ, K) top tokens and probabilities per stream. Greedy:
    Cartesian or dynamic tree over the top-k. Sampling: ``cand.drawn`` (γ, ≥ widths)
    i.i.d. draws from each stream's processed distribution ``cand.q`` (γ, V, on the
    device), shared by every parent at that depth (what lossless verification
    needs); ``q`` is kept for it.
    """
    top, ptop = cand.top, cand.ptop
    depth = min(spec.max_depth, top.shape[0])
    if depth == 0:
        return Draft(Tree((root,), (-1,)))
    # --tree auto scores every budget on all the hosted streams, which may go
    # deeper than this tree (see autotune.AutoPolicy.plan).
    all_depth = top.shape[0]
    budget = spec.budget if spec.kind == "dynamic" else 0
    scored = dynamic_candidates(top, ptop, score_budget) if score_budget else None
    scores = None if scored is None else [c[2] for c in scored]
    top, ptop = top[:depth], ptop[:depth]

    def best(b: int):
        """This tree's ``b`` best candidates: a prefix of the scoring expansion when it
        went no deeper than this tree (a smaller budget's tree is its first entries)."""
        if scored is not None and depth == all_depth and b <= score_budget:
            return scored[:b]
        return dynamic_candidates(top, ptop, b)

    cands = best(budget)
    own = [c[2] for c in cands]
    if sampling.greedy:
        if spec.kind == "cartesian":
            tree = cartesian_tree(root, top, spec.widths[:depth])
        else:
            tree = dynamic_tree(root, top, ptop, spec.budget, cands)
        reach = node_reach(tree, top, ptop)
        predicted = float(reach[1:].sum()) if spec.kind == "cartesian" else float(sum(own[: spec.budget]))
        return Draft(tree, reach=reach, forecast=Forecast(predicted, scores, all_depth, budget))
    drawn = cand.drawn
    widths = sample_widths(spec, depth)
    if max(widths) > drawn.shape[1]:
        raise ValueError(f"{spec.describe()}: needs {max(widths)} draws per stream, got {drawn.shape[1]}")
    tree = cartesian_tree(root, [drawn[g, :w] for g, w in enumerate(widths)], widths)
    ranked = [c[2] for c in best(len(tree) - 1)]
    # The budget it was drafted with, as for greedy trees: --tree auto books the pass's time to it.
    forecast = Forecast(float(sum(ranked)), scores, all_depth, budget)
    return Draft(tree, cand.q[:depth], node_reach(tree, top, ptop), forecast=forecast)


# A hosting mode: no node hosts streams. --tree auto's lookup arm runs such passes: they
# verify an n-gram continuation alone, as prompt lookup does, at the cost of its rows.
NO_STREAMS = -1


def chain_draft(root: int, chain: List[int], chain_scores: List[float], budget: int) -> Draft:
    """The next draft of a pass that hosted no streams: the n-gram continuation alone (a
    root-only tree when there is none); ``chain_scores`` are its path scores."""
    tree = Tree.chain([root] + [int(t) for t in chain])
    reach = np.array([1.0] + [float(s) for s in chain_scores])
    return Draft(tree, reach=reach, forecast=Forecast(float(sum(chain_scores)), budget=budget, from_hosting=NO_STREAMS))


def with_lookup(draft: Draft, chain: List[int], chain_scores: List[float], budget: int) -> Draft:
    """``draft`` (greedy, dynamic) with an n-gram continuation merged in under the same
    node budget (:func:`~specstream_mlx.method.tree.merge_chain`); the node scores become
    the merged tree's, so hosting and --tree auto's prediction see both sources."""
    if not chain or draft.reach is None:
        return draft
    tree, reach = merge_chain(draft.tree, draft.reach, chain, chain_scores, budget)
    return Draft(tree, reach=reach, forecast=replace(draft.forecast, predicted=float(reach[1:].sum())))


# Sampled hybrid trees keep the lookup tokens whose measured score is at least this: a
# sampled tree cannot drop its weakest stream draws after seeing them (they would no
# longer be draws from the proposal), so the chain's share of the budget is set first.
SAMPLED_LOOKUP_MIN = 0.25


def sampled_lookup_length(chain_scores: List[float], budget: int) -> int:
    """How many chain tokens a sampled ``budget``-node tree gives to a lookup branch."""
    return min(sum(1 for s in chain_scores if s >= SAMPLED_LOOKUP_MIN), budget - 1)


def with_lookup_sampled(draft: Draft, chain: List[int], chain_scores: List[float], vocab: int) -> Draft:
    """A sampled ``draft`` with ``chain`` hung from the root as its own branch: each chain
    token is a point-mass proposal (a one-hot row appended to ``draft_q``), tried after the
    root's stream draws; the chain depends only on the text decided so far, never on this
    pass's draws, so rejection sampling stays exact."""
    if not chain:
        return draft
    tree = draft.tree
    n, D = len(tree), 0 if draft.draft_q is None else draft.draft_q.shape[0]
    depths = tree_buffers(tree.parents).depths
    tokens = tree.tokens + tuple(int(t) for t in chain)
    parents = tree.parents + tuple([0] + list(range(n, n + len(chain) - 1)))
    q_rows = np.concatenate([np.maximum(depths - 1, 0), D + np.arange(len(chain))]).astype(np.int32)
    point = (mx.arange(vocab)[None] == mx.array(chain, dtype=mx.int32)[:, None]).astype(mx.float32)
    q = point if draft.draft_q is None else mx.concatenate([draft.draft_q.astype(mx.float32), point])
    reach = None if draft.reach is None else np.concatenate([draft.reach, np.asarray(chain_scores, dtype=float)])
    return Draft(Tree(tokens, parents), q, reach, q_rows, draft.forecast)


def sample_widths(spec: TreeSpec, depth: int) -> tuple:
    """Children per node at each depth of a sampled tree of ``spec``, ``depth`` levels deep."""
    return spec.widths[:depth] if spec.kind == "cartesian" else _budget_widths(spec.budget, depth)


def max_draws(spec: TreeSpec) -> int:
    """Draws per stream a sampled tree of ``spec`` can need, however deep it can go
    (a shallower tree of the same budget may be wider)."""
    return max(max(sample_widths(spec, d)) for d in range(1, spec.max_depth + 1))


def _budget_widths(budget: int, depth: int) -> tuple:
    """Cartesian widths of at most ``budget`` draft nodes for sampled trees."""
    for widths in ((4, 2, 1, 1), (3, 2, 1, 1), (2, 2, 1, 1), (2, 1, 1, 1), (1, 1, 1, 1), (1,)):
        w = widths[:depth]
        total, level = 0, 1
        for x in w:
            level *= x
            total += level
        if total <= budget:
            return w
    return (1,)


def node_reach(tree: Tree, top: np.ndarray, probs: np.ndarray) -> np.ndarray:
    """Per node, the product of stream probabilities on its path (1 for the root):
    the probability its path is accepted if streams were calibrated. Summed over
    the draft nodes it is the expected accepted length."""
    lookup = [dict(zip(top[g].tolist(), probs[g].tolist())) for g in range(top.shape[0])]
    score = np.ones(len(tree))
    depth = [0] * len(tree)
    for i in range(1, len(tree)):
        p = tree.parents[i]
        depth[i] = depth[p] + 1
        score[i] = score[p] * lookup[depth[i] - 1].get(tree.tokens[i], 0.0)
    return score
