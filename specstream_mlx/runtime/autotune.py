"""``--tree auto``: pick the draft-tree size that is fastest on this machine.

These measurements combine:

* **BLAS threads**: where the BLAS exposes a thread count (OpenBLAS on Linux),
  one thread and the default are timed on a plain step and a small pass, and the
  faster count is used (and stored with the costs, which are measured with it).
* **Pass kind**: op-by-op and compiled passes (:mod:`.compiled_pass`) are timed
  the same way; compiling is used when it is at least ``COMPILE_MARGIN`` faster.
* **Step cost** (per model, device, BLAS, dtype and decoding kind; cached on
  disk): the time of one ``ss`` pass over a tree of ``b`` draft nodes divided
  by one pipelined plain step, for a few budgets ``b``. Greedy and sampled
  passes are measured separately (they differ in syncs and host work). Costs
  are re-measured when the cache entry is older than ``MAX_COST_AGE_S``, or was
  taken while the machine was loaded (1-minute load average per core above
  ``LOADED``, from ``os.getloadavg``) and the machine is quieter now.
* **Acceptance** (online, every pass): for a dynamic tree the expected
  accepted length of budget ``b`` is the sum of the ``b`` highest path scores
  (products of stream probabilities); a running calibration factor (actual
  accepted / predicted) corrects for over- or under-confident streams. A pass
  normally hosts only the streams its next tree can use, which would leave
  deeper budgets judged on shallow candidate lists (and so always look worse);
  every ``EXPLORE_EVERY``-th pass therefore hosts all γ streams, and a budget
  is credited only from passes whose candidates were as deep as it allows.

* **Online costs**: the offline table times bare passes and plain steps, which
  leaves out what a real generation adds per yielded step (sampling, host syncs,
  detokenizing, the consumer of the tokens): plain decoding pays that per token,
  a tree pass once per τ tokens. So the wall time of every tree pass (from one
  loop iteration to the next, consumer included; the arm's exploring passes
  too, since running the arm includes them) is kept per arm, and plain
  tokens are timed the same way: on fall-back decoding and on short plain
  *probes* (``PLAIN_PROBE`` tokens every ``PLAIN_EVERY`` tree passes, lossless
  like any plain step). Once both have ``TIME_MIN`` samples, an arm's cost is
  its measured seconds per pass over the measured seconds per plain token; arms
  not yet timed have their table cost scaled by what the timed ones showed.

Expected tokens/s of budget b ∝ (1 + c·E_b) / cost(b); plain decoding scores
1. Early-exit pruning (greedy decoding, when the model has a calibrated
threshold) is chosen online: its benefit depends on how many nodes it drops and
what the early-exit head and its mid-pass sync cost here, so passes with and
without it are timed (seconds per decided token) and the cheaper one is used,
the other re-tried periodically. When the best arm is expected to be clearly slower
than plain decoding after a warm-up (below ``FALLBACK_BELOW``: estimates near break-even
move from pass to pass, and each fall-back costs the rest of the request and a
back-off), decoding switches to plain ``ar`` on the same cache and the stats say so.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

import mlx.core as mx
import numpy as np

from ..io.bundles import cache_root
from ..method.acceptance import greedy_accepted_node
from ..method.msa import stream_logits
from ..method.tree import Tree, TreeSpec, dynamic_tree, tree_buffers
from ..platform_info import blas_in_use, blas_max_threads, using_blas_threads
from .cache import make_cache
from .compiled_pass import SSPass
from .drafting import stream_candidates
from .sampling import SamplingParams, target_probs

CANDIDATE_BUDGETS = (2, 4, 8, 12, 16, 24)
# Where measured step costs are kept: this path when set (tests), else step_costs.json in
# $SPECSTREAM_CACHE_DIR, else in the user cache of converted models (cache_root()), read
# at each use rather than at import.
CACHE_FILE: Optional[Path] = None


def cost_cache_file() -> Path:
    if CACHE_FILE is not None:
        return Path(CACHE_FILE)
    env = os.environ.get("SPECSTREAM_CACHE_DIR")
    return (Path(env).expanduser() if env else cache_root()) / "step_costs.json"


WARMUP_STEPS = 6
MAX_BACKOFF = 16
EXPLORE_EVERY = 4
# The hosting policy auto weighs against hosting everywhere: streams at the root and
# this many other likely endpoints.
HOSTING = 1
# Compiled passes must be this much faster than op-by-op ones to be used: the timing
# leaves out tracing, which every new tree shape and cache capacity pays once (10-20 ms
# on the demo models here, comparable to a short request's whole decode), and dynamic
# trees take many shapes (a 4-bit demo-sql bench ran compiled at 0.85x of plain decoding
# where op by op ran at 0.95x).
COMPILE_MARGIN = 0.25
# Tree sizes of the cold sequence on which compiled passes must also win (tracing included).
COLD_BUDGETS = (1, 2, 3, 4, 6, 8)
MAX_COST_AGE_S = 30 * 24 * 3600
LOADED = 0.5
# Early-exit pruning: passes per threshold before choosing, re-try period, EMA weight.
PRUNE_MIN_PASSES = 4
PRUNE_EXPLORE = 8
PRUNE_EMA = 0.1
# Fall back to plain decoding when the best arm's expected rate is below this (plain: 1).
FALLBACK_BELOW = 0.97
# Online costs: EMA weight of timed passes and plain tokens, samples before they replace
# the table, plain tokens per probe and tree passes between probes.
TIME_EMA = 0.1
TIME_MIN = 3
PLAIN_PROBE = 4
PLAIN_EVERY = 48
# Bump when the pass changes what it computes per sync: cached costs are then re-measured.
COST_VERSION = 8


def _model_key(model, streams, kind: str = "greedy", compiled: bool = False) -> str:
    a = model.args
    ident = [
        COST_VERSION,
        kind,
        a.model_type,
        a.hidden_size,
        a.num_hidden_layers,
        a.intermediate_size,
        a.vocab_size,
        a.num_attention_heads,
        a.num_key_value_heads,
        streams.num_streams,
        streams.config.stream_layers,
        str(mx.default_device()),
        blas_in_use(),
        str(model.model.norm.weight.dtype),
        "quantized" if "Quantized" in str(type(model.layers[0].mlp.down_proj)) else "float",
        "compiled" if compiled else "eager",
    ]
    return hashlib.sha1(json.dumps(ident).encode()).hexdigest()[:16]


def _synthetic_tree(budget: int, depth: int) -> Tree:
    # A dynamic tree shape of the given budget; tokens do not matter for cost.
    K = max(1, min(budget, 8))
    probs = np.sort(np.random.default_rng(0).dirichlet(np.ones(K), size=depth), axis=1)[:, ::-1]
    tokens = np.tile(np.arange(3, 3 + K), (depth, 1))
    return dynamic_tree(1, tokens, probs, budget)


def _load_per_core() -> float:
    try:
        return os.getloadavg()[0] / (os.cpu_count() or 1)
    except OSError:  # not available on this platform
        return 0.0


def _timed(fn, reps: int) -> float:
    fn()  # warm-up
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return float(np.min(ts))  # the least disturbed run: robust to other load


def _plain_step_seconds(model, cache, context: int, reps: int) -> float:
    def plain(n=8):
        # Pipelined like ar_steps: the next step is queued before the host reads a token.
        y = mx.argmax(model(mx.array([[5]]), cache=cache)[:, -1], axis=-1)
        mx.async_eval(y)
        for _ in range(n):
            nxt = mx.argmax(model(y.reshape(1, 1), cache=cache)[:, -1], axis=-1)
            mx.async_eval(nxt)
            y.item()
            y = nxt
        y.item()
        for c in cache:
            c.trim(c.offset - context)

    return _timed(plain, reps) / 9


def _pass_fn(forward: SSPass, cache, context: int, b: int, sampled: bool, hosting: int = 0):
    """One pass of budget ``b`` as ss_steps runs it: forward, its syncs, commit, next tree.
    ``hosting``: streams at the root and this many other nodes (0: every node)."""
    model, streams = forward.model, forward.streams
    depth = streams.num_streams
    tree = _synthetic_tree(b, depth)
    kind = SamplingParams(temperature=1.0 if sampled else 0.0)
    rng = np.random.default_rng(0)
    hosts = None
    if hosting:
        deepest = np.argsort(-tree_buffers(tree.parents).depths, kind="stable")[:hosting]
        hosts = np.unique(np.concatenate([[0], deepest]))

    def step():
        out = forward(tree, context, cache, num_streams=min(depth, b), hosts=hosts)
        if sampled:
            # Target probabilities, host-side rejection sampling, then the accepted node's streams.
            target = target_probs(out.main_logits, kind)
            mx.eval(target)
            np.array(target)
            cand = stream_candidates(stream_logits(model, out, 0), 8, kind)  # host slot 0
            mx.eval(*cand)
            top, ptop = np.array(cand[0]), np.array(cand[1])
            rng.choice(top.shape[1], size=2)
        else:
            am = mx.argmax(out.main_logits, axis=-1)
            node = greedy_accepted_node(out.tree.tokens, out.buffers, am)
            cand = stream_candidates(stream_logits(model, out, node), 8, kind)
            mx.eval(am, node, *cand[:2])
            top, ptop = np.array(cand[0]), np.array(cand[1])
        for c in cache:
            c.commit([0, len(tree) - 1] if len(tree) > 2 else [0])
        dynamic_tree(1, top, ptop, b)
        for c in cache:
            c.trim(c.offset - context)

    return step


def measure_step_costs(
    model,
    streams,
    context: int = 128,
    reps: int = 7,
    budgets=CANDIDATE_BUDGETS,
    sampled: bool = False,
    hosting: int = 0,
    compiled: bool = False,
) -> Dict[int, float]:
    """Cost of one ss pass with ``b`` draft nodes relative to one plain step
    (``hosting``: streams at the root and this many other nodes; 0 every node;
    ``compiled``: passes as :class:`SSPass` runs them, else op by op)."""
    forward = SSPass(model, streams, compiled)
    cache = make_cache(model)
    model(mx.array([[1] * context]), cache=cache)
    mx.eval([c.keys for c in cache])
    base = _plain_step_seconds(model, cache, context, reps)
    costs = {0: 1.0}
    for b in budgets:
        if hosting and b <= hosting:
            continue  # every node hosts anyway
        costs[b] = _timed(_pass_fn(forward, cache, context, b, sampled, hosting), reps) / base
    return costs


def _fresh(entry, now: float, load_now: float) -> bool:
    """A cached cost entry is usable: recent, and not taken under load the machine no longer has."""
    if not isinstance(entry, dict) or "costs" not in entry or "host_costs" not in entry:
        return False
    if now - entry.get("measured_at", 0) > MAX_COST_AGE_S:
        return False
    return not (entry.get("load", 0.0) > LOADED and load_now <= LOADED)


def choose_blas_threads(model, streams, context: int = 128, reps: int = 5, log=None) -> Optional[int]:
    """The BLAS thread count that decodes fastest here (the count in place before is
    restored); None when the BLAS has no thread control (Accelerate, a GPU) or runs one
    thread anyway.

    Speculative passes multiply a few rows by each weight matrix, where extra BLAS threads
    can cost more in synchronisation than they save (more so on a loaded machine), so
    each candidate count is timed on a plain step and on a hosted budget-4 pass; the
    count with the smaller geometric mean of the two wins."""
    default = blas_max_threads()
    if default is None or default <= 1:
        return None
    cache = make_cache(model)
    model(mx.array([[1] * context]), cache=cache)
    mx.eval([c.keys for c in cache])
    forward = SSPass(model, streams)
    times = {}
    for n in sorted({1, default}):
        with using_blas_threads(n):
            plain = _plain_step_seconds(model, cache, context, reps)
            spec = _timed(_pass_fn(forward, cache, context, 4, False, HOSTING), reps)
        times[n] = (plain * spec) ** 0.5
    best = min(times, key=times.get)
    if log:
        log(
            f"BLAS threads: {best} (of {default}; "
            + ", ".join(f"{n}: {t * 1e3:.2f} ms" for n, t in times.items())
            + ")"
        )
    return best


def _read_table() -> dict:
    path = cost_cache_file()
    if path.exists():
        try:
            return json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            pass
    return {}


def _write_table(table: dict) -> None:
    try:
        path = cost_cache_file()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(table, indent=1))
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only home only costs a re-measurement next time


def _cold_sequence_seconds(model, streams, compiled: bool, cache, context: int, rounds: int = 3) -> float:
    """Wall time of passes over several tree sizes, starting from a fresh :class:`SSPass`:
    what decoding with dynamic trees sees, tracing of each new shape included."""
    forward = SSPass(model, streams, compiled)
    fns = [_pass_fn(forward, cache, context, b, False, HOSTING) for b in COLD_BUDGETS]
    t = time.perf_counter()
    for _ in range(rounds):
        for fn in fns:
            fn()
    return time.perf_counter() - t


def choose_compiled(model, streams, context: int = 128, reps: int = 5, log=None) -> bool:
    """Whether compiled passes (:class:`SSPass`) are faster here than op-by-op ones.

    What compiling saves is per-operation overhead (graph building, dispatch, unfused
    element-wise kernels), which depends on the device and the model's size; so both
    are timed on a hosted budget-4 pass, interleaved twice, and compiling must win by
    ``COMPILE_MARGIN`` (the op-by-op pass is the simpler path). It must also win on a
    cold sequence of passes over several tree sizes, since every new shape is traced
    once and dynamic trees take many."""
    cache = make_cache(model)
    model(mx.array([[1] * context]), cache=cache)
    mx.eval([c.keys for c in cache])
    fns = {c: _pass_fn(SSPass(model, streams, c), cache, context, 4, False, HOSTING) for c in (False, True)}
    times = {False: [], True: []}
    for _ in range(2):
        for c, fn in fns.items():
            times[c].append(_timed(fn, reps))
    eager, compiled = min(times[False]), min(times[True])
    cold = {c: _cold_sequence_seconds(model, streams, c, cache, context) for c in (False, True)}
    choice = compiled < eager * (1 - COMPILE_MARGIN) and cold[True] < cold[False]
    if log:
        kind = "compiled" if choice else "op by op"
        log(
            f"speculative pass: {kind} (compiled {compiled * 1e3:.2f} ms, op by op {eager * 1e3:.2f} ms; "
            f"cold sequence {cold[True] * 1e3:.0f} vs {cold[False] * 1e3:.0f} ms)"
        )
    return choice


def _machine_choices(model, streams, table: dict, now: float, load_now: float, log, compiled: Optional[bool]):
    """(BLAS thread count, compiled passes) for this model on this machine (one per model,
    shared by greedy and sampled decoding; speculative decoding runs with that count):
    from the cache when fresh, else measured and stored. ``compiled`` not None is a
    choice already made (``SPECSTREAM_COMPILE``), not measured."""
    key = _model_key(model, streams, kind="machine")
    entry = table.get(key)
    fresh = isinstance(entry, dict) and _fresh(dict(entry, costs={}, host_costs={}), now, load_now)
    if fresh and (compiled is None or "compiled" in entry):
        return entry.get("threads"), entry.get("compiled", False) if compiled is None else compiled
    threads = choose_blas_threads(model, streams, log=log)
    with using_blas_threads(threads):
        measured = choose_compiled(model, streams, log=log) if compiled is None else None
    table[key] = {"threads": threads, "measured_at": now, "load": max(load_now, _load_per_core())}
    if measured is not None:
        table[key]["compiled"] = measured
    return threads, measured if compiled is None else compiled


def load_or_measure_costs(
    model, streams, log=None, sampled: bool = False, compiled: Optional[bool] = None
) -> "tuple[Dict[int, float], Dict[int, float], bool]":
    """(costs with streams at every node, costs with the hosting policy, compiled passes,
    BLAS threads), from the on-disk cache when fresh (and measured with this BLAS thread
    count and pass kind), else measured now. ``compiled`` None lets the measurement choose."""
    kind = "sampled" if sampled else "greedy"
    table = _read_table()
    now, load_now = time.time(), _load_per_core()
    threads, compiled = _machine_choices(model, streams, table, now, load_now, log, compiled)
    key = _model_key(model, streams, kind=kind, compiled=compiled)
    entry = table.get(key)
    if _fresh(entry, now, load_now) and entry.get("blas_threads") == threads:
        costs = {int(k): v for k, v in entry["costs"].items()}
        return costs, {int(k): v for k, v in entry["host_costs"].items()}, compiled, threads
    if log:
        log(f"measuring {kind} draft-tree step costs on this machine (cached per model)...")
    with using_blas_threads(threads):
        costs = measure_step_costs(model, streams, sampled=sampled, compiled=compiled)
        host_costs = measure_step_costs(model, streams, sampled=sampled, hosting=HOSTING, compiled=compiled)
    table[key] = {
        "costs": costs,
        "host_costs": host_costs,
        "measured_at": now,
        "load": max(load_now, _load_per_core()),
        "blas_threads": threads,
    }
    _write_table(table)
    return costs, host_costs, compiled, threads


def auto_tree_for(model, streams, log=None, sampled: bool = False, compiled: Optional[bool] = None) -> "AutoTree":
    """A fresh :class:`AutoTree` with this machine's step costs for ``model``
    (measured once, then read from the on-disk cache). The caller keeps it
    (:class:`~specstream_mlx.runtime.engine.SpeculativeModel` does, per
    decoding kind) so acceptance statistics carry over between requests.
    Each generation starts with :meth:`AutoTree.new_request`."""
    costs, host_costs, compiled, threads = load_or_measure_costs(model, streams, log, sampled, compiled)
    return AutoTree(costs, depth=streams.num_streams, host_costs=host_costs, compiled=compiled, blas_threads=threads)


@dataclass
class AutoTree:
    """Online choice of the dynamic-tree budget and hosting policy from step costs and acceptance.

    Arms are (budget, hosting): hosting 0 puts streams at every node, hosting
    ``HOSTING`` at the root and that many likely endpoints only (cheaper top
    layers; when the accepted node hosted none, the next draft comes from a
    hosting ancestor's later streams and is shallower). Acceptance of a hosting
    mode is calibrated against the honest per-budget evidence ``S_b``: the
    accepted tokens of passes whose draft came from that mode, over the ``S_b``
    of the budget then in use."""

    costs: Dict[int, float]
    depth: int
    budget: int = 8
    steps: float = 0
    predicted: float = 0.0
    actual: float = 0.0
    # Per budget: summed expected accepted length, and the passes that could judge it.
    scores_sum: Dict[int, float] = field(default_factory=dict)
    scores_n: Dict[int, float] = field(default_factory=dict)
    # After a fall-back, this many requests decode plainly before trees are
    # re-tried (doubling while re-tries keep failing, up to MAX_BACKOFF).
    backoff: int = 0
    skip: int = 0
    passes: int = 0
    host_costs: Dict[int, float] = field(default_factory=dict)
    hosting: int = 0
    # Per hosting mode: accepted tokens and the S_b they are compared with, and passes.
    mode_actual: Dict[int, float] = field(default_factory=dict)
    mode_ref: Dict[int, float] = field(default_factory=dict)
    mode_n: Dict[int, float] = field(default_factory=dict)
    # Early-exit pruning (greedy): the thresholds to choose between, and per threshold the
    # measured seconds per decided token of its passes (exponential moving average).
    prune_levels: tuple = (0.0,)
    prune_cost: Dict[float, float] = field(default_factory=dict)
    prune_n: Dict[float, int] = field(default_factory=dict)
    prune_passes: int = 0
    # Passes run compiled (measured faster on this machine, or asked for).
    compiled: bool = False
    # Online costs: per arm (budget, hosting) the wall seconds per tree pass, and the wall
    # seconds per plain token (EMAs), with their sample counts; tree passes since a probe.
    pass_seconds: Dict[tuple, float] = field(default_factory=dict)
    pass_timed: Dict[tuple, int] = field(default_factory=dict)
    plain_seconds: float = 0.0
    plain_timed: int = 0
    since_probe: int = 0
    # The BLAS thread count speculative decoding runs with (measured), or None: as set.
    blas_threads: Optional[int] = None

    def __post_init__(self):
        # Start on an arm the tuner has a cost for (the largest budget up to the default),
        # so the passes of the warm-up are booked to an arm it can choose.
        budgets = sorted(b for b in self.costs if b > 0)
        if budgets and self.budget not in budgets:
            self.budget = max([b for b in budgets if b <= self.budget] or budgets[:1])

    def for_client(self) -> "AutoTree":
        """A tuner for another client: this one's machine facts (step costs, the compiled
        choice, and the pass timings, shared so every client's measurements feed them),
        none of its acceptance evidence or back-off."""
        return AutoTree(
            costs=self.costs,
            depth=self.depth,
            host_costs=self.host_costs,
            compiled=self.compiled,
            blas_threads=self.blas_threads,
            prune_levels=self.prune_levels,
            pass_seconds=self.pass_seconds,
            pass_timed=self.pass_timed,
            plain_seconds=self.plain_seconds,
            plain_timed=self.plain_timed,
        )

    def spec(self) -> TreeSpec:
        return TreeSpec("dynamic", budget=self.budget, depth=self.depth, hosts=self.hosting)

    def tree_depth(self, budget: int) -> int:
        """The deepest level a dynamic tree of ``budget`` nodes can reach."""
        return min(self.depth, budget)

    def next_pass(self) -> "tuple[int, int]":
        """(streams to host, hosting mode) of the next pass: what the current arm
        needs, and on every EXPLORE_EVERY-th pass all γ streams at every node, so
        deeper budgets and the full-hosting mode keep getting honest evidence."""
        self.passes += 1
        if self.passes % EXPLORE_EVERY == 0:
            return self.depth, 0
        return self.tree_depth(self.budget), self.hosting

    def set_pruning_levels(self, levels) -> None:
        """Thresholds auto chooses between (e.g. 0 and the calibrated one); evidence of
        levels no longer offered is dropped."""
        levels = tuple(sorted(set(float(x) for x in levels)))
        if levels != self.prune_levels:
            self.prune_levels = levels
            self.prune_cost = {k: v for k, v in self.prune_cost.items() if k in levels}
            self.prune_n = {k: v for k, v in self.prune_n.items() if k in levels}

    def pruning_threshold(self) -> float:
        """The pruning threshold of the next pass: each level for PRUNE_MIN_PASSES passes,
        then the one with the lowest measured seconds per decided token, the other
        re-tried every PRUNE_EXPLORE-th pass (costs drift with load and budget)."""
        levels = self.prune_levels
        if len(levels) == 1:
            return levels[0]
        self.prune_passes += 1
        for level in levels:
            if self.prune_n.get(level, 0) < PRUNE_MIN_PASSES:
                return level
        best = min(levels, key=lambda k: self.prune_cost[k])
        if self.prune_passes % PRUNE_EXPLORE == 0:
            others = [k for k in levels if k != best]
            return others[(self.prune_passes // PRUNE_EXPLORE) % len(others)]
        return best

    def observe_pruning(self, level: float, seconds: float, tokens: int) -> None:
        """A pass at ``level`` took ``seconds`` (forward to verdict) and decided ``tokens``."""
        if level not in self.prune_levels or tokens < 1:
            return
        per_token = seconds / tokens
        n = self.prune_n.get(level, 0)
        old = self.prune_cost.get(level, per_token)
        self.prune_cost[level] = per_token if n == 0 else old + PRUNE_EMA * (per_token - old)
        self.prune_n[level] = n + 1

    def observe_pass_seconds(self, budget: int, hosting: int, seconds: float) -> None:
        """A tree pass of arm (``budget``, ``hosting``) took ``seconds`` of wall time,
        from its start to the start of the next pass (the consumer's work included)."""
        key = (budget, hosting)
        n = self.pass_timed.get(key, 0)
        old = self.pass_seconds.get(key, seconds)
        self.pass_seconds[key] = seconds if n == 0 else old + TIME_EMA * (seconds - old)
        self.pass_timed[key] = n + 1
        self.since_probe += 1

    def observe_plain_seconds(self, seconds: float) -> None:
        """A plain token took ``seconds`` of wall time, timed like a tree pass."""
        n = self.plain_timed
        self.plain_seconds = seconds if n == 0 else self.plain_seconds + TIME_EMA * (seconds - self.plain_seconds)
        self.plain_timed = n + 1

    def plain_probe_due(self) -> bool:
        """Whether to decode a few plain tokens now, to time them: once trees have been
        timed and plain tokens not yet, then every PLAIN_EVERY timed tree passes."""
        due = self.since_probe >= (PLAIN_EVERY if self.plain_timed >= TIME_MIN else TIME_MIN)
        if due:
            self.since_probe = 0
        return due

    def _online_cost(self, budget: int, hosting: int) -> Optional[float]:
        if self.plain_timed < TIME_MIN or self.pass_timed.get((budget, hosting), 0) < TIME_MIN:
            return None
        return self.pass_seconds[(budget, hosting)] / self.plain_seconds

    def _table_scale(self) -> float:
        """How the timed arms' online costs compare with their table costs (geometric mean; 1
        without timings): the correction for arms not timed yet."""
        ratios = []
        for b, h in self.pass_timed:
            c = self._online_cost(b, h)
            ref = (self.host_costs if h else self.costs).get(b)
            if c is not None and ref:
                ratios.append(np.log(c / ref))
        return float(np.exp(np.mean(ratios))) if ratios else 1.0

    def cost(self, budget: int, hosting: int = 0, scale: Optional[float] = None) -> float:
        """Cost of one pass of the arm in plain tokens: timed online when it has been,
        else the offline table's times ``scale`` (default :meth:`_table_scale`)."""
        online = self._online_cost(budget, hosting)
        if online is not None:
            return online
        table = (self.host_costs if hosting else self.costs).get(budget, 1.0)
        return table * (self._table_scale() if scale is None else scale)

    def new_request(self) -> bool:
        """Halve the evidence at each new generation: averages are unchanged,
        recent requests weigh more, and after a fall-back to plain decoding the
        evidence eventually drops below the warm-up length, so trees get
        re-tried instead of being ruled out for the life of the process.
        Returns False when this request should decode plainly (back-off)."""
        self.steps /= 2
        self.predicted /= 2
        self.actual /= 2
        for d in (self.scores_sum, self.scores_n, self.mode_actual, self.mode_ref, self.mode_n):
            for k in d:
                d[k] /= 2
        if self.skip > 0:
            self.skip -= 1
            return False
        return True

    def note_fallback(self) -> None:
        """A request fell back to plain decoding: skip trees for the next requests."""
        self.backoff = min(max(1, 2 * self.backoff), MAX_BACKOFF)
        self.skip = self.backoff

    def observe(
        self,
        predicted_at_budget: float,
        accepted: int,
        path_scores: Optional[List[float]],
        candidate_depth: Optional[int] = None,
        hosting: int = 0,
        budget: Optional[int] = None,
    ) -> None:
        """Record one pass: what the chosen tree predicted, what was accepted,
        and the path scores of the drafted candidates, which were
        ``candidate_depth`` streams deep (default all γ). Only budgets whose
        trees are no deeper than that are credited. ``hosting`` is the mode of
        the pass the draft came from, ``budget`` the draft's budget."""
        self.steps += 1
        self.predicted += predicted_at_budget
        self.actual += accepted
        ref = self._mean_scores(budget if budget is not None else self.budget)
        if ref is not None:
            self.mode_actual[hosting] = self.mode_actual.get(hosting, 0.0) + accepted
            self.mode_ref[hosting] = self.mode_ref.get(hosting, 0.0) + ref
            self.mode_n[hosting] = self.mode_n.get(hosting, 0.0) + 1
        if path_scores is None:
            return
        depth = self.depth if candidate_depth is None else candidate_depth
        s = np.cumsum(sorted(path_scores, reverse=True))
        for b in self.costs:
            if b > 0 and self.tree_depth(b) <= depth:
                self.scores_sum[b] = self.scores_sum.get(b, 0.0) + (float(s[min(b, len(s)) - 1]) if len(s) else 0.0)
                self.scores_n[b] = self.scores_n.get(b, 0.0) + 1

    def _mean_scores(self, budget: int) -> Optional[float]:
        n = self.scores_n.get(budget, 0.0)
        return self.scores_sum.get(budget, 0.0) / n if n > 0 else None

    def _calibration(self, hosting: int = 0) -> float:
        """Accepted per expected token: for a hosting mode once it has evidence,
        else the overall calibration (an untried mode is assumed to lose nothing,
        so it gets tried; its evidence then corrects the assumption)."""
        if self.mode_n.get(hosting, 0.0) >= WARMUP_STEPS / 2 and self.mode_ref.get(hosting, 0.0) > 0:
            return self.mode_actual[hosting] / self.mode_ref[hosting]
        return self.actual / self.predicted if self.predicted > 0 else 0.0

    def expected_accepted(self, budget: int, hosting: int = 0) -> Optional[float]:
        """Calibrated expected accepted tokens per pass at ``budget``; None without evidence."""
        mean = self._mean_scores(budget)
        return None if mean is None else self._calibration(hosting) * mean

    def arms(self):
        """(budget, hosting mode, cost) of every arm with a measured cost."""
        scale = self._table_scale()  # once per choice, not per arm
        for b in self.costs:
            if b > 0:
                yield b, 0, self.cost(b, 0, scale)
        for b in self.host_costs:
            if b > 0:
                yield b, HOSTING, self.cost(b, HOSTING, scale)

    def choose(self) -> Optional[int]:
        """Best budget (and hosting mode), or None for plain decoding; keeps the
        current arm during warm-up."""
        if self.steps < WARMUP_STEPS or not self.scores_sum:
            return self.budget
        best, best_rate = None, 0.0
        for b, h, cost in self.arms():
            e = self.expected_accepted(b, h)
            if e is None:
                continue
            rate = (1.0 + e) / cost
            if rate > best_rate:
                best, best_rate = (b, h), rate
        # Plain decoding scores 1 token per unit cost; it takes over only when the best
        # arm is clearly below that, since estimates near break-even move from pass to pass.
        if best is None or best_rate < FALLBACK_BELOW:
            return None
        self.budget, self.hosting = best
        if best_rate >= 1.0:
            self.backoff = 0
        return self.budget

    def expected_speedup(self, budget: int, hosting: int = 0) -> float:
        e = self.expected_accepted(budget, hosting)
        return (1.0 + (e or 0.0)) / self.cost(budget, hosting)
