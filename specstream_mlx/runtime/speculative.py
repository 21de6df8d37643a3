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
from dataclasses import dataclass, replace
from typing import Callable, Generator, Optional, Union

import mlx.core as mx
import numpy as np

from ..method.acceptance import Verdict, greedy_accepted_node
from ..method.msa import SSOutput, all_stream_logits, commit_ss, stream_logits
from ..method.streams import NoStreamsError, StreamParams
from ..method.tree import LOOKUP_LEN, Tree, TreeSpec, hosting_nodes
from .autotune import AutoPolicy, DecodingPolicy, FixedPolicy, Plain, Probe, TreePass
from .cache import make_cache
from .drafting import (
    NO_STREAMS,
    Candidates,
    Draft,
    chain_draft,
    draft_tree,
    max_draws,
    sampled_lookup_length,
    stream_candidates,
    with_lookup,
    with_lookup_sampled,
)
from .loaded_model import SpeculativeModel, as_speculative
from .lookup import LookupBranch, LookupReplay
from .sampling import KeyStream, SamplingParams
from .steps import Step, StepInfo, ar_steps, pipelined_tokens, prefill
from .verification import verification_target, verify

# The one default of the library and every front end (CLI, chat, servers, bench): measure
# and choose, falling back to plain decoding when no tree pays, so it is never slower.
DEFAULT_TREE = "auto"


@dataclass(frozen=True)
class SSOptions:
    """What only ``--mode ss`` takes, carried as one value through generation and sessions.

    Attributes:
        tree: a :class:`TreeSpec`, its text form, or ``"auto"`` (None: the same).
        pruning_threshold: early-exit pruning threshold; None: the model's own.
        log: where ``--tree auto`` says it has no stored pass costs for this model yet.
        policy: with ``tree="auto"``, the policy to decode with (a server passes each
            client's own, :mod:`~specstream_mlx.serve.client_policies`); None: the model's shared one.
    """

    tree: Union[None, str, TreeSpec] = DEFAULT_TREE
    pruning_threshold: Optional[float] = None
    log: Optional[Callable[[str], None]] = None
    policy: Optional[AutoPolicy] = None


# Below this many stream-logit elements (kept nodes x γ x vocab) the streams of
# every kept node go through the LM head in the verification pass itself when
# sampling (the accepted node is only known after host-side rejection sampling);
# above it only the accepted node's streams are computed, after a second sync.
EAGER_STREAM_LOGITS = 1 << 16


@dataclass
class PassResult:
    """Host-side outcome of one pass: the verdict and the accepted node's stream
    candidates (host arrays, (γ, K); the proposal distributions stay on the device),
    which draft the next tree."""

    verdict: Verdict
    candidates: Candidates
    resync: bool = False


def check_pruning_threshold(threshold: Optional[float]) -> None:
    """Raise ValueError unless ``threshold`` is None (the model's own) or a probability: above 1
    every draft node was pruned, below 0 none, and NaN pruned every one (no comparison holds)."""
    if threshold is not None and not 0.0 <= threshold <= 1.0:
        raise ValueError(f"the pruning threshold must be a probability in [0, 1], got {threshold}")


def make_policy(
    sm: SpeculativeModel,
    tree: Union[None, str, TreeSpec],
    sampling: SamplingParams,
    pruning_threshold: Optional[float],
    log=None,
    auto: Optional[AutoPolicy] = None,
):
    """The policy of one generation: ``auto`` (default the model's shared one) when the tree
    is ``"auto"``, else the fixed tree."""
    check_pruning_threshold(pruning_threshold)
    threshold = sm.streams.config.pruning_threshold if pruning_threshold is None else pruning_threshold
    if not sampling.greedy:
        threshold = 0.0  # lossless sampling: see ss_steps
    if tree is None:
        tree = DEFAULT_TREE
    if tree == "auto":
        policy = auto if auto is not None else sm.tuner(sampling, log)
        # With the model's own threshold auto chooses between it and no pruning, by measurement.
        policy.new_request((0.0, threshold) if pruning_threshold is None else (threshold,))
        return policy
    spec = TreeSpec.parse(tree) if isinstance(tree, str) else tree
    return FixedPolicy(spec, threshold)


