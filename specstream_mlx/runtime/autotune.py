"""``--tree auto``: pick the draft-tree size that is fastest on this machine.

Two measurements combine:

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

Expected tokens/s of budget b ∝ (1 + c·E_b) / cost(b); plain decoding scores
1. When no budget beats plain decoding after a warm-up, decoding switches to
plain ``ar`` on the same cache and the stats say so.
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

from ..method.acceptance import greedy_accepted_node
from ..method.msa import ss_forward, stream_logits
from ..method.tree import Tree, TreeSpec, dynamic_tree
from ..platform_info import blas_in_use
from .cache import make_cache
from .drafting import stream_candidates
from .sampling import SamplingParams, target_probs

CANDIDATE_BUDGETS = (2, 4, 8, 12, 16, 24)
CACHE_FILE = Path(os.environ.get("SPECSTREAM_CACHE_DIR", Path.home() / ".cache" / "specstream-mlx")) / "step_costs.json"
WARMUP_STEPS = 6
MAX_BACKOFF = 16
EXPLORE_EVERY = 4
MAX_COST_AGE_S = 30 * 24 * 3600
LOADED = 0.5
# Bump when the pass changes what it computes per sync: cached costs are then re-measured.
COST_VERSION = 3


def _model_key(model, streams, sampled: bool = False) -> str:
    a = model.args
    ident = [
        COST_VERSION,
        "sampled" if sampled else "greedy",
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


def _pass_fn(model, streams, cache, context: int, b: int, sampled: bool):
    """One pass of budget ``b`` as ss_steps runs it: forward, its syncs, commit, next tree."""
    depth = streams.num_streams
    tree = _synthetic_tree(b, depth)
    kind = SamplingParams(temperature=1.0 if sampled else 0.0)
    rng = np.random.default_rng(0)

    def step():
        out = ss_forward(model, streams, tree, context, cache, num_streams=min(depth, b))
        if sampled:
            # Target probabilities, host-side rejection sampling, then the accepted node's streams.
            target = target_probs(out.main_logits, kind)
            mx.eval(target)
            np.array(target)
            cand = stream_candidates(stream_logits(model, out, 0), 8, kind)
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
    model, streams, context: int = 128, reps: int = 7, budgets=CANDIDATE_BUDGETS, sampled: bool = False
) -> Dict[int, float]:
    """Cost of one ss pass with ``b`` draft nodes relative to one plain step."""
    cache = make_cache(model)
    model(mx.array([[1] * context]), cache=cache)
    mx.eval([c.keys for c in cache])
    base = _plain_step_seconds(model, cache, context, reps)
    costs = {0: 1.0}
    for b in budgets:
        costs[b] = _timed(_pass_fn(model, streams, cache, context, b, sampled), reps) / base
    return costs


def _fresh(entry, now: float, load_now: float) -> bool:
    """A cached cost entry is usable: recent, and not taken under load the machine no longer has."""
    if not isinstance(entry, dict) or "costs" not in entry:
        return False
    if now - entry.get("measured_at", 0) > MAX_COST_AGE_S:
        return False
    return not (entry.get("load", 0.0) > LOADED and load_now <= LOADED)


def load_or_measure_costs(model, streams, log=None, sampled: bool = False) -> Dict[int, float]:
    key = _model_key(model, streams, sampled)
    table = {}
    if CACHE_FILE.exists():
        try:
            table = json.loads(CACHE_FILE.read_text())
        except (OSError, json.JSONDecodeError):
            table = {}
    now, load_now = time.time(), _load_per_core()
    entry = table.get(key)
    if _fresh(entry, now, load_now):
        return {int(k): v for k, v in entry["costs"].items()}
    if log:
        kind = "sampled" if sampled else "greedy"
        log(f"measuring {kind} draft-tree step costs on this machine (cached per model)...")
    costs = measure_step_costs(model, streams, sampled=sampled)
    table[key] = {"costs": costs, "measured_at": now, "load": max(load_now, _load_per_core())}
    try:
        CACHE_FILE.parent.mkdir(parents=True, exist_ok=True)
        tmp = CACHE_FILE.with_suffix(".tmp")
        tmp.write_text(json.dumps(table, indent=1))
        os.replace(tmp, CACHE_FILE)
    except OSError:
        pass  # a read-only home only costs a re-measurement next time
    return costs


def auto_tree_for(model, streams, log=None, sampled: bool = False) -> "AutoTree":
    """A fresh :class:`AutoTree` with this machine's step costs for ``model``
    (measured once, then read from the on-disk cache). The caller keeps it
    (:class:`~specstream_mlx.runtime.engine.SpeculativeModel` does, per
    decoding kind) so acceptance statistics carry over between requests.
    Each generation starts with :meth:`AutoTree.new_request`."""
    return AutoTree(load_or_measure_costs(model, streams, log, sampled), depth=streams.num_streams)


@dataclass
class AutoTree:
    """Online choice of the dynamic-tree budget from step costs and acceptance."""

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

    def spec(self) -> TreeSpec:
        return TreeSpec("dynamic", budget=self.budget, depth=self.depth)

    def tree_depth(self, budget: int) -> int:
        """The deepest level a dynamic tree of ``budget`` nodes can reach."""
        return min(self.depth, budget)

    def hosted_depth(self) -> int:
        """Streams the next pass hosts: what the current tree can use, and all
        γ on every EXPLORE_EVERY-th pass so deeper budgets get honest evidence."""
        self.passes += 1
        if self.passes % EXPLORE_EVERY == 0:
            return self.depth
        return self.tree_depth(self.budget)

    def new_request(self) -> bool:
        """Halve the evidence at each new generation: averages are unchanged,
        recent requests weigh more, and after a fall-back to plain decoding the
        evidence eventually drops below the warm-up length, so trees get
        re-tried instead of being ruled out for the life of the process.
        Returns False when this request should decode plainly (back-off)."""
        self.steps /= 2
        self.predicted /= 2
        self.actual /= 2
        self.scores_sum = {b: v / 2 for b, v in self.scores_sum.items()}
        self.scores_n = {b: v / 2 for b, v in self.scores_n.items()}
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
    ) -> None:
        """Record one pass: what the chosen tree predicted, what was accepted,
        and the path scores of the drafted candidates, which were
        ``candidate_depth`` streams deep (default all γ). Only budgets whose
        trees are no deeper than that are credited."""
        self.steps += 1
        self.predicted += predicted_at_budget
        self.actual += accepted
        if path_scores is None:
            return
        depth = self.depth if candidate_depth is None else candidate_depth
        s = np.cumsum(sorted(path_scores, reverse=True))
        for b in self.costs:
            if b > 0 and self.tree_depth(b) <= depth:
                self.scores_sum[b] = self.scores_sum.get(b, 0.0) + (float(s[min(b, len(s)) - 1]) if len(s) else 0.0)
                self.scores_n[b] = self.scores_n.get(b, 0.0) + 1

    def _calibration(self) -> float:
        return self.actual / self.predicted if self.predicted > 0 else 0.0

    def expected_accepted(self, budget: int) -> Optional[float]:
        """Calibrated expected accepted tokens per pass at ``budget``; None without evidence."""
        n = self.scores_n.get(budget, 0.0)
        if n <= 0:
            return None
        return self._calibration() * self.scores_sum.get(budget, 0.0) / n

    def choose(self) -> Optional[int]:
        """Best budget, or None for plain decoding; keeps the current one during warm-up."""
        if self.steps < WARMUP_STEPS or not self.scores_sum:
            return self.budget
        best, best_rate = None, 1.0  # plain decoding: 1 token per unit cost
        for b, cost in self.costs.items():
            e = self.expected_accepted(b) if b > 0 else None
            if e is None:
                continue
            rate = (1.0 + e) / cost
            if rate > best_rate:
                best, best_rate = b, rate
        if best is not None:
            self.budget = best
            self.backoff = 0
        return best

    def expected_speedup(self, budget: int) -> float:
        e = self.expected_accepted(budget)
        return (1.0 + (e or 0.0)) / self.costs.get(budget, 1.0)
