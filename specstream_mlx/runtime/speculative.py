"""The Speculative Streaming engine (``--mode ss``).

One pass over the tree rooted at the last decided token verifies the previous
draft with the main rows and drafts the next tree from the streams of the
last accepted node (docs/DESIGN.md). The engine is a step generator like
:func:`~specstream_mlx.runtime.steps.ar_steps`: one :class:`Step` per pass.

A pass costs one host sync when greedy (the accepted node is found on the
device, so the next draft's stream candidates join the verification eval),
and one or two when sampling (the accepted node is only known after host-side
rejection sampling; small stream logits are computed eagerly for every node).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Generator, Optional, Union

import mlx.core as mx
import numpy as np

from ..method.acceptance import Verdict, greedy_accepted_node
from ..method.msa import SSOutput, all_stream_logits, commit_ss, stream_logits
from ..method.streams import NoStreamsError, StreamParams
from ..method.tree import Tree, TreeSpec, hosting_nodes
from ..platform_info import using_blas_threads
from .autotune import PLAIN_PROBE, AutoTree
from .cache import make_cache
from .drafting import Draft, draft_tree, num_candidates, stream_candidates
from .engine import SpeculativeModel, as_speculative
from .sampling import KeyStream, SamplingParams, sample_token
from .steps import Step, StepInfo, ar_steps, prefill
from .verification import verification_target, verify

DEFAULT_TREE = TreeSpec("dynamic", budget=12, depth=4)

# Below this many stream-logit elements (kept nodes x γ x vocab) the streams of
# every kept node go through the LM head in the verification pass itself when
# sampling (the accepted node is only known after host-side rejection sampling);
# above it only the accepted node's streams are computed, after a second sync.
EAGER_STREAM_LOGITS = 1 << 16


@dataclass
class TreePlan:
    """Which trees this generation drafts.

    Attributes:
        spec: the tree shape of the next pass.
        auto: the ``--tree auto`` tuner, or None for a fixed tree.
        candidates: top-K per stream to fetch (enough for every budget auto scores).
        score_budget: largest budget auto scores (0 without auto).
    """

    spec: TreeSpec
    auto: Optional[AutoTree]
    candidates: int
    score_budget: int


@dataclass
class PassResult:
    """Host-side outcome of one pass: the verdict and the next draft's candidates."""

    verdict: Verdict
    top: np.ndarray  # (γ, K) stream candidate tokens at the accepted node
    ptop: np.ndarray  # (γ, K) their probabilities
    q: Optional[np.ndarray]  # (γ, V) proposal distributions (sampling only)
    resync: bool = False


def plan_trees(
    sm: SpeculativeModel, tree: Union[None, str, TreeSpec], sampling: SamplingParams, log, client: Any = None
) -> TreePlan:
    if isinstance(tree, str) and tree != "auto":
        tree = TreeSpec.parse(tree)
    if tree == "auto":
        auto = sm.tuner(sampling, log, client)
        budget = max(auto.costs)
        return TreePlan(auto.spec(), auto, num_candidates(auto.spec(), budget), budget)
    spec = tree or DEFAULT_TREE
    return TreePlan(spec, None, num_candidates(spec), 0)


def _usable(arrays, slot: int, shift: int):
    """The candidate rows that can draft the next tree from a node whose streams
    come from host ``slot``, ``shift`` levels above it (none when no ancestor hosted)."""
    if slot < 0:
        return tuple(None if a is None else a[:0] for a in arrays)
    return tuple(None if a is None else a[shift:] for a in arrays)


def verify_greedy(sm: SpeculativeModel, out: SSOutput, K: int, sampling: SamplingParams) -> PassResult:
    """Verification and the next draft's candidates in one sync."""
    slot, shift = out.sources()
    has_hosts = out.stream_hidden.shape[0] > 0
    am = verification_target(out.main_logits, sampling)
    node_dev = greedy_accepted_node(out.tree.tokens, out.buffers, am)
    cand = None
    if has_hosts:
        slot_dev = node_dev if out.every_node_hosts else mx.maximum(mx.array(slot)[node_dev], 0)
        cand = stream_candidates(stream_logits(sm.base, out, slot_dev), K, sampling)
        mx.eval(am, node_dev, *cand[:2])
    else:
        mx.eval(am, node_dev)
    verdict = verify(out.tree, out.buffers, sampling, np.array(am), None, None)
    node = verdict.path[-1]
    resync = node != int(node_dev.item())
    if resync and has_hosts and slot[node] >= 0:  # not expected; the host verdict wins
        cand = stream_candidates(stream_logits(sm.base, out, int(slot[node])), K, sampling)
        mx.eval(*cand[:2])
    if cand is None:
        top, ptop = np.zeros((0, K), np.int32), np.zeros((0, K), np.float32)
    else:
        top, ptop = _usable((np.array(cand[0]), np.array(cand[1])), int(slot[node]), int(shift[node]))
    return PassResult(verdict, top, ptop, None, resync)