def prepare_auto(model, mode: str, tree: Union[None, str, TreeSpec], sampling: SamplingParams, log=None) -> None:
    """Ready ``--tree auto`` for requests of this decoding kind before the first one comes:
    on a machine and model without stored pass costs their one-off timing (seconds for
    SmolLM2) runs now, where a command or a server starts, instead of inside the first
    request's time to its first token. Nothing for other modes or trees, or without streams."""
    if mode != "ss" or tree not in (None, "auto"):
        return
    if isinstance(model, SpeculativeModel) and model.streams is not None:
        model.tuner(sampling, log)


def _usable(cand: Candidates, slot: int, shift: int) -> Candidates:
    """The candidate rows that can draft the next tree from a node whose streams
    come from host ``slot``, ``shift`` levels above it (none when no ancestor hosted)."""
    return cand.map(lambda a: a[:0] if slot < 0 else a[shift:])


def verify_greedy(sm: SpeculativeModel, out: SSOutput, K: int, sampling: SamplingParams) -> PassResult:
    """Verification and the next draft's candidates in one sync."""
    slot, shift = out.sources()
    vocab = sm.streams.draft_vocab
    has_hosts = out.stream_hidden.shape[0] > 0
    am = verification_target(out.main_logits, sampling)
    node_dev = greedy_accepted_node(out.tree.tokens, out.buffers, am)
    cand = None
    if has_hosts:
        slot_dev = node_dev if out.every_node_hosts else mx.maximum(mx.array(slot)[node_dev], 0)
        cand = stream_candidates(stream_logits(sm.base, sm.streams, out, slot_dev), K, sampling, vocab=vocab)
        mx.eval(am, node_dev, *cand.arrays())
    else:
        mx.eval(am, node_dev)
    verdict = verify(out.tree, out.buffers, sampling, np.array(am))
    node = verdict.path[-1]
    resync = node != int(node_dev.item())
    if resync and has_hosts and slot[node] >= 0:  # not expected; the host verdict wins
        cand = stream_candidates(stream_logits(sm.base, sm.streams, out, int(slot[node])), K, sampling, vocab=vocab)
        mx.eval(*cand.arrays())
    if cand is None:
        return PassResult(verdict, Candidates.empty(K), resync)
    return PassResult(verdict, _usable(cand.to_host(), int(slot[node]), int(shift[node])), resync)


def verify_sampled(
    sm: SpeculativeModel, out: SSOutput, K: int, sampling: SamplingParams, draft: Draft, keys: KeyStream, draws: int
) -> PassResult:
    """Rejection-sampling verification on the device (only per-node decisions come back);
    stream candidates and draws in the same sync when small, else after it for the
    accepted node's host only."""
    slot, shift = out.sources()
    vocab = sm.streams.draft_vocab
    width = sm.args.vocab_size if vocab is None else vocab.ids.size
    n_stream_logits = out.stream_hidden.shape[0] * out.stream_hidden.shape[1] * width
    eager = 0 < n_stream_logits <= EAGER_STREAM_LOGITS
    q_rows = None if draft.q_rows is None else draft.q_rows[out.kept]
    decisions = verification_target(
        out.main_logits, sampling, out.tree, out.buffers, draft.draft_q, keys.next(), q_rows
    )
    cand = None
    if eager:
        cand = stream_candidates(all_stream_logits(sm.base, sm.streams, out), K, sampling, keys.next(), draws, vocab)
    mx.eval(decisions, *(cand.arrays() if eager else ()))
    verdict = verify(out.tree, out.buffers, sampling, np.array(decisions))
    node = verdict.path[-1]
    s, sh = int(slot[node]), int(shift[node])
    if s < 0:
        return PassResult(verdict, Candidates.empty(K))
    if eager:
        cand = cand.map(lambda a: a[s])
    else:
        cand = stream_candidates(stream_logits(sm.base, sm.streams, out, s), K, sampling, keys.next(), draws, vocab)
        mx.eval(*cand.arrays())
    return PassResult(verdict, _usable(cand, s, sh).to_host())


