"""Speculative decoding engines: Speculative Streaming (``ss``) and prompt lookup.

Both are step generators like :func:`specstream_mlx.generation.ar_steps`: one
:class:`Step` per target forward pass, carrying every token that pass decided.

``ss``: the pass over the tree rooted at the last decided token verifies the
previous draft with the main rows and drafts the next tree from the streams of
the last accepted node (DESIGN §1). ``lookup``: drafts a chain by matching the
recent n-gram in the prompt and output so far, verified by a plain
tree-masked forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generator, List, Optional, Sequence, Union

import mlx.core as mx
import numpy as np

from .acceptance import Verdict, greedy_verify, sample_verify
from .cache import commit_cache, make_cache
from .generation import Step, ar_steps, prefill
from .msa import commit_ss, prefix_tree_mask, ss_forward, stream_logits
from .sampling import SamplingParams, target_logprobs
from .streams import NoStreamsError, StreamParams
from .tree import Tree, TreeSpec, cartesian_tree, dynamic_candidates, dynamic_tree, tree_buffers

DEFAULT_TREE = TreeSpec("dynamic", budget=12, depth=4)


def _probs(logits: mx.array, sampling: SamplingParams) -> mx.array:
    return mx.exp(target_logprobs(logits, sampling))


@dataclass
class Draft:
    """The next tree, what sampling verification needs, and acceptance predictions.

    Attributes:
        tree: the draft tree rooted at the bonus token.
        draft_q: (depth, V) distributions the sampled children were drawn from.
        predicted: expected accepted length of this tree if streams were calibrated.
        scores: path scores of the best-first candidates (for --tree auto).
    """

    tree: Tree
    draft_q: Optional[np.ndarray] = None
    predicted: float = 0.0
    scores: Optional[List[float]] = None


def draft_tree(
    root: int,
    logits: mx.array,
    spec: TreeSpec,
    sampling: SamplingParams,
    rng: np.random.Generator,
    score_budget: int = 0,
) -> Draft:
    """Next draft tree from the γ stream logits (γ, V) of the last accepted node.

    Greedy: top-k candidates per stream (Cartesian or dynamic tree). Sampling:
    i.i.d. draws from each stream's processed distribution, shared by every
    parent at that depth (what :func:`sample_verify` needs to stay lossless).
    """
    depth = min(spec.max_depth, logits.shape[0])
    if depth == 0:
        return Draft(Tree((root,), (-1,)))
    logits = logits[:depth]
    K = max(spec.widths) if spec.kind == "cartesian" else min(max(spec.budget, score_budget), 8)
    probs = mx.softmax(logits.astype(mx.float32), axis=-1)
    top = mx.argsort(-probs, axis=-1)[:, :K]
    q = _probs(logits, sampling) if not sampling.greedy else None
    mx.eval(top, probs, *([q] if q is not None else []))
    top_np = np.array(top)
    p_np = np.array(mx.take_along_axis(probs, top, axis=-1))
    cands = dynamic_candidates(top_np, p_np, max(spec.budget if spec.kind == "dynamic" else 0, score_budget))
    scores = [c[2] for c in cands]
    if sampling.greedy:
        if spec.kind == "cartesian":
            tree = cartesian_tree(root, top_np, spec.widths[:depth])
            predicted = _expected_accepted(tree, top_np, p_np)
        else:
            tree = dynamic_tree(root, top_np, p_np, spec.budget, cands)
            predicted = float(sum(scores[: spec.budget]))
        return Draft(tree, None, predicted, scores)
    q = np.array(q).astype(np.float64)
    q /= q.sum(axis=-1, keepdims=True)
    widths = spec.widths[:depth] if spec.kind == "cartesian" else _budget_widths(spec.budget, depth)
    draws = [rng.choice(q.shape[1], size=w, p=q[g]) for g, w in enumerate(widths)]
    tree = cartesian_tree(root, draws, widths)
    return Draft(tree, q, float(sum(scores[: len(tree) - 1])), scores)


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


def _expected_accepted(tree: Tree, top: np.ndarray, probs: np.ndarray) -> float:
    """Σ over draft nodes of the product of stream probabilities on its path:
    the expected accepted length if streams were calibrated."""
    lookup = [dict(zip(top[g].tolist(), probs[g].tolist())) for g in range(top.shape[0])]
    score = [1.0] * len(tree)
    depth = [0] * len(tree)
    total = 0.0
    for i in range(1, len(tree)):
        p = tree.parents[i]
        depth[i] = depth[p] + 1
        score[i] = score[p] * lookup[depth[i] - 1].get(tree.tokens[i], 0.0)
        total += score[i]
    return total


def _verify(out_tree, buffers, main_logits, sampling, draft_q, rng, extra=None) -> Verdict:
    """Verify on the host; ``extra`` arrays are evaluated in the same sync."""
    if sampling.greedy:
        am = mx.argmax(main_logits, axis=-1)
        mx.eval(am, *(extra or []))
        return greedy_verify(out_tree.tokens, buffers.children, np.array(am))
    target = _probs(main_logits, sampling)
    mx.eval(target, *(extra or []))
    target = np.array(target)
    if draft_q is None:
        draft_q = np.zeros((0, target.shape[1]))
    return sample_verify(out_tree.tokens, buffers.children, buffers.depths, target, draft_q, rng)


# Below this many stream-logit elements (kept nodes x γ x vocab) the streams of
# every kept node go through the LM head in the verification pass itself, saving
# a second host sync; above it only the accepted node's streams are computed.
EAGER_STREAM_LOGITS = 1 << 16


def next_draft_logits(model, out, node: int, all_logits: Optional[mx.array] = None) -> mx.array:
    """(γ, V) stream logits at the last accepted node (precomputed when eager)."""
    return all_logits[node] if all_logits is not None else stream_logits(model, out, node)


def ss_steps(
    model,
    prompt: mx.array,
    sampling: SamplingParams,
    cache=None,
    streams: Optional[StreamParams] = None,
    tree: Union[None, str, TreeSpec] = None,
    pruning_threshold: Optional[float] = None,
    prefill_chunk: int = 512,
    log=None,
) -> Generator[Step, None, None]:
    """Speculative Streaming decoding; yields the tokens each pass decided.

    Args:
        tree: a :class:`TreeSpec`, ``"auto"`` (measure and choose; may fall
            back to plain decoding), or None for the default dynamic tree.
        pruning_threshold: early-exit pruning threshold; default from specstream.json.
    """
    streams = streams if streams is not None else getattr(model, "streams", None)
    if streams is None:
        raise NoStreamsError("this model has no speculative streams; use --mode ar or lookup")
    auto = None
    if isinstance(tree, str):
        if tree != "auto":
            tree = TreeSpec.parse(tree)
        else:
            from .autotune import AutoTree, load_or_measure_costs

            auto = AutoTree(load_or_measure_costs(model, streams, log), depth=streams.num_streams)
            tree = None
    spec = tree or DEFAULT_TREE
    max_budget = max(auto.costs) if auto else 0
    threshold = streams.config.pruning_threshold if pruning_threshold is None else pruning_threshold
    cache = cache if cache is not None else make_cache(model)
    rng = np.random.default_rng(sampling.seed)
    prefill(model, prompt[:-1], cache, prefill_chunk)
    offset = cache[0].offset
    draft = Draft(Tree((int(prompt[-1].item()),), (-1,)))
    while True:
        out = ss_forward(model, streams, draft.tree, offset, cache, threshold)
        eager = out.stream_hidden.size // out.stream_hidden.shape[-1] * model.args.vocab_size <= EAGER_STREAM_LOGITS
        all_logits = model.lm_logits(out.stream_hidden) if eager else None
        verdict = _verify(out.tree, out.buffers, out.main_logits, sampling, draft.draft_q, rng,
                          [all_logits] if eager else None)
        commit_ss(cache, streams, model, out, verdict.path)
        offset = cache[0].offset
        tokens = [out.tree.tokens[i] for i in verdict.path[1:]] + [verdict.bonus]
        info = {"accepted": verdict.accepted, "nodes": len(out.kept) + out.pruned - 1,
                "pruned": out.pruned, "tree": spec.describe()}
        if auto is not None:
            if len(draft.tree) > 1:
                auto.observe(draft.predicted, verdict.accepted, draft.scores)
            if auto.choose() is None:
                info["fallback"] = (
                    "plain decoding: no draft tree is expected to be faster on this machine "
                    f"(best {max(auto.expected_speedup(b) for b in auto.costs if b):.2f}x)"
                )
                yield Step(tokens, info)
                yield from ar_steps(model, mx.array([verdict.bonus]), sampling, cache=cache)
                return
            spec = auto.spec()
            info["tree"] = "auto:" + spec.describe()
        logits = next_draft_logits(model, out, verdict.path[-1], all_logits)
        draft = draft_tree(verdict.bonus, logits, spec, sampling, rng, max_budget)
        yield Step(tokens, info)


# --- prompt lookup -----------------------------------------------------------

def lookup_draft(history: Sequence[int], max_len: int, ngram_max: int = 3, ngram_min: int = 1) -> List[int]:
    """Tokens that followed the most recent earlier occurrence of the longest
    matching suffix n-gram of ``history`` (prompt-lookup decoding)."""
    h = list(history)
    for n in range(ngram_max, ngram_min - 1, -1):
        if len(h) <= n:
            continue
        suffix = h[-n:]
        for start in range(len(h) - n - 1, -1, -1):
            if h[start : start + n] == suffix:
                cont = h[start + n : start + n + max_len]
                if cont:
                    return cont
    return []


def lookup_steps(
    model,
    prompt: mx.array,
    sampling: SamplingParams,
    cache=None,
    draft_len: int = 5,
    prefill_chunk: int = 512,
) -> Generator[Step, None, None]:
    """Prompt-lookup decoding verified exactly like ``ss`` (lossless)."""
    cache = cache if cache is not None else make_cache(model)
    rng = np.random.default_rng(sampling.seed)
    history = prompt.tolist()
    prefill(model, prompt[:-1], cache, prefill_chunk)
    root = history[-1]
    while True:
        draft = lookup_draft(history, draft_len)
        tree = Tree.chain([root] + draft)
        buf = tree_buffers(tree.parents)
        offset = cache[0].offset
        positions = mx.array((offset + buf.depths)[None].astype(np.int32))
        mask = prefix_tree_mask(offset, buf.ancestor_mask)
        logits = model(mx.array([tree.tokens], dtype=mx.int32), cache=cache, positions=positions, mask=mask)[0]
        # A deterministic draft is a one-hot proposal: accept x with prob p(x).
        q = None
        if not sampling.greedy and draft:
            q = np.zeros((len(draft), logits.shape[-1]))
            q[np.arange(len(draft)), draft] = 1.0
        verdict = _verify(tree, buf, logits, sampling, q, rng)
        commit_cache(cache, verdict.path)
        new = [tree.tokens[i] for i in verdict.path[1:]] + [verdict.bonus]
        history.extend(new)
        root = verdict.bonus
        yield Step(new, {"accepted": verdict.accepted, "nodes": len(draft), "pruned": 0})
