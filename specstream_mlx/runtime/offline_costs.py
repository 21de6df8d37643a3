"""Offline pass costs: one bare speculative pass of a ``b``-node tree over one bare
pipelined plain step, on a synthetic prefix (``examples/step_cost.py`` prints them).

``--tree auto`` takes a few of these once per machine and model as its cost prior
(:func:`~.step_costs.calibrate`) and from then on times the passes of real generations,
which include what a generation adds per step (sampling, syncs, the consumer). They are
also the tool for comparing pass kinds, hosting policies and machines without a workload.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple

import mlx.core as mx
import numpy as np

from ..method.acceptance import greedy_accepted_node
from ..method.msa import stream_logits
from ..method.tree import Tree, dynamic_tree, tree_buffers
from .cache import make_cache
from .compiled_pass import SSPass
from .drafting import NO_STREAMS, stream_candidates
from .plain_step import plain_step
from .sampling import KeyStream, SamplingParams
from .verification import verification_target

BUDGETS = (2, 4, 8, 12, 16, 24)


def synthetic_tree(budget: int, depth: int) -> Tree:
    """A dynamic tree shape of ``budget`` nodes; its tokens do not matter for cost."""
    K = max(1, min(budget, 8))
    probs = np.sort(np.random.default_rng(0).dirichlet(np.ones(K), size=depth), axis=1)[:, ::-1]
    tokens = np.tile(np.arange(3, 3 + K), (depth, 1))
    return dynamic_tree(1, tokens, probs, budget)


def timed(fn, reps: int, typical_seconds: Optional[float] = None) -> float:
    """Seconds of one run of ``fn`` after a warm-up: the least disturbed of ``reps`` runs
    (robust to other load); with ``typical_seconds``, the median of at least ``reps`` runs,
    more (up to 8 times as many) until that many seconds of runs are timed: what a pass
    usually costs, for a prior that must not promise passes cheaper than generations will
    see (a pass of a model with sub-millisecond steps varies 2x from run to run)."""
    fn()
    ts = []
    least = typical_seconds or 0.0
    while len(ts) < reps or (sum(ts) < least and len(ts) < 8 * reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return float(np.min(ts) if typical_seconds is None else np.median(ts))


def plain_step_seconds(model, cache, context: int, reps: int) -> float:
    """Seconds of one plain step as decoding runs it (the compiled step), pipelined like
    ``ar_steps``."""
    step = plain_step(model)

    def plain(n=8):
        y = mx.argmax(step(mx.array([5]), cache), axis=-1)
        mx.async_eval(y)
        for _ in range(n):
            nxt = mx.argmax(step(y.reshape(1), cache), axis=-1)
            mx.async_eval(nxt)
            y.item()
            y = nxt
        y.item()
        for c in cache:
            c.trim(c.offset - context)

    return timed(plain, reps) / 9


def pass_fn(forward: SSPass, cache, context: int, b: int, sampled: bool, hosting: int = 0):
    """One pass of budget ``b`` as the engine runs it: forward, its syncs, commit, next
    tree. ``hosting``: streams at the root and this many other nodes (0: every node;
    ``NO_STREAMS``: none, over a ``b``-token chain: a lookup pass)."""
    model, streams = forward.model, forward.streams
    depth = streams.num_streams
    lookup = hosting == NO_STREAMS
    tree = Tree.chain(range(1, b + 2)) if lookup else synthetic_tree(b, depth)
    kind = SamplingParams(temperature=1.0 if sampled else 0.0)
    hosts = None
    if lookup:
        hosts = np.zeros(0, dtype=np.int64)
    elif hosting:
        deepest = np.argsort(-tree_buffers(tree.parents).depths, kind="stable")[:hosting]
        hosts = np.unique(np.concatenate([[0], deepest]))

    q = mx.softmax(mx.random.normal((depth, model.args.vocab_size), key=mx.random.key(0)), axis=-1)
    keys = KeyStream(0)

    def step():
        out = forward(tree, context, cache, num_streams=min(depth, b), hosts=hosts)
        if lookup:  # verification only: the next draft is the host's n-gram continuation
            am = mx.argmax(out.main_logits, axis=-1)
            node = greedy_accepted_node(out.tree.tokens, out.buffers, am)
            mx.eval(am, node)
            np.array(am)
            for c in cache:
                c.commit([0, len(tree) - 1] if len(tree) > 2 else [0])
                c.trim(c.offset - context)
            return
        if sampled:
            # Verification and draws on the device; per-node decisions and draws come back.
            dec = verification_target(out.main_logits, kind, out.tree, out.buffers, q, keys.next())
            cand = stream_candidates(
                stream_logits(model, streams, out, 0), 8, kind, keys.next(), vocab=streams.draft_vocab
            )  # host slot 0
            mx.eval(dec, *cand.arrays())
            np.array(dec)
            cand = cand.to_host()
        else:
            am = mx.argmax(out.main_logits, axis=-1)
            node = greedy_accepted_node(out.tree.tokens, out.buffers, am)
            cand = stream_candidates(stream_logits(model, streams, out, node), 8, kind, vocab=streams.draft_vocab)
            mx.eval(am, node, *cand.arrays())
            cand = cand.to_host()
        for c in cache:
            c.commit([0, len(tree) - 1] if len(tree) > 2 else [0])
        dynamic_tree(1, cand.top, cand.ptop, b)
        for c in cache:
            c.trim(c.offset - context)

    return step


def measure_step_costs(
    model,
    streams,
    context: int = 128,
    reps: int = 7,
    budgets=BUDGETS,
    sampled: bool = False,
    hosting: int = 0,
    compiled: bool = False,
) -> Dict[int, float]:
    """Cost of one pass with ``b`` draft nodes relative to one plain step, per budget."""
    arms = [(b, hosting) for b in budgets if not (hosting and b <= hosting)]  # else every node hosts anyway
    costs = measure_arm_costs(model, streams, arms, context, reps, sampled, compiled).costs
    return {0: 1.0, **{b: c for (b, _), c in costs.items()}}


@dataclass
class ArmCosts:
    """Pass costs per (budget, hosting mode) in plain steps, and the plain step they are
    relative to, in seconds."""

    costs: Dict[Tuple[int, int], float] = field(default_factory=dict)
    plain_seconds: Optional[float] = None


def measure_arm_costs(
    model,
    streams,
    arms,
    context: int = 128,
    reps: int = 7,
    sampled: bool = False,
    compiled: bool = False,
    typical_seconds: Optional[float] = None,
) -> ArmCosts:
    """Cost of one pass of each (budget, hosting mode) in ``arms`` relative to one plain
    step, all against the same timing of the plain step. Passes are timed as the least
    disturbed of ``reps`` runs, or, with ``typical_seconds``, as the median of at least
    ``reps`` runs and that many seconds of them (:func:`timed`)."""
    forward = SSPass(model, streams, compiled)
    cache = make_cache(model)
    model(mx.array([[1] * context]), cache=cache)
    mx.eval([c.keys for c in cache])
    before = plain_step_seconds(model, cache, context, reps)

    seconds = {(b, h): timed(pass_fn(forward, cache, context, b, sampled, h), reps, typical_seconds) for b, h in arms}
    # Timed again after the passes, the least disturbed kept: a process's first timings can
    # be a cold or loaded moment, and the plain step's seconds are stored as the reference
    # that later passes inside generations are measured against (step_costs.PassCosts).
    base = min(before, plain_step_seconds(model, cache, context, reps))
    return ArmCosts({arm: s / base for arm, s in seconds.items()}, base)