def _plain_rest(model, root: int, sampling, cache, policy, reason: str) -> Generator[Step, None, None]:
    """Plain decoding from the decided, not yet cached ``root`` to the end of the request,
    each token timed from one resume to the next (the consumer's work included, as for
    tree passes) for the policy's costs."""
    t = None
    for i, step in enumerate(ar_steps(model, mx.array([root]), sampling, cache=cache)):
        if i == 0:
            step.info.fallback = reason
        yield step
        now = time.perf_counter()
        if t is not None:
            policy.observe_plain(now - t)
        t = now


def plain_probe(
    model,
    token: int,
    n: Optional[int],
    sampling: SamplingParams,
    cache,
    seed: int,
    on_token_seconds: Callable[[float], None],
    stop: Optional[Callable[[], bool]] = None,
    reason: Optional[str] = None,
) -> Generator[Step, None, int]:
    """``n`` plain steps (or until ``stop()``) from the decided, not yet cached ``token``
    (:func:`~specstream_mlx.runtime.steps.pipelined_tokens`); each token between the first
    and the last is timed from one resume to the next; the first carries ``reason`` (why
    decoding is plain) when given. Returns the last token, decided and yielded but not
    cached: the state a speculative pass starts from. Lossless: every token is the
    target's own choice (sampled with keys of its own ``seed``).

    The last token is not timed: its step was queued before the token before it was handed
    out, and MLX holds the host back while a step's operations are in flight, so that step
    ran mostly inside the previous token's time (SmolLM2: 5 against 24 ms), and booking it
    made every pass look a fifth dearer."""
    t, last, held = None, token, None
    for y in pipelined_tokens(model, mx.array([token]), sampling, cache, KeyStream(seed), n, stop):
        last = y.item()
        yield Step([last], StepInfo(accepted=0, fallback=reason if t is None else None))  # accepted no draft
        now = time.perf_counter()
        if held is not None:  # a token followed by another: a whole step
            on_token_seconds(held)
        held, t = (None if t is None else now - t), now
    return last


def _next_draft(sm, res: PassResult, plan: TreePass, sampling, hosted: bool, chain, chain_scores) -> Draft:
    """The next tree from the accepted node's stream candidates, with the lookup ``chain``
    merged in (greedy: the best nodes of both under the budget) or hung from the root
    (sampling: its share of the budget fixed before the draws are seen). ``hosted``: this
    pass hosted streams at some nodes only (the draft remembers the hosting mode it came from)."""
    bonus, spec, scored, cand = res.verdict.bonus, plan.next_tree, plan.score_budget, res.candidates
    if plan.hosting == NO_STREAMS:  # --tree auto's lookup arm (greedy): the continuation alone
        return chain_draft(bonus, chain, chain_scores, spec.budget)
    from_hosting = plan.hosting if hosted else 0
    if not chain:
        nxt = draft_tree(bonus, cand, spec, sampling, scored)
    elif sampling.greedy:
        nxt = with_lookup(draft_tree(bonus, cand, spec, sampling, scored), chain, chain_scores, spec.budget)
    else:
        k = sampled_lookup_length(chain_scores, spec.budget)
        small = replace(spec, budget=spec.budget - k) if k else spec
        nxt = draft_tree(bonus, cand, small, sampling, scored)
        nxt = with_lookup_sampled(nxt, chain[:k], chain_scores[:k], sm.args.vocab_size)
        # Drafted smaller, its pass is booked to the arm that planned it.
        return replace(nxt, forecast=replace(nxt.forecast, budget=spec.budget, from_hosting=from_hosting))
    return replace(nxt, forecast=replace(nxt.forecast, from_hosting=from_hosting))


# Plain tokens at most in one stretch of the lookup arm before the policy is asked again.
LOOKUP_STRETCH = 16


def _proposal(policy: DecodingPolicy, lookup: LookupBranch, decided: list, gate: bool):
    """The lookup branch's continuation of ``decided`` and its path scores, told to the
    policy; with ``gate`` (the lookup arm) none where it is not worth a pass."""
    chain, scores = lookup.propose(decided)
    if not policy.observe_lookup(float(sum(scores))) and gate:
        return [], []
    return chain, scores