def verify_sampled(
    sm: SpeculativeModel, out: SSOutput, K: int, sampling: SamplingParams, draft: Draft, rng: np.random.Generator
) -> PassResult:
    """Rejection-sampling verification; stream candidates in the same sync when small."""
    slot, shift = out.sources()
    n_stream_logits = out.stream_hidden.shape[0] * out.stream_hidden.shape[1] * sm.args.vocab_size
    eager = 0 < n_stream_logits <= EAGER_STREAM_LOGITS
    target = verification_target(out.main_logits, sampling)
    cand = stream_candidates(all_stream_logits(sm.base, out), K, sampling) if eager else None
    mx.eval(target, *(cand or ()))
    verdict = verify(out.tree, out.buffers, sampling, np.array(target), draft.draft_q, rng)
    node = verdict.path[-1]
    s, sh = int(slot[node]), int(shift[node])
    if s < 0:
        empty = np.zeros((0, K))
        return PassResult(verdict, empty.astype(np.int32), empty, empty)
    if eager:
        top, ptop, q = (np.array(a[s]) for a in cand)
    else:
        cand = stream_candidates(stream_logits(sm.base, out, s), K, sampling)
        mx.eval(*cand)
        top, ptop, q = (np.array(a) for a in cand)
    top, ptop, q = _usable((top, ptop, q), s, sh)
    return PassResult(verdict, top, ptop, q)


def _timed_plain(auto: AutoTree, steps) -> Generator[Step, None, None]:
    """Plain steps, each timed from one resume to the next (the consumer's work included,
    as for tree passes) for auto's online costs."""
    t = None
    for step in steps:
        yield step
        now = time.perf_counter()
        if t is not None:
            auto.observe_plain_seconds(now - t)
        t = now


def _plain_fallback(model, prompt, sampling, cache, prefill_chunk, auto) -> Generator[Step, None, None]:
    """--tree auto fell back on recent requests: decode plainly (trees are re-tried later)."""
    steps = ar_steps(model, prompt, sampling, cache=cache, prefill_chunk=prefill_chunk)
    first = next(steps)
    first.info.fallback = "plain decoding: draft trees did not pay off on recent requests (re-tried later)"
    yield first
    yield from _timed_plain(auto, steps)


def plain_probe(
    model, token: int, n: int, sampling: SamplingParams, cache, seed: int, on_token_seconds: Callable[[float], None]
) -> Generator[Step, None, int]:
    """``n`` plain steps from the decided, not yet cached ``token``, pipelined as
    :func:`~specstream_mlx.runtime.steps.ar_steps`; each token after the first is timed
    from one resume to the next. Returns the last token, decided and yielded but
    not cached: the state a speculative pass starts from. Lossless: every token is
    the target's own choice (sampled with keys of its own ``seed``)."""
    keys = KeyStream(seed)

    def forward(tok: mx.array) -> mx.array:
        logits = model(tok.reshape(1, -1), cache=cache)[:, -1, :]
        return sample_token(logits, sampling, None if sampling.greedy else keys.next())

    y = forward(mx.array([token]))
    mx.async_eval(y)
    t = None
    for i in range(n):
        tok = y
        if i < n - 1:  # the last token is not run: the next speculative pass caches it as its root
            y = forward(tok)
            mx.async_eval(y)
        yield Step([tok.item()], StepInfo(accepted=0))  # a pass that accepted no draft token
        now = time.perf_counter()
        if t is not None:
            on_token_seconds(now - t)
        t = now
    return tok.item()


def _book_pass(auto: Optional[AutoTree], timing) -> None:
    """Book a timed pass's wall time, from its start until now, to its arm."""
    if timing is not None:
        auto.observe_pass_seconds(*timing[0], time.perf_counter() - timing[1])


def _observe_draft(auto: AutoTree, draft: Draft, accepted: int) -> None:
    """Tell the tuner what the verified draft predicted and how much of it was accepted."""
    auto.observe(draft.predicted, accepted, draft.scores, draft.candidate_depth, draft.from_hosting, draft.budget)


def _probe(sm: SpeculativeModel, auto: AutoTree, token: int, sampling, cache, rng) -> Generator[Step, None, Draft]:
    """A timed plain probe from the decided ``token``; returns the next draft: its last
    token alone (plain steps leave no stream states to draft a tree from)."""
    seed = int(rng.integers(2**31))
    root = yield from plain_probe(sm.base, token, PLAIN_PROBE, sampling, cache, seed, auto.observe_plain_seconds)
    return Draft(Tree((root,), (-1,)))


def _auto_fallback_reason(auto: AutoTree) -> str:
    best = max(auto.expected_speedup(b, h) for b, h, _ in auto.arms())
    return f"plain decoding: no draft tree is expected to be faster on this machine (best {best:.2f}x)"


