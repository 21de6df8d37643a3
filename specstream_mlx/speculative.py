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


def stream_candidates(logits: mx.array, K: int, sampling: SamplingParams):
    """Device-side candidates of stream logits (..., γ, V): the top-K token ids
    and their probabilities in descending order, and (sampling only) the
    processed distributions the drafts are drawn from. Lazy: the caller
    evaluates them in the same sync as verification."""
    logits = logits.astype(mx.float32)
    probs = mx.softmax(logits, axis=-1)
    K = min(K, logits.shape[-1])
    if K < logits.shape[-1]:
        part = mx.argpartition(-probs, kth=K - 1, axis=-1)[..., :K]
    else:
        part = mx.broadcast_to(mx.arange(K), probs.shape)
    ptop = mx.take_along_axis(probs, part, axis=-1)
    order = mx.argsort(-ptop, axis=-1)
    top = mx.take_along_axis(part, order, axis=-1)
    ptop = mx.take_along_axis(ptop, order, axis=-1)
    q = None if sampling.greedy else _probs(logits, sampling)
    return top, ptop, q


def num_candidates(spec: TreeSpec, score_budget: int = 0) -> int:
    """Top-K per stream that a tree of ``spec`` (and --tree auto's scoring) needs."""
    return max(spec.widths) if spec.kind == "cartesian" else min(max(spec.budget, score_budget), 8)


def draft_tree(
    root: int,
    top: np.ndarray,
    ptop: np.ndarray,
    q: Optional[np.ndarray],
    spec: TreeSpec,
    sampling: SamplingParams,
    rng: np.random.Generator,
    score_budget: int = 0,
) -> Draft:
    """Next draft tree from the stream candidates of the last accepted node.

    ``top``/``ptop``: (γ, K) top tokens and probabilities per stream; ``q``:
    (γ, V) processed distributions when sampling. Greedy: Cartesian or dynamic
    tree over the top-k. Sampling: i.i.d. draws from each stream's processed
    distribution, shared by every parent at that depth (what
    :func:`sample_verify` needs to stay lossless).
    """
    depth = min(spec.max_depth, top.shape[0])
    if depth == 0:
        return Draft(Tree((root,), (-1,)))
    top, ptop = top[:depth], ptop[:depth]
    cands = dynamic_candidates(top, ptop, max(spec.budget if spec.kind == "dynamic" else 0, score_budget))
    scores = [c[2] for c in cands]
    if sampling.greedy:
        if spec.kind == "cartesian":
            tree = cartesian_tree(root, top, spec.widths[:depth])
            predicted = _expected_accepted(tree, top, ptop)
        else:
            tree = dynamic_tree(root, top, ptop, spec.budget, cands)
            predicted = float(sum(scores[: spec.budget]))
        return Draft(tree, None, predicted, scores)
    q = np.asarray(q[:depth], dtype=np.float64)
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


def _verify(out_tree, buffers, main_logits, sampling, draft_q, rng) -> Verdict:
    """Verify on the host (one sync)."""
    if sampling.greedy:
        am = mx.argmax(main_logits, axis=-1)
        mx.eval(am)
        return greedy_verify(out_tree.tokens, buffers.children, np.array(am))
    target = _probs(main_logits, sampling)
    mx.eval(target)
    target = np.array(target)
    if draft_q is None:
        draft_q = np.zeros((0, target.shape[1]))
    return sample_verify(out_tree.tokens, buffers.children, buffers.depths, target, draft_q, rng)


# Below this many stream-logit elements (kept nodes x γ x vocab) the streams of
# every kept node go through the LM head in the verification pass itself when
# sampling (the accepted node is only known after host-side rejection sampling);
# above it only the accepted node's streams are computed, after a second sync.
EAGER_STREAM_LOGITS = 1 << 16