def _lookup_stretch(
    model,
    root: int,
    sampling: SamplingParams,
    cache,
    seed: int,
    policy: DecodingPolicy,
    lookup: LookupBranch,
    decided: list,
) -> Generator[Step, None, int]:
    """The lookup arm's steps while no continuation is worth a pass: up to ``LOOKUP_STRETCH``
    pipelined plain tokens from ``root`` (decided, not cached), each timed as a plain one and
    followed by the continuation from it, stopping once the text is seen copying and that
    continuation is worth verifying. Returns the last token (decided, not cached), the
    branch's last proposal judged."""
    seen, worth = len(decided), False

    def stop() -> bool:  # asked before the next token is queued; one new token each time
        nonlocal seen, worth
        if len(decided) > seen:
            seen = len(decided)
            # A pass only once the text is seen copying: the last proposal foretold the
            # token just decided (a copied span goes on; a stray match mostly does not).
            copying = lookup.chain[:1] == decided[-1:]
            lookup.observe(decided[-1:])
            pays = policy.observe_lookup(float(sum(lookup.propose(decided)[1])))
            worth = copying and pays
        return worth

    last = yield from plain_probe(model, root, LOOKUP_STRETCH, sampling, cache, seed, policy.observe_plain, stop)
    if worth:  # the proposal before the last token: judged by it
        lookup.observe([last])
    else:  # cut at the stretch's length: one token past its proposal
        lookup.forget()
    return last


def _recorded(steps: Generator[Step, None, int], decided: list) -> Generator[Step, None, int]:
    """``steps``, their tokens appended to ``decided``; returns what ``steps`` returns."""
    while True:
        try:
            step = next(steps)
        except StopIteration as stop:
            return stop.value
        decided.extend(step.tokens)
        yield step


def _hosts(draft: Draft, hosting: int) -> Optional[np.ndarray]:
    """The nodes that host streams under hosting mode ``hosting`` (None: every node)."""
    if hosting == NO_STREAMS:
        return np.zeros(0, dtype=np.int64)
    if hosting and draft.reach is not None and len(draft.tree) > hosting + 1:
        return hosting_nodes(draft.tree.parents, draft.reach, hosting)
    return None


def _step(out: SSOutput, res: PassResult, plan: TreePass) -> Step:
    tokens = [out.tree.tokens[i] for i in res.verdict.path[1:]] + [res.verdict.bonus]
    nodes = len(out.kept) + out.pruned - 1
    info = StepInfo(res.verdict.accepted, nodes, out.pruned, plan.label, resync=res.resync)
    return Step(tokens, info)


def ss_steps(
    model,
    prompt: mx.array,
    sampling: SamplingParams,
    cache=None,
    streams: Optional[StreamParams] = None,
    tree: Union[None, str, TreeSpec] = DEFAULT_TREE,
    pruning_threshold: Optional[float] = None,
    prefill_chunk: int = 512,
    log: Optional[Callable[[str], None]] = None,
    policy: Optional[AutoPolicy] = None,
) -> Generator[Step, None, None]:
    """Speculative Streaming decoding; yields the tokens each pass decided.

    Args:
        model: a :class:`SpeculativeModel` (from :func:`load`) or a bare base model.
        prompt: 1-D prompt ids.
        sampling: greedy or sampled decoding.
        cache: a KV cache to continue (multi-turn); default fresh.
        streams: streams to use instead of the model's own.
        tree: a :class:`TreeSpec` (or its text form), ``"auto"`` (measure and
            choose; may fall back to plain decoding; the default, as everywhere), or None (the same).
        pruning_threshold: early-exit pruning threshold; default from specstream.json.
            Applied to greedy decoding only: under sampling the surviving children
            would no longer be draws from the proposal that verification assumes.
        policy: with ``tree="auto"``, the :class:`AutoPolicy` to decode with (a server
            passes each client's own); None: the model's shared one.
    """
    sm = as_speculative(model, streams)
    if sm.streams is None:
        raise NoStreamsError("this model has no speculative streams; use --mode ar or lookup")
    policy = make_policy(sm, tree, sampling, pruning_threshold, log, policy)
    try:
        yield from _ss_loop(sm, policy, prompt, sampling, cache if cache is not None else make_cache(sm), prefill_chunk)
    finally:
        policy.finish()


