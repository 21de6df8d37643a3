"""Decoding policies: what the next speculative pass drafts, hosts and prunes.

The engine (:mod:`.speculative`) asks its policy (:class:`DecodingPolicy`) for a plan
before every step — a :class:`TreePass`, a :class:`Probe` of timed plain tokens, or
:class:`Plain` to the end — and tells it what a pass or a plain token took
(``observe_pass``, ``observe_plain``). A fixed tree is the trivial policy
(:class:`FixedPolicy`); ``--tree auto`` is :class:`AutoPolicy`, which picks an
*arm* — a dynamic-tree budget ``b`` and a hosting mode (streams at every node, or at
the root and ``HOSTING`` likely endpoints) — by expected tokens per unit time,
(1 + E_b) / cost(b), plain decoding scoring 1. What it knows comes from the generations
it runs, from the acceptance measured with the streams, and from one timing of bare passes
per machine and model (:func:`~.step_costs.calibrate`, stored) before its first pass.

* **Costs** (:class:`~.step_costs.PassCosts`, a machine fact shared by every client of a model): the
  wall time of each tree pass, from its start to the start of the next (the consumer's
  work included), per arm, over the wall time of a plain token timed the same way on
  short plain *probes* (``PLAIN_PROBE`` tokens every ``PLAIN_EVERY`` passes; lossless
  like any plain step). Arms not yet timed take the costs an earlier process stored,
  scaled by what the timed arms show, or else a line through the timed (or stored) arms
  (``PRIOR`` where there are none). Costs are stored when a generation ends.
* **Acceptance** (:class:`Acceptance`, per client): the expected accepted length of
  budget ``b`` is the sum of the ``b`` highest path scores (products of stream
  probabilities), times a running calibration (accepted / predicted), per hosting mode
  once that mode has evidence. Every ``EXPLORE_EVERY``-th pass hosts all γ streams at
  every node, so deeper budgets are judged on candidate lists as deep as they need.
* **Pruning** (greedy, with the model's calibrated threshold): passes with and without
  early-exit pruning are timed per decided token and the cheaper is used
  (:class:`Alternatives`).
* **Prior** (:class:`~.acceptance_prior.AcceptancePrior`, stored with the streams): before
  a client's first pass, each arm's accepted length is the measured one and its cost the
  stored or prior cost. When no arm is predicted to pay, the request decodes plainly
  from its first token and no pass is explored; trees are first tried after the
  back-off below, as after a fall-back. Otherwise the first pass uses the best arm, and
  plain tokens are first timed at the periodic probe rather than after ``TIME_MIN``
  passes (on a short request those early probes cost more than the trees gain).
* **Fall-back**: when, after a warm-up, the best arm is expected clearly slower than plain
  decoding (below ``FALLBACK_BELOW``: estimates near break-even move from pass to pass),
  the rest of the request decodes plainly, and so do that client's next 1, 2, 4, …
  (≤ ``MAX_BACKOFF``) requests, so trees are re-tried rather than ruled out for good. A
  best arm far below break-even (under ``HOPELESS_BELOW``: its acceptance would have to
  grow by a quarter to pay) is re-tried only after the longest back-off: each re-try
  costs a request at that rate (demo-sql's trees at about half of plain decoding).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional, Protocol, Union

import numpy as np

from ..method.tree import LOOKUP_LEN, TreeSpec
from .acceptance_prior import AcceptancePrior
from .drafting import NO_STREAMS, Draft, Forecast, num_candidates
from .step_costs import TIME_MIN, Arm, PassCosts, calibrate, model_key

CANDIDATE_BUDGETS = (2, 4, 8, 12, 16, 24)
HOSTING = 1
START: Arm = (4, HOSTING)  # cheap to run while nothing is known; evidence moves it
# Greedy: passes that host no streams and verify an n-gram continuation alone (prompt
# lookup's draft, up to LOOKUP_LEN tokens), scored by the continuations' measured hit rates.
LOOKUP_ARM: Arm = (LOOKUP_LEN, NO_STREAMS)
LOOKUP_EXPLORE_EVERY = 16  # on the lookup arm, every 16th pass hosts all streams (their evidence)
CHAIN_EMA = 0.1
# Greedy plain decoding replays the lookup arm's passes over its tokens as they come (what
# they would have accepted) and switches to that arm once WATCH_PASSES replayed passes of
# the request say it pays.
WATCH_PASSES = 4
WARMUP_STEPS = 6
EXPLORE_EVERY = 4
MAX_BACKOFF = 16
FALLBACK_BELOW = 0.97
HOPELESS_BELOW = 0.8
# Plain tokens per probe, tree passes between probes.
PLAIN_PROBE = 4
PLAIN_EVERY = 48
# Alternatives (pruning levels): picks of each before choosing, re-try period, EMA weight.
ALT_MIN = 4
ALT_EXPLORE = 8
ALT_EMA = 0.1
BACKOFF_REASON = "plain decoding: draft trees did not pay off on recent requests (re-tried later)"
PRIOR_REASON = "plain decoding: the streams' measured acceptance predicts no draft tree pays here"


@dataclass(frozen=True)
class TreePass:
    """A speculative pass: verify the current draft and draft ``next_tree`` from its streams.

    Attributes:
        next_tree: the tree this pass's streams draft (the next pass verifies it).
        streams_per_host: streams each hosting node carries in this pass.
        hosting: this pass's hosting mode: 0 hosts streams at every node; m at the root
            and the m likeliest endpoints.
        threshold: early-exit pruning threshold of this pass.
        label: the tree in the step's stats (``dynamic:8``, ``auto:dynamic:4@1``).
        candidates: top-K tokens per stream kept for drafting.
        score_budget: dynamic budgets up to this are scored on the same streams (0: none).
        compiled: the pass kind; None: the model's own setting.
    """

    next_tree: TreeSpec
    streams_per_host: int
    hosting: int
    threshold: float
    label: str
    candidates: int
    score_budget: int = 0
    compiled: Optional[bool] = None


@dataclass(frozen=True)
class Probe:
    """Instead of a pass: decode ``tokens`` timed plain tokens (the policy's plain-step cost)."""

    tokens: int
    label: str


@dataclass(frozen=True)
class Plain:
    """Instead of a pass: decode plainly to the end of the request, and why. ``watch``
    (greedy, with the lookup arm): replay lookup passes over the plain tokens and ask
    ``resume_passes`` whether to leave plain decoding for them."""

    reason: str
    label: str
    watch: bool = False


Plan = Union[TreePass, Probe, Plain]


class DecodingPolicy(Protocol):
    """What the decoding loop asks of a policy: the next step's plan, then what it cost.

    A fixed tree is the trivial policy (:class:`FixedPolicy`); ``--tree auto`` learns
    (:class:`AutoPolicy`)."""

    def plan(self) -> Plan: ...

    def observe_pass(self, plan: TreePass, draft: Draft, accepted: int, seconds: float) -> None: ...

    def observe_plain(self, seconds: float) -> None: ...

    def observe_lookup(self, expected: float) -> bool: ...

    def observe_replayed(self, accepted: int) -> None: ...

    def resume_passes(self) -> bool: ...

    def finish(self) -> None: ...


class FixedPolicy:
    """One tree shape for every pass; nothing is learned."""

    def __init__(self, spec: TreeSpec, threshold: float):
        self._pass = TreePass(spec, spec.max_depth, spec.hosting, threshold, spec.describe(), num_candidates(spec))

    def plan(self) -> Plan:
        return self._pass

    def observe_pass(self, plan: TreePass, draft: Draft, accepted: int, seconds: float) -> None:
        pass

    def observe_plain(self, seconds: float) -> None:
        pass

    def observe_lookup(self, expected: float) -> bool:
        return expected > 0

    def observe_replayed(self, accepted: int) -> None:
        pass

    def resume_passes(self) -> bool:
        return False

    def finish(self) -> None:
        pass


@dataclass
class Acceptance:
    """What a client's drafts predicted and what was accepted."""

    depth: int
    steps: float = 0.0
    predicted: float = 0.0
    actual: float = 0.0
    # Per budget: summed expected accepted length, and the passes that could judge it.
    scores_sum: Dict[int, float] = field(default_factory=dict)
    scores_n: Dict[int, float] = field(default_factory=dict)
    # Per hosting mode: accepted tokens of its drafts, the mean scores they are compared with, passes.
    mode_actual: Dict[int, float] = field(default_factory=dict)
    mode_ref: Dict[int, float] = field(default_factory=dict)
    mode_n: Dict[int, float] = field(default_factory=dict)

    def halve(self) -> None:
        """At each new request: averages unchanged, recent requests weigh more, and after a
        fall-back the evidence drops below the warm-up, so trees are re-tried."""
        self.steps, self.predicted, self.actual = self.steps / 2, self.predicted / 2, self.actual / 2
        for d in (self.scores_sum, self.scores_n, self.mode_actual, self.mode_ref, self.mode_n):
            for k in d:
                d[k] /= 2

    def observe(self, forecast: Forecast, accepted: int) -> None:
        """A verified draft's forecast: its prediction, what was accepted, and the path scores
        of its candidates, which credit only budgets whose trees are no deeper than they went."""
        self.steps += 1
        self.predicted += forecast.predicted
        self.actual += accepted
        ref = self.mean_scores(forecast.budget)
        if ref is not None:
            h = forecast.from_hosting
            self.mode_actual[h] = self.mode_actual.get(h, 0.0) + accepted
            self.mode_ref[h] = self.mode_ref.get(h, 0.0) + ref
            self.mode_n[h] = self.mode_n.get(h, 0.0) + 1
        if forecast.scores is None:
            return
        s = np.cumsum(sorted(forecast.scores, reverse=True))
        for b in CANDIDATE_BUDGETS:
            if min(self.depth, b) <= forecast.candidate_depth:
                self.scores_sum[b] = self.scores_sum.get(b, 0.0) + (float(s[min(b, len(s)) - 1]) if len(s) else 0.0)
                self.scores_n[b] = self.scores_n.get(b, 0.0) + 1

    def mean_scores(self, budget: int) -> Optional[float]:
        n = self.scores_n.get(budget, 0.0)
        return self.scores_sum.get(budget, 0.0) / n if n > 0 else None

    def expected(self, budget: int, hosting: int) -> Optional[float]:
        """Calibrated expected accepted tokens per pass; None without evidence. An untried
        hosting mode takes the overall calibration (assumed to lose nothing, so it gets tried)."""
        mean = self.mean_scores(budget)
        if mean is None:
            return None
        if self.mode_n.get(hosting, 0.0) >= WARMUP_STEPS / 2 and self.mode_ref.get(hosting, 0.0) > 0:
            return mean * self.mode_actual[hosting] / self.mode_ref[hosting]
        return mean * (self.actual / self.predicted if self.predicted > 0 else 0.0)


@dataclass
class Alternatives:
    """The cheapest of a few options by measured seconds per decided token: each is picked
    ``ALT_MIN`` times, then the best, another re-tried every ``ALT_EXPLORE``-th pick (costs
    drift with load and with the tree in use)."""

    options: tuple = (0.0,)
    cost: Dict[float, float] = field(default_factory=dict)
    n: Dict[float, int] = field(default_factory=dict)
    picks: int = 0

    def offer(self, options) -> None:
        """The options from now on; evidence of options no longer offered is dropped."""
        options = tuple(sorted(set(float(x) for x in options)))
        if options != self.options:
            self.options = options
            self.cost = {k: v for k, v in self.cost.items() if k in options}
            self.n = {k: v for k, v in self.n.items() if k in options}

    def pick(self) -> float:
        if len(self.options) == 1:
            return self.options[0]
        self.picks += 1
        for option in self.options:
            if self.n.get(option, 0) < ALT_MIN:
                return option
        best = min(self.options, key=lambda k: self.cost[k])
        if self.picks % ALT_EXPLORE == 0:
            others = [k for k in self.options if k != best]
            return others[(self.picks // ALT_EXPLORE) % len(others)]
        return best

    def record(self, option: float, seconds: float, tokens: int) -> None:
        if option not in self.options or tokens < 1:
            return
        per_token, n = seconds / tokens, self.n.get(option, 0)
        old = self.cost.get(option, per_token)
        self.cost[option] = old + ALT_EMA * (per_token - old) if n else per_token
        self.n[option] = n + 1


@dataclass
class AutoPolicy:
    """``--tree auto`` for one client: shared :class:`PassCosts`, its own acceptance
    evidence, pruning timings and back-off."""

    costs: PassCosts
    depth: int
    compiled: bool = False
    budget: int = START[0]
    hosting: int = START[1]
    evidence: Acceptance = None
    pruning: Alternatives = field(default_factory=Alternatives)
    backoff: int = 0
    skip: int = 0
    passes: int = 0
    since_probe: int = 0
    pending: Optional[str] = None  # set: the rest of this request decodes plainly (why)
    prior: Optional[AcceptancePrior] = None
    prior_consulted: bool = False  # the prior decides a client's first request only
    # Greedy: the prior also picks the first arm. Sampled: it is an upper bound only
    # (sampled drafts are accepted less often than greedy ones), so it can only say plain.
    prior_picks_arm: bool = True
    # Greedy: lookup-only passes (LOOKUP_ARM) compete with the stream arms. On that arm a
    # continuation is verified only where it is expected to pay for its pass
    # (:meth:`chain_pays`); elsewhere a plain step decides the token. ``chain``: EMA per step
    # of the expected accepted tokens of the continuations that would be verified (the
    # summed path scores; 0 where there is none or it would not pay), ``chain_share``: EMA
    # of how many steps would verify one; both observed after every pass.
    # ``lookup_passes``: the arm's steps timed; ``watched`` / ``watched_accepted``: this
    # request's replayed lookup passes over plain tokens and what they accepted, ``watched_last``
    # what the last of them accepted. ``hits``: EMA of what verified continuations accepted
    # (the arm's own passes and replayed ones), ``hits_n`` how many (halved at each request,
    # as the evidence is): the arm is rated only from WATCH_PASSES of them on.
    lookup_arm: bool = True
    chain: Optional[float] = None
    chain_share: Optional[float] = None
    hits: Optional[float] = None
    hits_n: int = 0
    lookup_passes: float = 0.0
    watched: int = 0
    watched_accepted: int = 0
    watched_last: int = 0

    def __post_init__(self):
        if self.evidence is None:
            self.evidence = Acceptance(self.depth)

    candidates = 8  # top-K per stream: enough for every budget scored (dynamic trees use ≤ 8)
    score_budget = max(CANDIDATE_BUDGETS)

    def for_client(self) -> "AutoPolicy":
        """A policy for another client over the same machine facts (costs, pass kind)."""
        return AutoPolicy(
            self.costs,
            self.depth,
            self.compiled,
            pruning=Alternatives(self.pruning.options),
            prior=self.prior,
            prior_picks_arm=self.prior_picks_arm,
            lookup_arm=self.lookup_arm,
        )

    def spec(self) -> TreeSpec:
        # Lookup branches ride along (docs/DESIGN.md decision 28): greedy, they replace only
        # stream nodes their measured hit rate outscores, in a pass of the same shape.
        hosting = max(self.hosting, 0)  # the lookup arm's exploring passes host at every node
        return TreeSpec("dynamic", budget=self.budget, depth=self.depth, hosting=hosting, lookup=LOOKUP_LEN)

    def stream_arms(self):
        """Every (budget, hosting mode) whose passes host streams."""
        return [(b, h) for b in CANDIDATE_BUDGETS for h in (0, HOSTING) if not (h and b <= h)]

    def arms(self):
        """Every arm the policy chooses between: the stream arms, and the lookup arm (greedy)."""
        return self.stream_arms() + ([LOOKUP_ARM] if self.lookup_arm else [])

    def rate(self, arm: Arm, cost: Optional[float] = None) -> Optional[float]:
        """Expected tokens per plain-token time of ``arm`` (plain decoding: 1)."""
        e = self.lookup_expected() if arm == LOOKUP_ARM else self.evidence.expected(*arm)
        if e is None:
            return None
        cost = self.costs.cost(arm) if cost is None else cost
        if arm == LOOKUP_ARM:  # its steps without a continuation worth verifying are plain steps
            cost = 1.0 + (1.0 if self.chain_share is None else self.chain_share) * (cost - 1.0)
        return (1.0 + e) / cost

    def lookup_expected(self) -> Optional[float]:
        """Tokens a step of the lookup arm is expected to get accepted (None: not yet known):
        what verified continuations accepted (the arm's own passes, or lookup passes replayed
        over plain tokens), once WATCH_PASSES of them were seen, times the share of steps that
        verify one. The continuations' path scores alone do not choose the arm: they start
        from a uniform prior on the n-gram hit rates, which promises about a token for every
        continuation before the request has judged any."""
        if self.hits_n < WATCH_PASSES or self.chain_share is None:
            return None
        return self.chain_share * self.hits

    def prior_rates(self) -> Dict[Arm, float]:
        """Predicted tokens per plain-token time of the stream arms the prior measured, from
        it alone (how often a request's text repeats, which the lookup arm needs, is not known
        before it). The prior was measured with streams at every node; an arm hosting them at
        a few nodes drafts some trees from an ancestor's shifted streams and accepts less
        (SmolLM2: τ 1.62 at ``dynamic:8@1`` against 1.69 at ``dynamic:8``), so its cheaper
        pass with the prior's acceptance would promise a gain the arm does not make."""
        costs = self.costs.table([arm for arm in self.stream_arms() if arm[1] == 0])
        return {arm: (1.0 + self.prior.expected(arm[0])) / c for arm, c in costs.items()}

    def new_request(self, pruning_levels=(0.0,)) -> None:
        self.evidence.halve()
        self.lookup_passes /= 2
        self.hits_n //= 2
        self.watched = self.watched_accepted = self.watched_last = 0
        self.pruning.offer(pruning_levels)
        self.pending = None
        if self.skip > 0:
            self.skip -= 1
            self.pending = BACKOFF_REASON
        elif self.prior is not None and not self.prior_consulted and self.evidence.steps == 0:
            self.prior_consulted = True
            rates = self.prior_rates()
            best = max(rates, key=rates.get)
            # Trees are tried only where one is predicted to pay by more than FALLBACK_BELOW's
            # band: that band keeps measured estimates from flapping, and a first request must
            # not pay to explore a gain smaller than its own estimate's noise (SmolLM2's demo on
            # an empty cost store: a prediction just over 1.0x warmed up on trees and decoded
            # at 0.94x of ar; predictions of 0.84-0.98x decoded plainly).
            if rates[best] < 1.0 / FALLBACK_BELOW:
                # As if trees had been tried and failed: re-tried after the back-off.
                self.pending = f"{PRIOR_REASON} (best {rates[best]:.2f}x)"
                self._back_off(1, rates[best])
            elif self.prior_picks_arm:
                self.budget, self.hosting = best

    def plan(self) -> Plan:
        spec = self.spec()
        lookup = self.hosting == NO_STREAMS
        label = "auto:lookup" if lookup else "auto:" + spec.describe()
        if self.pending is not None:
            return Plain(self.pending, label, watch=self.lookup_arm)
        # Without a prior, plain tokens are timed early (after TIME_MIN passes), since every
        # choice divides by them; with one, its costs stand in until the periodic probe, so
        # a short first request is not spent on probes.
        early = self.costs.plain_n < TIME_MIN and self.prior is None
        if self.since_probe >= (TIME_MIN if early else PLAIN_EVERY):
            self.since_probe = 0
            return Probe(PLAIN_PROBE, label)
        self.passes += 1
        if lookup:  # no stream rows; now and then all streams at every node, for their evidence
            if self.passes % LOOKUP_EXPLORE_EVERY == 0:
                return self._tree_pass(spec, self.depth, 0, label)
            return TreePass(spec, 0, NO_STREAMS, 0.0, label, self.candidates, self.score_budget, self.compiled)
        if self.passes % EXPLORE_EVERY == 0:  # all streams at every node: honest deep evidence
            return self._tree_pass(spec, self.depth, 0, label)
        return self._tree_pass(spec, min(self.depth, self.budget), self.hosting, label)

    def _tree_pass(self, spec: TreeSpec, streams: int, hosting: int, label: str) -> TreePass:
        threshold = self.pruning.pick()
        return TreePass(spec, streams, hosting, threshold, label, self.candidates, self.score_budget, self.compiled)

    def observe_pass(self, plan: TreePass, draft: Draft, accepted: int, seconds: float) -> None:
        """A pass over ``draft`` accepted ``accepted`` tokens in ``seconds`` of wall time;
        booked to the arm that drafted it (its exploring passes included). A lookup pass over
        a continuation is booked to the lookup arm, a step of that arm without one (a plain
        step) to plain tokens; passes between the two kinds are booked to neither."""
        lookup_pass = plan.hosting == NO_STREAMS
        if draft.forecast.from_hosting == NO_STREAMS:
            if lookup_pass:
                if len(draft.tree) > 1:
                    self.costs.observe_pass(LOOKUP_ARM, seconds)
                    self._verified(accepted)
                else:
                    self.costs.observe_plain(seconds)
                self.since_probe += 1
                self.lookup_passes += 1
                if self.lookup_passes >= WARMUP_STEPS:
                    self._choose()
            return
        if len(draft.tree) <= 1:
            return  # a root-only pass after a probe or the prompt: no arm's
        if not lookup_pass:
            self.costs.observe_pass((draft.forecast.budget, plan.next_tree.hosting), seconds)
            self.pruning.record(plan.threshold, seconds, accepted + 1)
        self.since_probe += 1
        self.evidence.observe(draft.forecast, accepted)
        if self.evidence.steps >= WARMUP_STEPS:
            self._choose()

    def observe_plain(self, seconds: float) -> None:
        self.costs.observe_plain(seconds)

    def chain_pays(self, expected: float) -> bool:
        """Whether verifying a continuation expected to get ``expected`` tokens accepted is
        worth its lookup pass against a plain step: 1 + expected tokens for its cost."""
        return expected > 0 and 1.0 + expected >= self.costs.cost(LOOKUP_ARM)

    def observe_lookup(self, expected: float, verified: Optional[bool] = None) -> bool:
        """A lookup pass's expected accepted tokens from here (the summed path scores of the
        continuation the next draft can use; 0 without one); ``verified``: whether the lookup
        arm would verify it (default: :meth:`chain_pays`). Returns that."""
        ran = self.chain_pays(expected) if verified is None else verified
        self.chain = _ema(self.chain, expected if ran else 0.0)
        self.chain_share = _ema(self.chain_share, float(ran))
        return ran

    def observe_replayed(self, accepted: int) -> None:
        """What a replayed lookup pass over plainly decoded tokens accepted (counted as a
        verified continuation at every replayed pass: the replay does not gate them)."""
        self.watched += 1
        self.watched_accepted += accepted
        self.watched_last = accepted
        self._verified(accepted)
        self.observe_lookup(float(accepted), verified=True)

    def _verified(self, accepted: int) -> None:
        """A verified continuation (a lookup pass, run or replayed) accepted ``accepted``."""
        self.hits = _ema(self.hits, accepted)
        self.hits_n += 1

    def resume_passes(self) -> bool:
        """Asked during watched plain decoding after a replayed pass: True (and the arm is
        the lookup arm from now on) once this request's replayed passes say it pays and the
        last of them accepted a token: the text copies now. (Copied spans come in runs; a
        chat reply that once repeated a few words of its prompt ran lookup passes afterwards
        that accepted nothing, and decoded at 0.93x of ar.)"""
        n = self.watched
        if self.pending is None or n < WATCH_PASSES or self.watched_last == 0:
            return False
        if (1.0 + self.watched_accepted / n) / self.costs.cost(LOOKUP_ARM) < 1.0 / FALLBACK_BELOW:
            return False
        self.pending = None
        self.budget, self.hosting = LOOKUP_ARM
        self.lookup_passes = 0
        self.watched = self.watched_accepted = self.watched_last = 0  # a later fall-back in this request watches afresh
        return True

    def finish(self) -> None:
        """The request ended: store the costs, and judge a short request's trees now.

        A reply of a few passes ends before the warm-up: without a verdict, the next request
        would try trees again (on demo-sql's 13-token replies, three requests in a row
        after each back-off). With half the warm-up's evidence the choice is made here, so a
        back-off is set (or not) for the next request."""
        self.costs.save()
        if self.pending is None and WARMUP_STEPS / 2 <= self.evidence.steps < WARMUP_STEPS:
            self._choose()

    def _choose(self) -> None:
        costs = self.costs.table(self.arms())
        rates = {arm: r for arm, c in costs.items() if (r := self.rate(arm, c)) is not None}
        if rates.get(LOOKUP_ARM, 0.0) < 1.0 / FALLBACK_BELOW:
            # At best plain steps with a lookup now and then: plain decoding (pipelined, and
            # watching for the arm) is as good; the arm is re-entered as resume_passes says.
            rates.pop(LOOKUP_ARM, None)
        best = max(rates, key=rates.get, default=None)
        if best is None or rates[best] < FALLBACK_BELOW:
            shown = f"best {rates[best]:.2f}x" if best else "no evidence"
            self.pending = f"plain decoding: no draft tree is expected to be faster on this machine ({shown})"
            self._back_off(min(max(1, 2 * self.backoff), MAX_BACKOFF), rates[best] if best else None)
            return
        self.budget, self.hosting = best
        if rates[best] >= 1.0:
            self.backoff = 0

    def _back_off(self, requests: int, best_rate: Optional[float]) -> None:
        """Plain decoding for the next ``requests`` requests; for the longest back-off when
        the best arm's expected rate is far below break-even (a re-try then only costs)."""
        hopeless = best_rate is not None and best_rate < HOPELESS_BELOW
        self.backoff = MAX_BACKOFF if hopeless else requests
        self.skip = self.backoff


def _ema(old: Optional[float], new: float) -> float:
    return new if old is None else old + CHAIN_EMA * (new - old)


def auto_policy_for(model, streams, sampled: bool, compiled: bool, log=None) -> AutoPolicy:
    """A new :class:`AutoPolicy` for ``model`` with the costs stored for it on this machine.
    The caller keeps it (:class:`~specstream_mlx.runtime.loaded_model.SpeculativeModel` does,
    per decoding kind), so what it learns carries over between requests."""
    costs = PassCosts.load(model_key(model, streams, "sampled" if sampled else "greedy", compiled))
    if not costs.stored:
        if log:
            log("--tree auto: timing tree passes for this model on this machine (once; stored in the user cache)")
        extra = () if sampled else (LOOKUP_ARM,)
        timed = calibrate(model, streams, sampled, compiled, (0, HOSTING), extra)
        costs.save(timed.costs, timed.plain_seconds)
    prior = AcceptancePrior.from_extra(streams.config.extra)
    return AutoPolicy(
        costs, streams.num_streams, compiled, prior=prior, prior_picks_arm=not sampled, lookup_arm=not sampled
    )