def ss_steps(
    model,
    prompt: mx.array,
    sampling: SamplingParams,
    cache=None,
    streams: Optional[StreamParams] = None,
    tree: Union[None, str, TreeSpec] = None,
    pruning_threshold: Optional[float] = None,
    prefill_chunk: int = 512,
    log: Optional[Callable[[str], None]] = None,
    client: Any = None,
) -> Generator[Step, None, None]:
    """Speculative Streaming decoding; yields the tokens each pass decided.

    Args:
        model: a :class:`SpeculativeModel` (from :func:`load`) or a bare base model.
        prompt: 1-D prompt ids.
        sampling: greedy or sampled decoding.
        cache: a KV cache to continue (multi-turn); default fresh.
        streams: streams to use instead of the model's own.
        tree: a :class:`TreeSpec` (or its text form), ``"auto"`` (measure and
            choose; may fall back to plain decoding), or None for the default dynamic tree.
        pruning_threshold: early-exit pruning threshold; default from specstream.json.
            Applied to greedy decoding only: under sampling the surviving children
            would no longer be draws from the proposal that verification assumes.
        client: with ``tree="auto"``, whose acceptance evidence and back-off to use
            (a server passes its client; None: the model's shared tuner).
    """
    sm = as_speculative(model, streams)
    if sm.streams is None:
        raise NoStreamsError("this model has no speculative streams; use --mode ar or lookup")
    plan = plan_trees(sm, tree, sampling, log, client)
    cache = cache if cache is not None else make_cache(sm)
    # auto decodes with the BLAS thread count it measured, restored when the generation ends.
    with using_blas_threads(plan.auto.blas_threads if plan.auto is not None else None):
        yield from _ss_loop(sm, plan, prompt, sampling, cache, pruning_threshold, prefill_chunk)


def _ss_loop(
    sm, plan: TreePlan, prompt, sampling, cache, pruning_threshold, prefill_chunk
) -> Generator[Step, None, None]:
    if plan.auto is not None and not plan.auto.new_request():
        yield from _plain_fallback(sm.base, prompt, sampling, cache, prefill_chunk, plan.auto)
        return
    threshold = sm.streams.config.pruning_threshold if pruning_threshold is None else pruning_threshold
    if not sampling.greedy:
        threshold = 0.0  # lossless sampling: see the docstring
    if plan.auto is not None:
        # auto with the model's own threshold chooses between it and no pruning, by measurement.
        plan.auto.set_pruning_levels((0.0, threshold) if pruning_threshold is None else (threshold,))
    rng = np.random.default_rng(sampling.seed)
    forward = sm.ss_pass(plan.auto.compiled if plan.auto is not None else None)
    prefill(sm.base, prompt[:-1], cache, prefill_chunk)
    draft = Draft(Tree((int(prompt[-1].item()),), (-1,)))
    spec = plan.spec
    timing = None  # auto: (arm, start) of the pass whose wall time is being measured
    while True:
        _book_pass(plan.auto, timing)
        timing = None
        # Streams deeper than the next tree can use are not hosted (fewer MSA rows),
        # except on auto's exploration passes.
        hosted, hosting = plan.auto.next_pass() if plan.auto is not None else (spec.max_depth, spec.hosts)
        if plan.auto is not None and len(draft.tree) > 1:
            # Exploring passes count too: running an arm includes them.
            timing = ((draft.budget, plan.auto.hosting), time.perf_counter())
        hosts = None
        if hosting and draft.reach is not None and len(draft.tree) > hosting + 1:
            hosts = hosting_nodes(draft.tree.parents, draft.reach, hosting)
        thr = plan.auto.pruning_threshold() if plan.auto is not None else threshold
        t_pass = time.perf_counter()
        out = forward(draft.tree, cache[0].offset, cache, thr, hosted, hosts)
        if sampling.greedy:
            res = verify_greedy(sm, out, plan.candidates, sampling)
        else:
            res = verify_sampled(sm, out, plan.candidates, sampling, draft, rng)
        if plan.auto is not None and len(draft.tree) > 1:
            plan.auto.observe_pruning(thr, time.perf_counter() - t_pass, res.verdict.accepted + 1)
        commit_ss(cache, sm.streams, out, res.verdict.path)
        tokens = [out.tree.tokens[i] for i in res.verdict.path[1:]] + [res.verdict.bonus]
        info = StepInfo(
            accepted=res.verdict.accepted,
            nodes=len(out.kept) + out.pruned - 1,
            pruned=out.pruned,
            tree=spec.describe(),
            resync=res.resync,
        )
        if plan.auto is not None:
            auto = plan.auto
            if len(draft.tree) > 1:
                _observe_draft(auto, draft, res.verdict.accepted)
            if auto.choose() is None:
                info.fallback = _auto_fallback_reason(auto)
                auto.note_fallback()
                yield Step(tokens, info)
                yield from _timed_plain(auto, ar_steps(sm.base, mx.array([res.verdict.bonus]), sampling, cache=cache))
                return
            spec = auto.spec()
            info.tree = "auto:" + spec.describe()
            if auto.plain_probe_due():
                yield Step(tokens, info)
                _book_pass(auto, timing)  # before the probe, which is timed on its own
                timing = None
                draft = yield from _probe(sm, auto, res.verdict.bonus, sampling, cache, rng)
                continue
        draft = draft_tree(res.verdict.bonus, res.top, res.ptop, res.q, spec, sampling, rng, plan.score_budget)
        draft.from_hosting = hosting if hosts is not None else 0
        yield Step(tokens, info)