def _ss_loop(
    sm: SpeculativeModel, policy: DecodingPolicy, prompt, sampling, cache, prefill_chunk
) -> Generator[Step, None, None]:
    """Pass after pass as the policy plans them: draft -> verify -> accept -> commit, then
    the next tree from the accepted node's streams; or timed plain tokens when it asks."""
    rng, keys = np.random.default_rng(sampling.seed), KeyStream(sampling.seed)
    prefill(sm.base, prompt[:-1], cache, prefill_chunk)
    decided = prompt.tolist()  # what n-gram lookup branches continue
    lookup: Optional[LookupBranch] = None
    replay, told = LookupReplay(LOOKUP_LEN), False
    draft = Draft(Tree((decided[-1],), (-1,)))
    while True:
        plan = policy.plan()
        if isinstance(plan, Plain) and not plan.watch:
            yield from _plain_rest(sm.base, draft.tree.tokens[0], sampling, cache, policy, plan.reason)
            return
        if isinstance(plan, (Plain, Probe)):
            seed, start, stop = int(rng.integers(2**31)), len(decided), None
            if isinstance(plan, Plain):  # greedy: plain until replayed lookup passes say they pay

                def stop(start=start):
                    replayed = replay.replay(decided, start)
                    for accepted in replayed:
                        policy.observe_replayed(accepted)
                    return bool(replayed) and policy.resume_passes()

            n, reason = (plan.tokens, None) if isinstance(plan, Probe) else (None, None if told else plan.reason)
            told = told or reason is not None
            probe = plain_probe(
                sm.base, draft.tree.tokens[0], n, sampling, cache, seed, policy.observe_plain, stop, reason
            )
            root = yield from _recorded(probe, decided)
            draft = Draft(Tree((root,), (-1,)))  # plain steps leave no streams (nor lookup branch) to draft from
            if lookup is not None:
                lookup.forget()
            continue
        if plan.hosting == NO_STREAMS and len(draft.tree) == 1:
            # The lookup arm with no continuation worth verifying: plain tokens, pipelined as
            # `ar` runs them, until one is (a root-only pass would run op by op).
            if lookup is None:
                lookup = LookupBranch(plan.next_tree.lookup, replay.rates)
            seed, root = int(rng.integers(2**31)), draft.tree.tokens[0]
            stretch = _lookup_stretch(sm.base, root, sampling, cache, seed, policy, lookup, decided)
            root = yield from _recorded(stretch, decided)
            draft = chain_draft(root, *_proposal(policy, lookup, decided, gate=True), plan.next_tree.budget)
            continue
        t = time.perf_counter()
        hosts = _hosts(draft, plan.hosting)
        forward = sm.ss_pass(plan.compiled)  # made once per model and pass kind
        out = forward(draft.tree, cache[0].offset, cache, plan.threshold, plan.streams_per_host, hosts)
        if sampling.greedy:
            res = verify_greedy(sm, out, plan.candidates, sampling)
        else:
            res = verify_sampled(sm, out, plan.candidates, sampling, draft, keys, max_draws(plan.next_tree))
        commit_ss(cache, sm.streams, out, res.verdict.path)
        step = _step(out, res, plan)
        decided.extend(step.tokens)
        if lookup is not None:
            lookup.observe(step.tokens)
        if plan.next_tree.lookup and (lookup is None or lookup.length != plan.next_tree.lookup):
            lookup = LookupBranch(plan.next_tree.lookup, replay.rates)
        # On the lookup arm a continuation not worth a pass is dropped: plain steps follow.
        gate = plan.hosting == NO_STREAMS
        chain, chain_scores = _proposal(policy, lookup, decided, gate) if plan.next_tree.lookup else ([], [])
        nxt = _next_draft(sm, res, plan, sampling, hosts is not None, chain, chain_scores)
        try:
            yield step
        finally:  # the last pass too: a request's end closes the generator at its yield
            policy.observe_pass(plan, draft, res.verdict.accepted, time.perf_counter() - t)
        draft = nxt