def greedy_accepted_node(target_argmax: mx.array, out) -> mx.array:
    """The last node greedy verification will accept, computed on the device so
    that the next draft's stream logits join the verification sync.

    Siblings carry distinct tokens, so the nodes whose own token and every
    ancestor's token match the target's argmax at their parent form one chain
    from the root; its deepest node is the answer. :func:`greedy_verify` on the
    host remains the authority (``ss_steps`` checks that both agree)."""
    n = len(out.tree)
    if n == 1:
        return mx.array(0, dtype=mx.int32)
    b = out.buffers
    par = mx.array(b.parents[1:].astype(np.int32))
    toks = mx.array(np.asarray(out.tree.tokens[1:], dtype=np.int32))
    bad = mx.concatenate([mx.zeros((1,)), (toks != target_argmax[par]).astype(mx.float32)])
    on_path = (mx.array(b.ancestor_mask.astype(np.float32)) @ bad) == 0
    return mx.argmax(mx.where(on_path, mx.array(b.depths), -1)).astype(mx.int32)


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

    One host sync per pass: the verification inputs and the next draft's
    stream candidates are evaluated together (greedy always; sampling when the
    stream logits of every node are small enough to compute eagerly).

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
            from .autotune import auto_tree_for

            auto = auto_tree_for(model, streams, log)
            try_trees = auto.new_request()
            tree = None
    spec = (auto.spec() if auto else tree) or DEFAULT_TREE
    max_budget = max(auto.costs) if auto else 0
    K = num_candidates(spec, max_budget)
    threshold = streams.config.pruning_threshold if pruning_threshold is None else pruning_threshold
    cache = cache if cache is not None else make_cache(model)
    if auto is not None and not try_trees:
        # --tree auto fell back on recent requests: decode plainly (re-tried later).
        steps = ar_steps(model, prompt, sampling, cache=cache, prefill_chunk=prefill_chunk)
        first = next(steps)
        first.info["fallback"] = "plain decoding: draft trees did not pay off on recent requests (re-tried later)"
        yield first
        yield from steps
        return
    rng = np.random.default_rng(sampling.seed)
    prefill(model, prompt[:-1], cache, prefill_chunk)
    offset = cache[0].offset
    draft = Draft(Tree((int(prompt[-1].item()),), (-1,)))
    while True:
        # Streams deeper than the next tree can use are not hosted (fewer MSA rows).
        out = ss_forward(model, streams, draft.tree, offset, cache, threshold, num_streams=spec.max_depth)
        resync = False
        if sampling.greedy:
            am = mx.argmax(out.main_logits, axis=-1)
            node_dev = greedy_accepted_node(am, out)
            cand = stream_candidates(stream_logits(model, out, node_dev), K, sampling)
            mx.eval(am, node_dev, *cand[:2])
            verdict = greedy_verify(out.tree.tokens, out.buffers.children, np.array(am))
            if verdict.path[-1] != int(node_dev.item()):
                resync = True  # not expected; the host verdict wins
                cand = stream_candidates(stream_logits(model, out, verdict.path[-1]), K, sampling)
                mx.eval(*cand[:2])
            top, ptop, q = np.array(cand[0]), np.array(cand[1]), None
        else:
            eager = out.stream_hidden.shape[0] * out.stream_hidden.shape[1] * model.args.vocab_size <= EAGER_STREAM_LOGITS
            target = _probs(out.main_logits, sampling)
            cand = stream_candidates(model.lm_logits(out.stream_hidden), K, sampling) if eager else None
            mx.eval(target, *(cand or ()))
            draft_q = draft.draft_q if draft.draft_q is not None else np.zeros((0, target.shape[1]))
            verdict = sample_verify(out.tree.tokens, out.buffers.children, out.buffers.depths,
                                    np.array(target), draft_q, rng)
            node = verdict.path[-1]
            if not eager:
                cand = stream_candidates(stream_logits(model, out, node), K, sampling)
                mx.eval(*cand)
                top, ptop, q = (np.array(a) for a in cand)
            else:
                top, ptop, q = (np.array(a[node]) for a in cand)
        commit_ss(cache, streams, model, out, verdict.path)
        offset = cache[0].offset
        tokens = [out.tree.tokens[i] for i in verdict.path[1:]] + [verdict.bonus]
        info = {"accepted": verdict.accepted, "nodes": len(out.kept) + out.pruned - 1,
                "pruned": out.pruned, "tree": spec.describe()}
        if resync:
            info["resync"] = True
        if auto is not None:
            if len(draft.tree) > 1:
                auto.observe(draft.predicted, verdict.accepted, draft.scores)
            if auto.choose() is None:
                info["fallback"] = (
                    "plain decoding: no draft tree is expected to be faster on this machine "
                    f"(best {max(auto.expected_speedup(b) for b in auto.costs if b):.2f}x)"
                )
                auto.note_fallback()
                yield Step(tokens, info)
                yield from ar_steps(model, mx.array([verdict.bonus]), sampling, cache=cache)
                return
            spec = auto.spec()
            info["tree"] = "auto:" + spec.describe()
        draft = draft_tree(verdict.bonus, top, ptop, q, spec, sampling, rng, max_budget)
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
