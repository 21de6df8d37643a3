"""``--tree auto``: pick the draft-tree size that is fastest on this machine.

Two measurements combine:

* **Step cost** (once per model, device and BLAS; cached on disk): the time of
  one ``ss`` pass over a tree of ``b`` draft nodes divided by one plain step,
  for a few budgets ``b``.
* **Acceptance** (online, every pass): for a dynamic tree the expected
  accepted length of budget ``b`` is the sum of the ``b`` highest path scores
  (products of stream probabilities); a running calibration factor (actual
  accepted / predicted) corrects for over- or under-confident streams.

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
from .sampling import SamplingParams

CANDIDATE_BUDGETS = (2, 4, 8, 12, 16, 24)
CACHE_FILE = Path(os.environ.get("SPECSTREAM_CACHE_DIR", Path.home() / ".cache" / "specstream-mlx")) / "step_costs.json"
WARMUP_STEPS = 6
MAX_BACKOFF = 16
# Bump when the pass changes what it computes per sync: cached costs are then re-measured.
COST_VERSION = 2


def _model_key(model, streams) -> str:
    a = model.args
    ident = [
        COST_VERSION,
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


def measure_step_costs(
    model, streams, context: int = 128, reps: int = 7, budgets=CANDIDATE_BUDGETS
) -> Dict[int, float]:
    """Cost of one ss pass with ``b`` draft nodes relative to one plain step."""
    GREEDY = SamplingParams()

    def timed(fn):
        fn()  # warm-up
        ts = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
        return float(np.min(ts))  # the least disturbed run: robust to other load

    cache = make_cache(model)
    model(mx.array([[1] * context]), cache=cache)
    mx.eval([c.keys for c in cache])

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

    base = timed(plain) / 9
    costs = {0: 1.0}
    depth = streams.num_streams
    for b in budgets:
        tree = _synthetic_tree(b, depth)

        def step(tree=tree, b=b):
            # What one greedy pass evaluates in its single sync (see ss_steps).
            out = ss_forward(model, streams, tree, context, cache, num_streams=min(depth, b))
            am = mx.argmax(out.main_logits, axis=-1)
            node = greedy_accepted_node(out.tree.tokens, out.buffers, am)
            cand = stream_candidates(stream_logits(model, out, node), 8, GREEDY)
            mx.eval(am, node, *cand[:2])
            # Host work of a pass: commit a short path, build the next tree.
            for c in cache:
                c.commit([0, len(tree) - 1] if len(tree) > 2 else [0])
            dynamic_tree(1, np.array(cand[0]), np.array(cand[1]), b)
            for c in cache:
                c.trim(c.offset - context)

        costs[b] = timed(step) / base
    return costs


def load_or_measure_costs(model, streams, log=None) -> Dict[int, float]:
    key = _model_key(model, streams)
    table = {}
    if CACHE_FILE.exists():
        try:
            table = json.loads(CACHE_FILE.read_text())
        except (OSError, json.JSONDecodeError):
            table = {}
    if key in table:
        return {int(k): v for k, v in table[key].items()}
    if log:
        log("measuring draft-tree step costs on this machine (once per model)...")
    costs = measure_step_costs(model, streams)
    table[key] = costs
    try:
        CACHE_FILE.parent.mkdir(parents=True, exist_ok=True)
        tmp = CACHE_FILE.with_suffix(".tmp")
        tmp.write_text(json.dumps(table, indent=1))
        os.replace(tmp, CACHE_FILE)
    except OSError:
        pass  # a read-only home only costs a re-measurement next time
    return costs


def auto_tree_for(model, streams, log=None) -> "AutoTree":
    """A fresh :class:`AutoTree` with this machine's step costs for ``model``
    (measured once, then read from the on-disk cache). The caller keeps it
    (:class:`~specstream_mlx.runtime.engine.SpeculativeModel` does, per
    decoding kind) so acceptance statistics carry over between requests.
    Each generation starts with :meth:`AutoTree.new_request`."""
    return AutoTree(load_or_measure_costs(model, streams, log), depth=streams.num_streams)


@dataclass
class AutoTree:
    """Online choice of the dynamic-tree budget from step costs and acceptance."""

    costs: Dict[int, float]
    depth: int
    budget: int = 8
    steps: float = 0
    predicted: float = 0.0
    actual: float = 0.0
    scores_sum: Dict[int, float] = field(default_factory=dict)
    # After a fall-back, this many requests decode plainly before trees are
    # re-tried (doubling while re-tries keep failing, up to MAX_BACKOFF).
    backoff: int = 0
    skip: int = 0

    def spec(self) -> TreeSpec:
        return TreeSpec("dynamic", budget=self.budget, depth=self.depth)

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
        if self.skip > 0:
            self.skip -= 1
            return False
        return True

    def note_fallback(self) -> None:
        """A request fell back to plain decoding: skip trees for the next requests."""
        self.backoff = min(max(1, 2 * self.backoff), MAX_BACKOFF)
        self.skip = self.backoff

    def observe(self, predicted_at_budget: float, accepted: int, path_scores: Optional[List[float]]) -> None:
        """Record one pass: what the chosen tree predicted, what was accepted,
        and the sorted path scores of the drafted candidates (for other budgets)."""
        self.steps += 1
        self.predicted += predicted_at_budget
        self.actual += accepted
        if path_scores is not None:
            s = np.cumsum(sorted(path_scores, reverse=True))
            for b in self.costs:
                if b > 0:
                    self.scores_sum[b] = self.scores_sum.get(b, 0.0) + (float(s[min(b, len(s)) - 1]) if len(s) else 0.0)

    def choose(self) -> Optional[int]:
        """Best budget, or None for plain decoding; keeps the current one during warm-up."""
        if self.steps < WARMUP_STEPS or not self.scores_sum:
            return self.budget
        calib = self.actual / self.predicted if self.predicted > 0 else 0.0
        best, best_rate = None, 1.0  # plain decoding: 1 token per unit cost
        for b, cost in self.costs.items():
            if b == 0:
                continue
            e = calib * self.scores_sum.get(b, 0.0) / self.steps
            rate = (1.0 + e) / cost
            if rate > best_rate:
                best, best_rate = b, rate
        if best is not None:
            self.budget = best
            self.backoff = 0
        return best

    def expected_speedup(self, budget: int) -> float:
        calib = self.actual / self.predicted if self.predicted > 0 else 0.0
        e = calib * self.scores_sum.get(budget, 0.0) / max(self.steps, 1)
        return (1.0 + e) / self.costs.get(budget, 1.0)
