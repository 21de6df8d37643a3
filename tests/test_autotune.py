"""--tree auto: the arm follows timed costs and observed acceptance; nothing is measured
before the first token; what it learns about costs outlives the process."""

import json

import numpy as np
import pytest

import specstream_mlx.runtime.autotune as A
import specstream_mlx.runtime.step_costs as C
from specstream_mlx.method.tree import Tree
from specstream_mlx.runtime.autotune import WARMUP_STEPS, AutoPolicy
from specstream_mlx.runtime.drafting import Candidates, Draft, Forecast
from specstream_mlx.runtime.offline_costs import ArmCosts
from specstream_mlx.runtime.step_costs import PassCosts


def costs_of(by_budget, hosted=None, other=100.0):
    """Stored costs for every arm: ``by_budget`` at full hosting, ``hosted`` (default the
    same) at HOSTING, ``other`` for budgets not given (so they never win)."""
    hosted = by_budget if hosted is None else hosted
    stored = {}
    for b in A.CANDIDATE_BUDGETS:
        stored[(b, 0)] = by_budget.get(b, other)
        stored[(b, A.HOSTING)] = hosted.get(b, other)
    return PassCosts(stored=stored)


def draft(scores, budget, hosting=0, depth=4, predicted=None):
    """A verified draft as the engine records it (a two-node tree: an arm's pass)."""
    predicted = sum(scores[:budget]) if predicted is None else predicted
    return Draft(Tree((1, 2), (-1, 0)), forecast=Forecast(predicted, list(scores), depth, budget, hosting))


def observe_many(auto, n, accepted, scores):
    for _ in range(n):
        auto.evidence.observe(draft(scores, auto.budget, auto.hosting).forecast, accepted)


def _reason(plan):
    """Why a plan decodes plainly to the end (None: it does not)."""
    return plan.reason if isinstance(plan, A.Plain) else None


def choose(auto):
    """The arm after the evidence so far (None: plain decoding from here on)."""
    auto._choose()
    return None if auto.pending else auto.budget


def count_calls(monkeypatch, cls, counts, kind):
    """Count ``cls.__call__`` calls in ``counts[kind]`` (the call itself unchanged)."""
    real = cls.__call__
    counts.setdefault(kind, 0)

    def counted(self, *a, **k):
        counts[kind] += 1
        return real(self, *a, **k)

    monkeypatch.setattr(cls, "__call__", counted)


def pin_to_lookup_arm(auto, monkeypatch, verify):
    """``auto`` on the lookup arm for good, without a prior, verifying the continuations
    ``verify(expected)`` says."""
    auto.prior, (auto.budget, auto.hosting) = None, A.LOOKUP_ARM
    monkeypatch.setattr(auto, "_choose", lambda: None)
    monkeypatch.setattr(auto, "chain_pays", verify)


def test_choose_maximises_expected_rate():
    # Calibrated streams (accepted == predicted at budget 4): E_b = sum of the b best scores.
    scores = [0.9, 0.8, 0.7, 0.6, 0.1, 0.1, 0.1, 0.1]
    auto = AutoPolicy(costs_of({2: 1.5, 4: 1.8, 8: 4.0}), depth=4, budget=4, hosting=0)
    observe_many(auto, WARMUP_STEPS, accepted=3.0, scores=scores)
    # rates: b2 (1+1.7)/1.5=1.80, b4 (1+3.0)/1.8=2.22, b8 (1+3.4)/4=1.10
    assert choose(auto) == 4
    # Costs where every tree loses to plain decoding fall back, with the reason.
    slow = AutoPolicy(costs_of({2: 3.0, 4: 5.0}), depth=4, budget=4, hosting=0)
    observe_many(slow, WARMUP_STEPS, accepted=1.0, scores=scores)
    assert choose(slow) is None and "no draft tree is expected to be faster" in slow.pending
    assert _reason(slow.plan()) == slow.pending  # the engine decodes plainly from here on


def test_warm_up_keeps_the_arm_and_new_requests_halve_evidence():
    scores = [0.5, 0.4, 0.3, 0.2]
    auto = AutoPolicy(costs_of({2: 1.2, 4: 3.0}), depth=4, budget=4, hosting=0)
    passes = 0
    while passes < WARMUP_STEPS:
        plan = auto.plan()
        assert _reason(plan) is None, passes  # warming up: no choice yet
        if isinstance(plan, A.Probe):  # left untimed: the stored costs decide here
            continue
        auto.observe_pass(plan, draft(scores, 4), 0, 0.01)
        passes += 1
    assert auto.pending is not None  # nothing is ever accepted: plain decoding wins
    before = auto.rate((2, 0))
    auto.new_request()
    assert abs(auto.rate((2, 0)) - before) < 1e-12  # averages unchanged
    assert auto.evidence.steps < WARMUP_STEPS  # so the next request re-tries a tree ...
    assert _reason(auto.plan()) == A.BACKOFF_REASON  # ... after one request of back-off


def test_fallback_backs_off_exponentially_and_resets_on_success():
    auto = AutoPolicy(costs_of({2: 1.2}), depth=4, budget=2, hosting=0)
    scores = [0.0, 0.0]
    observe_many(auto, WARMUP_STEPS, accepted=0.0, scores=scores)
    assert choose(auto) is None and auto.backoff == 1

    def plain_requests(n):
        out = []
        for _ in range(n):
            auto.new_request()
            out.append(_reason(auto.plan()) is not None)
        return out

    assert plain_requests(2) == [True, False]  # skip 1, then re-try
    auto._choose()
    assert auto.backoff == 2 and plain_requests(3) == [True, True, False]  # skip 2
    # A tree that pays off again clears the back-off.
    observe_many(auto, 4 * WARMUP_STEPS, accepted=1.0, scores=[0.9, 0.9])
    assert choose(auto) == 2 and auto.backoff == 0


def test_a_best_arm_far_below_break_even_is_retried_only_after_the_longest_back_off():
    """demo-sql's trees ran at about half of plain decoding, and every back-off re-try of
    1, 2, 4, ... requests spent a request at that rate: 17 of 48 requests of one bench
    process ran trees. Far below break-even (HOPELESS_BELOW) the re-try waits MAX_BACKOFF
    requests; near it the back-off doubles as before."""
    for cost, backoff in ((2.0, A.MAX_BACKOFF), (1.2, 1)):  # best rate 0.5 and 0.83
        auto = AutoPolicy(costs_of({2: cost}), depth=4, budget=2, hosting=0)
        observe_many(auto, WARMUP_STEPS, accepted=0.0, scores=[0.0, 0.0])
        assert choose(auto) is None and auto.backoff == backoff
        plain = []
        for _ in range(backoff + 1):
            auto.new_request()
            plain.append(_reason(auto.plan()) is not None)
        assert plain == [True] * backoff + [False]


def test_deeper_budgets_are_judged_on_deep_candidates():
    """Stream top-1 probabilities .85/.80/.78/.75: budget 4 is worth .85 + .85·.8 +
    .85·.8·.78 + .85·.8·.78·.75 = 2.46 accepted tokens, whatever tree is in use."""
    from specstream_mlx.runtime.drafting import draft_tree
    from specstream_mlx.runtime.sampling import SamplingParams

    p1 = np.array([0.85, 0.80, 0.78, 0.75])
    top = np.array([[10 + g, 20 + g] for g in range(4)])
    ptop = np.stack([p1, 1 - p1], axis=1)
    want = 0.85 + 0.85 * 0.8 + 0.85 * 0.8 * 0.78 + 0.85 * 0.8 * 0.78 * 0.75
    auto = AutoPolicy(PassCosts(), depth=4, budget=2, hosting=0)
    spec = auto.spec()  # the current tree: budget 2, so 2 streams deep
    # A normal pass hosts only the 2 streams a 2-node tree can use: no evidence for budget 4.
    shallow = draft_tree(1, Candidates(top[:2], ptop[:2]), spec, SamplingParams(), score_budget=4)
    auto.evidence.observe(shallow.forecast, 2)
    assert auto.evidence.expected(4, 0) is None and auto.evidence.expected(2, 0) is not None
    # An exploration pass hosts all 4 streams: budget 4 is credited its full value.
    deep = draft_tree(1, Candidates(top, ptop), spec, SamplingParams(), score_budget=4)
    assert deep.forecast.candidate_depth == 4 and len(deep.tree) == 3  # the tree itself is unchanged
    auto.evidence.observe(deep.forecast, 2)
    auto.evidence.actual = auto.evidence.predicted  # calibrated streams
    assert abs(auto.evidence.expected(4, 0) - want) < 1e-9


def test_every_few_passes_host_all_streams_at_every_node():
    auto = AutoPolicy(PassCosts(), depth=4, budget=2, hosting=A.HOSTING)
    plans = [auto.plan() for _ in range(3 * A.EXPLORE_EVERY)]
    assert [(p.streams_per_host, p.hosting) for p in plans].count((4, 0)) == 3
    assert {(p.streams_per_host, p.hosting) for p in plans} == {(2, A.HOSTING), (4, 0)}
    assert all(p.next_tree.budget == 2 and p.next_tree.hosting == A.HOSTING for p in plans)  # the arm's own tree


def test_greedy_and_sampled_decoding_keep_separate_policies(monkeypatch):
    import specstream_mlx.runtime.loaded_model as engine
    from specstream_mlx.runtime.sampling import SamplingParams

    made = []

    def fake(model, streams, sampled, compiled, log=None):
        made.append(sampled)
        return AutoPolicy(PassCosts(), depth=4)

    monkeypatch.setattr(engine, "auto_policy_for", fake)
    sm = engine.SpeculativeModel(base=None, streams=None)
    g1, s1 = sm.tuner(SamplingParams()), sm.tuner(SamplingParams(temperature=0.7))
    assert g1 is not s1 and made == [False, True]
    assert sm.tuner(SamplingParams()) is g1 and sm.tuner(SamplingParams(temperature=1.0)) is s1


def test_one_clients_fallback_does_not_switch_another_to_plain_decoding(monkeypatch):
    """Back-off and acceptance evidence are per client (kept by the server); pass costs are a
    machine fact, shared."""
    import specstream_mlx.runtime.loaded_model as engine
    from specstream_mlx.runtime.sampling import SamplingParams
    from specstream_mlx.serve.client_policies import ClientPolicies

    made = []
    monkeypatch.setattr(
        engine, "auto_policy_for", lambda *a, **k: made.append(1) or AutoPolicy(costs_of({2: 1.2, 4: 1.5}), depth=4)
    )
    sm = engine.SpeculativeModel(base=None, streams=None)
    clients = ClientPolicies(sm, max_clients=8)
    greedy = SamplingParams()
    a, b = clients.get(greedy, "alice"), clients.get(greedy, "bob")
    assert a is not b and clients.get(greedy, "alice") is a and len(made) == 1
    assert a.costs is b.costs
    a.costs.observe_pass((4, 0), 0.5)
    assert b.costs.timed[(4, 0)] == 1  # one client's timing is a machine fact for all
    observe_many(a, WARMUP_STEPS, accepted=0.0, scores=[0.0, 0.0, 0.0, 0.0])
    a._choose()
    assert a.pending is not None and a.skip == 1
    a.new_request()
    assert _reason(a.plan()) is not None  # alice's next request decodes plainly ...
    b.new_request()
    sm.tuner(greedy).new_request()
    assert _reason(b.plan()) is None and _reason(sm.tuner(greedy).plan()) is None  # ... nobody else's
    assert not b.evidence.scores_sum  # acceptance evidence stays with its client
    assert clients.get(SamplingParams(temperature=0.7), "alice") is not a  # and per decoding kind
    for i in range(8 + 5):  # bounded: the least recently served go
        clients.get(greedy, i)
    assert len(clients) == 8 and ("greedy", "alice") not in clients


def test_hosting_policy_is_an_arm_judged_by_its_own_acceptance():
    """Hosting streams at fewer nodes is cheaper; it wins while it loses no
    acceptance, and loses once its drafts are accepted less (its calibration)."""
    scores = [0.9, 0.8, 0.7, 0.6]
    auto = AutoPolicy(costs_of({4: 2.0}, hosted={4: 1.5}), depth=4, budget=4, hosting=0)
    for _ in range(WARMUP_STEPS):
        auto.evidence.observe(draft(scores, 4, hosting=0).forecast, 3.0)
    assert choose(auto) == 4 and auto.hosting == A.HOSTING  # untried: assumed lossless, and cheaper
    for _ in range(WARMUP_STEPS):  # drafts from the cheaper mode are accepted far less
        auto.evidence.observe(draft(scores, 4, hosting=A.HOSTING).forecast, 0.5)
    assert choose(auto) == 4 and auto.hosting == 0
    assert auto.spec().hosting == 0


def test_costs_come_from_timed_passes_and_estimate_untimed_arms():
    """An arm's cost is its timed seconds per pass over the timed seconds per plain token
    (EMAs, once both have TIME_MIN samples). Untimed arms: stored costs scaled by what the
    timed arms showed; without stored costs, a line through the timed arms' costs."""
    costs = PassCosts(stored={(4, 0): 3.0, (8, 0): 4.5})
    for _ in range(A.TIME_MIN - 1):
        costs.observe_plain(0.010)
        costs.observe_pass((4, 0), 0.020)
    assert costs.measured((4, 0)) is None and costs.cost((4, 0)) == 3.0  # too few samples: stored
    costs.observe_pass((4, 0), 0.020)
    costs.observe_plain(0.010)
    assert abs(costs.cost((4, 0)) - 2.0) < 1e-9  # 20 ms per pass over 10 ms per plain token
    assert abs(costs.cost((8, 0)) - 4.5 * 2.0 / 3.0) < 1e-9  # stored, scaled like the timed arm
    # Not stored: a line through the timed arms of the same hosting mode (PRIOR's slope through one).
    assert abs(costs.cost((12, 0)) - (2.0 + C.PRIOR[1] * 8)) < 1e-9
    for _ in range(A.TIME_MIN):
        costs.observe_pass((8, 0), 0.030)
    assert abs(costs.cost((16, 0)) - (3.0 + 0.25 * 8)) < 1e-9  # slope (3 - 2) / (8 - 4)
    assert abs(costs.cost((16, A.HOSTING)) - costs.cost((16, 0))) < 1e-9  # the other mode's line
    assert abs(PassCosts().cost((8, 0)) - (C.PRIOR[0] + 8 * C.PRIOR[1])) < 1e-9  # nothing known yet
    for _ in range(40):  # timings follow the machine (an EMA)
        costs.observe_pass((4, 0), 0.040)
    assert costs.cost((4, 0)) > 3.5


def test_a_slow_first_pass_does_not_set_an_arms_cost():
    """The first pass of an arm in a process carries its warm-up (new shapes, fresh memory):
    SmolLM2's first lookup pass of a process took 50.8 ms against 31-37 for the next ones, an
    EMA that started from it stored 2.49 plain steps for an arm that costs 1.5-1.8, and a
    later process, trusting that cost, never resumed lookup passes on a reply that copied
    its prompt. Timings start from the median of their first TIME_MIN samples."""
    costs = PassCosts()
    for s in (0.0508, 0.0332, 0.0327, 0.0368):
        costs.observe_pass(A.LOOKUP_ARM, s)
    for s in (0.0239, 0.0324, 0.0312, 0.0224) + (0.0222,) * 40:
        costs.observe_plain(s)  # the first plain tokens after a prompt are slow too
    steady_pass = 0.0332 + C.TIME_EMA * (0.0368 - 0.0332)
    assert costs.cost(A.LOOKUP_ARM) == pytest.approx(steady_pass / 0.0222, rel=0.02)
    assert costs.cost(A.LOOKUP_ARM) < 1.6


def test_plain_probes_come_when_trees_are_timed_and_then_periodically():
    auto = AutoPolicy(PassCosts(), depth=4, budget=4, hosting=0)
    kinds = []
    for _ in range(2 * A.PLAIN_EVERY):
        plan = auto.plan()
        if isinstance(plan, A.Probe):
            kinds.append("probe")
            for _ in range(plan.tokens):
                auto.observe_plain(0.01)
        else:
            kinds.append("pass")
            auto.observe_pass(plan, draft([0.5, 0.4, 0.3, 0.2], 4), 1, 0.02)
    first = kinds.index("probe")
    assert first == A.TIME_MIN  # trees timed, plain tokens not yet: probe now
    assert kinds.index("probe", first + 1) == first + 1 + A.PLAIN_EVERY  # then every PLAIN_EVERY passes
    assert auto.costs.measured((4, 0)) == pytest.approx(2.0)


def test_trees_stay_through_estimates_near_break_even():
    """Plain decoding takes over only when the best arm is clearly slower (below
    FALLBACK_BELOW): near break-even, estimates move from pass to pass, and each fall-back
    costs the rest of the request and a back-off."""
    scores = [0.5, 0.5, 0.0, 0.0]  # E_2 = E_4 = 1.0 with calibrated streams
    for cost, keeps in ((2.0 / A.FALLBACK_BELOW - 0.01, True), (2.0 / A.FALLBACK_BELOW + 0.05, False)):
        auto = AutoPolicy(costs_of({2: cost, 4: cost + 1}), depth=4, budget=2, hosting=0, backoff=1)
        observe_many(auto, WARMUP_STEPS, accepted=1.0, scores=scores)
        assert (choose(auto) == 2) is keeps and auto.backoff in ((1,) if keeps else (2,))
    auto = AutoPolicy(costs_of({2: 1.5}), depth=4, budget=2, hosting=0, backoff=1)
    observe_many(auto, WARMUP_STEPS, accepted=1.0, scores=scores)
    assert choose(auto) == 2 and auto.backoff == 0  # (1 + 1) / 1.5 > 1


def test_alternatives_pick_the_cheaper_per_decided_token():
    """Each pruning level is tried, the cheaper one per decided token wins, the other is
    re-tried periodically, and the choice follows when the costs change."""
    alt = A.Alternatives()
    assert alt.pick() == 0.0  # one option until told otherwise
    alt.offer((0.0, 0.2))
    cost = {0.0: 2.0, 0.2: 1.0}  # seconds per pass; one token decided per pass

    def run(n):
        seen = []
        for _ in range(n):
            level = alt.pick()
            seen.append(level)
            alt.record(level, cost[level], 1)
        return seen

    assert sorted(set(run(2 * A.ALT_MIN))) == [0.0, 0.2]  # both measured before choosing
    later = run(4 * A.ALT_EXPLORE)
    assert later.count(0.2) > later.count(0.0) > 0  # the cheaper wins; the other is re-tried
    cost[0.0], cost[0.2] = 0.5, 3.0  # pruning became the expensive one
    run(20 * A.ALT_EXPLORE)
    assert run(4 * A.ALT_EXPLORE).count(0.0) > 2 * A.ALT_EXPLORE
    alt.offer((0.0,))
    assert alt.pick() == 0.0 and set(alt.cost) == {0.0}


def _auto_model(tiny_model_dir):
    from specstream_mlx import load
    from specstream_mlx.method.streams import StreamConfig, new_streams

    model, tok = load(str(tiny_model_dir), warn=False)
    model.streams = new_streams(model.base, StreamConfig(num_streams=2, stream_layers=1, lora_rank=2))
    return model, tok


def test_auto_is_readied_before_the_first_request(tiny_model_dir, tmp_path, monkeypatch):
    """Where a command or a server starts, ``prepare_auto`` times the passes ``--tree auto``
    needs (announced) for ss with ``auto`` only, of the kind asked; the first request then
    times nothing (its time to the first token is its own)."""
    from specstream_mlx.runtime.generation import stream_generate
    from specstream_mlx.runtime.sampling import SamplingParams
    from specstream_mlx.runtime.speculative import prepare_auto

    monkeypatch.setenv("SPECSTREAM_MLX_CACHE", str(tmp_path))
    model, tok = _auto_model(tiny_model_dir)
    said = []
    greedy = SamplingParams()
    prepare_auto(model, "ar", "auto", greedy, said.append)
    prepare_auto(model, "ss", "dynamic:4", greedy, said.append)
    prepare_auto(model.base, "ss", "auto", greedy, said.append)  # a bare model: no streams to ready
    assert model.tuners == {} and said == []
    prepare_auto(model, "ss", None, greedy, said.append)  # None: the default tree, auto
    assert set(model.tuners) == {"greedy"} and len(said) == 1 and "timing tree passes" in said[0]
    during = []
    for _ in stream_generate(model, tok, "the cat sat", max_tokens=6, mode="ss", tree="auto", log=during.append):
        pass
    assert during == [] and set(model.tuners) == {"greedy"}
    prepare_auto(model, "ss", "auto", SamplingParams(temperature=0.7), said.append)
    assert set(model.tuners) == {"greedy", "sampled"}


def test_pass_costs_are_timed_once_per_machine_and_model_before_the_first_pass(tiny_model_dir, tmp_path, monkeypatch):
    """With nothing stored, the first --tree auto policy times bare passes of each hosting
    mode against plain steps (the cost prior), stores them, and a later process reads them
    instead of timing again; before its first token the generation itself then runs exactly
    what a fixed tree runs (the prompt and one pass)."""
    import mlx.core as mx

    from specstream_mlx.runtime import step_costs
    from specstream_mlx.runtime.compiled_pass import SSPass
    from specstream_mlx.runtime.loaded_model import SpeculativeModel
    from specstream_mlx.runtime.sampling import SamplingParams
    from specstream_mlx.runtime.speculative import ss_steps

    monkeypatch.setenv("SPECSTREAM_MLX_CACHE", str(tmp_path))  # step_costs.json there
    model, _ = _auto_model(tiny_model_dir)
    timings = []
    real = step_costs.calibrate

    def counted(*a, **k):
        timings.append(real(*a, **k))
        return timings[-1]

    monkeypatch.setattr(A, "calibrate", counted)
    auto = model.tuner(SamplingParams())
    want = {(b, h) for b in step_costs.CALIBRATION_BUDGETS for h in (0, A.HOSTING) if not (h and b <= h)}
    want.add(A.LOOKUP_ARM)  # greedy: the lookup arm's chain pass too
    assert len(timings) == 1 and set(timings[0].costs) == want and all(c > 0 for c in timings[0].costs.values())
    assert auto.costs.stored == pytest.approx(timings[0].costs) and timings[0].plain_seconds > 0
    assert auto.costs.stored_plain == timings[0].plain_seconds
    again = SpeculativeModel(model.base, model.streams).tuner(SamplingParams())  # the next process
    assert len(timings) == 1 and again.costs.stored == pytest.approx(timings[0].costs)
    assert again.costs.stored_plain == pytest.approx(timings[0].plain_seconds)

    calls = {}
    count_calls(monkeypatch, type(model.base), calls, "base")
    count_calls(monkeypatch, SSPass, calls, "ss")
    seen = {}
    for tree in ("dynamic:4", "auto"):
        calls.update(base=0, ss=0)
        next(ss_steps(model, mx.array(list(range(3, 40))), SamplingParams(), tree=tree))
        seen[tree] = dict(calls)
    assert seen["auto"] == seen["dynamic:4"] and seen["auto"]["ss"] == 1, seen


def test_learned_costs_are_stored_when_a_generation_ends_and_read_by_the_next_process(
    tiny_model_dir, tmp_path, monkeypatch
):
    import json

    from specstream_mlx import generate
    from specstream_mlx.runtime.loaded_model import SpeculativeModel
    from specstream_mlx.runtime.sampling import SamplingParams

    monkeypatch.setenv("SPECSTREAM_MLX_CACHE", str(tmp_path))  # step_costs.json there
    monkeypatch.setattr(A, "PLAIN_EVERY", 4)
    model, tok = _auto_model(tiny_model_dir)
    generate(model, tok, "hello there", max_tokens=60, mode="ss", tree="auto")
    costs = model.tuner(SamplingParams()).costs
    learned = {a: costs.measured(a) for a in costs.timed if costs.measured(a) is not None}
    assert learned and (tmp_path / "step_costs.json").exists()
    fresh = SpeculativeModel(model.base, model.streams)  # what the next process starts with
    stored = fresh.tuner(SamplingParams()).costs.stored  # the calibration's arms, the learned ones replaced
    assert {a: stored[a] for a in learned} == pytest.approx(learned)
    key = costs.key
    (tmp_path / "step_costs.json").write_text("{not json")  # a damaged file is only a cold start
    assert PassCosts.load(key).stored == {}
    # ... and so are damaged entries, a bad arm or cost skipped alone
    for entry, want in (({"costs": [1, 2]}, {}), ({"costs": {"4,0": None, "x": 1, "8,1": 2.5}}, {(8, 1): 2.5})):
        (tmp_path / "step_costs.json").write_text(json.dumps({key: entry}))
        assert PassCosts.load(key).stored == want


def test_auto_with_a_calibrated_threshold_stays_exact(tiny_model_dir):
    """Greedy ss with --tree auto and the model's pruning threshold equals ar, and both
    pruning levels were offered and used."""
    from specstream_mlx import SamplingParams, generate

    model, tok = _auto_model(tiny_model_dir)
    model.streams.config.pruning_threshold = 0.05
    ar = generate(model, tok, "hello there", max_tokens=24, mode="ar").tokens
    ss = generate(model, tok, "hello there", max_tokens=24, mode="ss", tree="auto")
    assert ss.tokens == ar
    pruning = model.tuner(SamplingParams(), None).pruning
    assert pruning.options == (0.0, 0.05)
    # Both levels were used, the pruned one on passes that did prune.
    assert pruning.n.get(0.0, 0) > 0 and pruning.n.get(0.05, 0) > 0, pruning.n
    assert ss.stats.pruned_nodes > 0


def _with_prior(model, budgets):
    """``model`` with an acceptance prior stored in its stream config, as the build writes it."""
    model.streams.config.extra["acceptance"] = {"budgets": {str(b): e for b, e in budgets.items()}}
    return model


def test_no_tree_pass_runs_when_the_prior_says_plain(tiny_model_dir, tmp_path, monkeypatch):
    """With a measured acceptance that pays on no arm at the prior costs, a fresh process's
    first request decodes plainly from its first token: not one tree pass is explored.
    Trees are re-tried after the back-off, as after a fall-back."""
    import mlx.core as mx

    from specstream_mlx.runtime.compiled_pass import SSPass
    from specstream_mlx.runtime.sampling import SamplingParams
    from specstream_mlx.runtime.speculative import ss_steps

    monkeypatch.setenv("SPECSTREAM_MLX_CACHE", str(tmp_path))  # step_costs.json there
    monkeypatch.setattr(A, "calibrate", lambda *a, **k: ArmCosts())  # the generic prior costs
    model, _ = _auto_model(tiny_model_dir)
    # At the prior costs 1.2 + 0.15 b the best arm, b2, makes (1 + 0.3) / 1.5 = 0.87x: no pass.
    _with_prior(model, {b: 0.3 for b in A.CANDIDATE_BUDGETS})
    passes = {}
    count_calls(monkeypatch, SSPass, passes, "n")
    prompt = mx.array(list(range(3, 40)))

    def request(n=24):
        steps = []
        for step in ss_steps(model, prompt, SamplingParams(), tree="auto"):
            steps.append(step)
            if len(steps) == n:
                return steps

    first = request()
    assert passes["n"] == 0 and A.PRIOR_REASON in first[0].info.fallback
    assert all(len(s.tokens) == 1 for s in first)
    assert sum(bool(s.info.fallback) for s in first) == 1  # said once
    from specstream_mlx.runtime.steps import ar_steps

    want = [s.tokens[0] for s, _ in zip(ar_steps(model.base, prompt, SamplingParams()), range(24))]
    assert [s.tokens[0] for s in first] == want
    second = request()  # the back-off request: plain as well
    assert passes["n"] == 0 and second[0].info.fallback == A.BACKOFF_REASON
    request()  # the re-try explores trees
    assert passes["n"] > 0
    # Sampled decoding is gated by the same prior (an upper bound on its acceptance).
    tuner = model.tuner(SamplingParams(temperature=0.7))
    tuner.new_request()
    assert tuner.pending and A.PRIOR_REASON in tuner.pending
    # A prior far below break-even (0.70x at the generic prior costs) re-tries only after the
    # longest back-off. Its costs from an empty store: the re-try above stored what its pass
    # measured on this tiny model, timings a loaded machine can bring near one plain step.
    _with_prior(model, {b: 0.05 for b in A.CANDIDATE_BUDGETS})
    monkeypatch.setenv("SPECSTREAM_MLX_CACHE", str(tmp_path / "empty"))
    far = A.auto_policy_for(model.base, model.streams, sampled=False, compiled=False)
    far.new_request()
    assert A.PRIOR_REASON in far.pending and far.backoff == far.skip == A.MAX_BACKOFF


def test_a_prior_that_pays_starts_on_its_best_arm(tiny_model_dir, tmp_path, monkeypatch):
    from specstream_mlx.runtime.sampling import SamplingParams

    monkeypatch.setenv("SPECSTREAM_MLX_CACHE", str(tmp_path))  # step_costs.json there
    monkeypatch.setattr(A, "calibrate", lambda *a, **k: ArmCosts())  # the generic prior costs
    model, _ = _auto_model(tiny_model_dir)
    # At the prior costs 1.2 + 0.15 b: b2 (1+1.4)/1.5 = 1.6, b4 (1+2.6)/1.8 = 2.0, b8 (1+3)/2.4 = 1.67.
    _with_prior(model, {2: 1.4, 4: 2.6, 8: 3.0, 12: 3.0, 16: 3.0, 24: 3.0})
    auto = model.tuner(SamplingParams())
    auto.new_request()
    assert auto.pending is None and auto.budget == 4
    assert auto.prior_rates()[(4, 0)] == pytest.approx(3.6 / 1.8)
    # No early plain probes with a prior: a short first request is all tree passes.
    for _ in range(10):
        plan = auto.plan()
        assert isinstance(plan, A.TreePass)
        auto.observe_pass(plan, draft([0.9, 0.8, 0.7, 0.6], auto.budget, auto.hosting), 3, 0.01)
    # The sampled policy does not take its arm from the greedy prior.
    sampled = model.tuner(SamplingParams(temperature=0.7))
    sampled.new_request()
    assert sampled.pending is None and (sampled.budget, sampled.hosting) == A.START


def test_calibrated_costs_decide_the_first_request(tiny_model_dir, tmp_path, monkeypatch):
    """An acceptance that pays at the generic prior costs (b4: (1 + 2.6) / 1.8 = 2.0) but
    not at this machine's measured ones (passes of 4-5 plain steps, as on a 3M-parameter
    model here): the first request decodes plainly, no pass explored."""
    from specstream_mlx.runtime.sampling import SamplingParams

    monkeypatch.setenv("SPECSTREAM_MLX_CACHE", str(tmp_path))
    slow = {(2, 0): 4.0, (8, 0): 5.5, (2, 1): 3.8, (8, 1): 4.6}
    monkeypatch.setattr(A, "calibrate", lambda *a, **k: ArmCosts(dict(slow)))
    model, _ = _auto_model(tiny_model_dir)
    _with_prior(model, {2: 1.4, 4: 2.6, 8: 3.0, 12: 3.0, 16: 3.0, 24: 3.0})
    auto = model.tuner(SamplingParams())
    auto.new_request()
    assert auto.pending and A.PRIOR_REASON in auto.pending
    assert A.PRIOR_REASON in _reason(auto.plan())  # plain decoding, no pass


def test_the_prior_rates_only_the_arms_it_measured_and_explores_only_a_predicted_gain(
    tiny_model_dir, tmp_path, monkeypatch
):
    """The prior was measured with streams at every node: a cheaper pass hosting them at a
    few nodes is not rated with its acceptance (it would promise b4@1 (1 + 0.9) / 1.6 =
    1.19), and the best arm it measured, b4 at (1 + 0.9) / 1.95 = 0.97 (inside the band that
    keeps measured estimates from flapping), is no predicted gain: the first request decodes
    plainly, no pass explored."""
    from specstream_mlx.runtime.sampling import SamplingParams

    monkeypatch.setenv("SPECSTREAM_MLX_CACHE", str(tmp_path))
    costs = {(2, 0): 1.9, (4, 0): 1.95, (8, 0): 2.6, (2, 1): 1.55, (4, 1): 1.6, (8, 1): 1.7}
    monkeypatch.setattr(A, "calibrate", lambda *a, **k: ArmCosts(dict(costs)))
    model, _ = _auto_model(tiny_model_dir)
    _with_prior(model, {2: 0.8, 4: 0.9, 8: 1.0, 12: 1.0, 16: 1.0, 24: 1.0})
    auto = model.tuner(SamplingParams())
    auto.new_request()
    rates = auto.prior_rates()
    assert all(hosting == 0 for _, hosting in rates)
    assert A.FALLBACK_BELOW <= max(rates.values()) < 1.0
    assert auto.pending and A.PRIOR_REASON in auto.pending
    assert A.PRIOR_REASON in _reason(auto.plan())  # plain decoding, no pass
    # Just over break-even (b4 at (1 + 0.9) / 1.87 = 1.016) is inside the same band: a gain
    # smaller than the estimate's noise is not worth a first request's exploration.
    monkeypatch.setenv("SPECSTREAM_MLX_CACHE", str(tmp_path / "near"))  # an empty cost store
    monkeypatch.setattr(A, "calibrate", lambda *a, **k: ArmCosts({**costs, (4, 0): 1.87}))
    near, _ = _auto_model(tiny_model_dir)
    _with_prior(near, {2: 0.8, 4: 0.9, 8: 1.0, 12: 1.0, 16: 1.0, 24: 1.0})
    auto = near.tuner(SamplingParams())
    auto.new_request()
    assert 1.0 < max(auto.prior_rates().values()) < 1.0 / A.FALLBACK_BELOW
    assert auto.pending and A.PRIOR_REASON in _reason(auto.plan())


def test_acceptance_priors_that_cannot_be_read_are_ignored():
    from specstream_mlx.runtime.acceptance_prior import AcceptancePrior

    for extra in ({}, {"acceptance": 3}, {"acceptance": {"budgets": {"x": 1}}}, {"acceptance": {"budgets": {}}}):
        assert AcceptancePrior.from_extra(extra) is None
    assert AcceptancePrior.from_extra({"acceptance": {"budgets": {"4": -1.0}}}) is None
    p = AcceptancePrior.from_extra({"acceptance": {"budgets": {"2": 0.5, "8": 1.1}}})
    assert p.expected(2) == 0.5 and p.expected(5) == pytest.approx(0.8) and p.expected(24) == 1.1


def test_accepted_length_follows_the_target_down_the_tree():
    from specstream_mlx.runtime.acceptance_prior import accepted_length

    # root 0 -> a(1) -> c(3); root -> b(2) -> d(4) -> e(5)
    tree = Tree((0, 10, 20, 11, 21, 22), (-1, 0, 0, 1, 2, 4))
    assert accepted_length(tree, [20, 21, 22, 7]) == 3
    assert accepted_length(tree, [10, 11, 5]) == 2
    assert accepted_length(tree, [10, 21]) == 1
    assert accepted_length(tree, [30]) == 0


def test_measured_acceptance_counts_the_positions_before_a_stop(tiny_model_dir):
    """A reply that stopped is known to its end: every position before the stop counts (the
    passes that end a real reply accept what is left, no more); one cut at max_tokens counts
    only positions whose continuation is known γ deep. Leaving the stop positions out
    overstated demo-sql's acceptance per pass 1.5x on its 15-token replies."""
    import mlx.core as mx

    from specstream_mlx.runtime.acceptance_prior import measure_acceptance
    from specstream_mlx.runtime.sampling import SamplingParams
    from specstream_mlx.runtime.steps import ar_steps

    model, _ = _auto_model(tiny_model_dir)
    gamma = model.streams.num_streams
    prompt = mx.array(list(range(3, 20)))
    reply = []
    for step in ar_steps(model.base, prompt, SamplingParams()):
        reply.extend(step.tokens)
        if len(reply) >= 16:
            break
    # The stop: the first token from the 8th on that did not occur before it.
    stop_at = next(i for i in range(7, 16) if reply[i] not in reply[:i])
    stopped = measure_acceptance(model, [prompt], max_tokens=16, stop_tokens=[reply[stop_at]])
    assert stopped.positions == stop_at + 1  # the reply up to and including the stop
    cut = measure_acceptance(model, [prompt], max_tokens=16)
    assert cut.positions == 16 - gamma


def test_measured_acceptance_is_bounded_and_grows_with_the_budget(tiny_model_dir):
    """On a tiny model: every budget's mean accepted length lies in [0, γ], and a larger
    budget's dynamic tree contains the smaller one's, so it never accepts less."""
    import mlx.core as mx

    from specstream_mlx.runtime.acceptance_prior import measure_acceptance

    model, _ = _auto_model(tiny_model_dir)
    prompts = [mx.array(list(range(3, 20))), mx.array(list(range(30, 41)))]
    prior = measure_acceptance(model, prompts, max_tokens=16)
    es = [prior.budgets[b] for b in sorted(prior.budgets)]
    assert prior.positions == 2 * (16 - model.streams.num_streams) and prior.prompts == 2
    assert all(0.0 <= e <= model.streams.num_streams for e in es)
    assert all(a <= b + 1e-9 for a, b in zip(es, es[1:]))


def test_costs_are_written_only_after_new_timed_passes(tmp_path, monkeypatch):
    """A request decoded plainly times no pass: the stored costs stay as they are, without a
    file write after every request; a newly timed pass is stored again."""
    monkeypatch.setenv("SPECSTREAM_MLX_CACHE", str(tmp_path))
    path = tmp_path / "step_costs.json"
    costs = PassCosts("machine|model")
    for _ in range(C.TIME_MIN):
        costs.observe_plain(0.01)
        costs.observe_pass((4, 0), 0.02)
    costs.save()
    assert json.loads(path.read_text())["machine|model"]["costs"] == {"4,0": pytest.approx(2.0)}
    path.unlink()
    for _ in range(5):
        costs.observe_plain(0.012)  # plain tokens only
    costs.save()
    assert not path.exists()
    costs.observe_pass((4, 0), 0.024)
    costs.save()
    assert path.exists()


def test_a_one_shot_process_that_times_only_passes_stores_what_they_cost(tmp_path, monkeypatch):
    """With an acceptance prior a short request runs tree passes and no plain probe: its
    passes are measured against the stored plain step, so the next process starts from
    what they cost inside a generation, not from the calibration of bare passes again."""
    monkeypatch.setenv("SPECSTREAM_MLX_CACHE", str(tmp_path))
    first = PassCosts.load("machine|model")
    first.save({(4, 1): 2.0, (8, 1): 2.5}, plain_seconds=0.010)  # the calibration
    for _ in range(C.TIME_MIN):
        first.observe_pass((4, 1), 0.040)  # in a generation: host drafting and verifying too
    assert first.plain_n == 0 and first.cost((4, 1)) == pytest.approx(4.0)
    first.save()  # the request ends
    second = PassCosts.load("machine|model")
    assert second.stored[(4, 1)] == pytest.approx(4.0) and second.stored_plain == pytest.approx(0.010)
    # An arm not timed moves with the timed one (4.0 / 2.0 of its calibrated cost), so the
    # next process does not try it at a cost its neighbour has disproved.
    assert second.cost((8, 1)) == pytest.approx(5.0)
    # Plain tokens timed in the process itself take over, and are stored as the reference.
    for _ in range(C.TIME_MIN):
        second.observe_plain(0.020)
        second.observe_pass((4, 1), 0.060)
    assert second.cost((4, 1)) == pytest.approx(3.0)
    second.save()
    assert PassCosts.load("machine|model").stored_plain == pytest.approx(0.020)


def test_the_lookup_arm_wins_where_continuations_are_accepted():
    """Greedy: passes that host no streams and verify the n-gram continuation alone compete
    with the stream arms, scored by what verified continuations accepted over their own
    cost; the continuations' path scores alone (a uniform prior on the n-gram hit rates
    before the request has judged any) do not choose the arm."""
    scores = [0.3, 0.2, 0.1, 0.05]
    costs = costs_of({2: 2.0, 4: 2.3, 8: 2.8})
    costs.stored[A.LOOKUP_ARM] = 1.3
    auto = AutoPolicy(costs, depth=4, budget=4, hosting=0)
    observe_many(auto, WARMUP_STEPS, accepted=0.6, scores=scores)  # streams: best (1 + 0.6) / 2.3 < 1
    for _ in range(30):
        auto.observe_lookup(3.5)  # continuations promise a copied span...
    auto._choose()
    assert auto.lookup_expected() is None and auto.pending is not None  # ...not yet judged: plain
    for _ in range(A.WATCH_PASSES):
        auto.observe_replayed(4)  # replayed over plain tokens, they accepted 4: (1 + 4) / 1.3
    assert auto.resume_passes() and auto.lookup_expected() == pytest.approx(4.0)
    auto._choose()  # and judged by what they accepted, the arm stays the best
    assert (auto.budget, auto.hosting) == A.LOOKUP_ARM and auto.pending is None
    plans = [auto.plan() for _ in range(A.LOOKUP_EXPLORE_EVERY)]
    assert all(p.label == "auto:lookup" for p in plans)
    lookup = [p for p in plans if p.hosting == A.NO_STREAMS]
    assert len(lookup) == A.LOOKUP_EXPLORE_EVERY - 1 and all(p.threshold == 0.0 for p in lookup)
    assert plans[-1].hosting == 0 and plans[-1].streams_per_host == 4  # the streams' evidence, now and then
    # Nothing to copy any more: neither source pays, plain decoding.
    for _ in range(60):
        auto.observe_lookup(0.0)
    auto._choose()
    assert auto.pending is not None
    # Sampling: the arm is not offered (a sampled draft must be drawn from its proposal).
    sampled = AutoPolicy(costs, depth=4, budget=4, hosting=0, lookup_arm=False)
    observe_many(sampled, WARMUP_STEPS, accepted=0.6, scores=scores)
    for _ in range(30):
        sampled.observe_lookup(3.5)
    assert A.LOOKUP_ARM not in sampled.arms()


def test_lookup_arm_passes_decode_exactly_what_plain_decoding_does(tiny_model_dir, tmp_path, monkeypatch):
    """On the lookup arm (greedy) passes host no streams and verify the continuation alone,
    with an all-stream pass every LOOKUP_EXPLORE_EVERY: the output equals plain decoding's,
    right continuations are accepted and wrong ones (every third) are not."""
    import mlx.core as mx

    from specstream_mlx.runtime.lookup import LookupBranch
    from specstream_mlx.runtime.sampling import SamplingParams
    from specstream_mlx.runtime.speculative import ss_steps
    from specstream_mlx.runtime.steps import ar_steps

    monkeypatch.setenv("SPECSTREAM_MLX_CACHE", str(tmp_path))
    model, _ = _auto_model(tiny_model_dir)
    prompt = [5, 9, 40, 77, 12, 5, 9, 40, 77, 12, 5, 9, 40]
    want = []
    for step in ar_steps(model.base, mx.array(prompt), SamplingParams()):
        want += step.tokens
        if len(want) >= 80:
            break
    calls = {"n": 0}

    def oracle(self, decided):  # a random tiny model copies nothing: continuations from the answer
        calls["n"] += 1
        at = len(decided) - len(prompt)
        right = want[at : at + 3]
        self.chain = right if calls["n"] % 3 else [(t + 1) % 256 for t in right]
        return self.chain, [0.9] * len(self.chain)

    monkeypatch.setattr(LookupBranch, "propose", oracle)
    auto = model.tuner(SamplingParams())
    pin_to_lookup_arm(auto, monkeypatch, lambda e: e > 0)  # every continuation verified
    got, lookup_accepted = [], 0
    for step in ss_steps(model, mx.array(prompt), SamplingParams(), tree="auto", policy=auto):
        got += step.tokens
        if step.info.tree == "auto:lookup":
            lookup_accepted += step.info.accepted
        if len(got) >= 60:
            break
    assert got[:60] == want[:60]
    assert lookup_accepted > 0
    assert auto.costs.timed.get(A.LOOKUP_ARM, 0) > 0


def test_lookup_passes_are_replayed_exactly_over_plain_tokens():
    """Greedy decoding decides the same tokens however it drafts: a replayed lookup pass
    accepts what a real one would have (the repeated prefix of the continuation)."""
    from specstream_mlx.runtime.lookup import LookupReplay

    r = LookupReplay(3)
    decided = [1, 2, 3, 4, 9, 1, 2, 3, 4, 5, 6, 7]
    # From position 5 (decided[:5] ends in 9, never seen before 9: no continuation): 0, then
    # from 6 (after "1"): "2 3 4" repeated, all 3 accepted and one decided beyond; from 10 ("5"
    # is new): 0 -- its tokens are not all decided yet, so it waits.
    assert r.replay(decided, 5) == [0, 3]
    assert r.pos == 10
    assert r.replay(decided + [8, 8, 8], 5) == [0, 0]  # "5" then "6": nothing to continue


def test_plain_decoding_switches_to_the_lookup_arm_when_replayed_passes_pay():
    costs = costs_of({2: 3.0, 4: 3.5})
    costs.stored[A.LOOKUP_ARM] = 1.4
    auto = AutoPolicy(costs, depth=4, budget=4, hosting=0)
    observe_many(auto, WARMUP_STEPS, accepted=0.2, scores=[0.2, 0.1])
    auto._choose()
    plan = auto.plan()
    assert auto.pending and _reason(plan) == auto.pending and plan.watch  # plain, watching
    for _ in range(A.WATCH_PASSES):
        auto.observe_replayed(0)  # nothing repeats: (1 + 0) / 1.4
    assert not auto.resume_passes() and _reason(auto.plan()) is not None
    auto.new_request()
    auto.skip = 0
    auto.pending = "plain decoding: test"
    for _ in range(A.WATCH_PASSES - 1):
        auto.observe_replayed(4)  # a copied span: (1 + 4) / 1.4
    assert not auto.resume_passes()  # not before WATCH_PASSES of this request
    auto.observe_replayed(0)
    # Enough on average, but the copied span has ended: a chat reply that once repeated a
    # few words of its prompt goes on without them.
    assert not auto.resume_passes() and _reason(auto.plan()) is not None
    auto.observe_replayed(4)
    assert auto.resume_passes()
    plan = auto.plan()
    assert _reason(plan) is None and plan.hosting == A.NO_STREAMS and plan.label == "auto:lookup"
    # Sampling offers no lookup arm: plain decoding to the end, not watched.
    sampled = AutoPolicy(costs, depth=4, budget=4, hosting=0, lookup_arm=False, pending="plain decoding: test")
    assert not sampled.plan().watch


def test_the_last_pass_of_a_request_is_timed_too(tiny_model_dir):
    """A consumer that stops at EOS closes the step generator at the last pass's yield:
    that pass is still booked (on a 3-pass reply it is a third of the evidence)."""
    import mlx.core as mx

    from specstream_mlx.method.tree import TreeSpec
    from specstream_mlx.runtime.sampling import SamplingParams
    from specstream_mlx.runtime.speculative import ss_steps

    class Spy(A.FixedPolicy):
        observed = 0

        def new_request(self, pruning_levels=(0.0,)):
            pass

        def observe_pass(self, plan, draft, accepted, seconds):
            self.observed += 1

    model, _ = _auto_model(tiny_model_dir)
    spy = Spy(TreeSpec.parse("dynamic:4"), 0.0)
    steps = ss_steps(model, mx.array(list(range(3, 30))), SamplingParams(), tree="auto", policy=spy)
    for n, _ in enumerate(steps, start=1):
        if n == 5:
            break
    steps.close()
    assert spy.observed == 5


def test_an_arm_timed_without_a_stored_cost_moves_the_others_by_what_it_shows():
    """A calibration times budgets 2 and 8; the first request runs budget 4, which has no
    stored cost: its measured cost against the calibration's line scales the other arms."""
    costs = PassCosts(stored={(2, 1): 2.0, (8, 1): 3.2}, stored_plain=0.010)
    for _ in range(C.TIME_MIN):
        costs.observe_pass((4, 1), 0.048)  # 4.8 plain steps against the line's 2.4
    table = costs.table([(2, 1), (4, 1), (8, 1)])
    assert table == pytest.approx({(2, 1): 4.0, (4, 1): 4.8, (8, 1): 6.4})


@pytest.mark.parametrize("worth_a_pass", [True, False])
def test_lookup_arm_steps_without_a_continuation_are_plain_compiled_steps(
    tiny_model_dir, tmp_path, monkeypatch, worth_a_pass
):
    """On the lookup arm a step with nothing to verify, or with a continuation not expected
    to pay for its pass, decides one token as a plain step does (the compiled graph), not as
    an op-by-op root-only pass; output equals ar."""
    import mlx.core as mx

    from specstream_mlx.runtime.compiled_pass import SSPass
    from specstream_mlx.runtime.sampling import SamplingParams
    from specstream_mlx.runtime.speculative import ss_steps
    from specstream_mlx.runtime.steps import ar_steps

    monkeypatch.setenv("SPECSTREAM_MLX_CACHE", str(tmp_path))
    monkeypatch.setattr(A, "LOOKUP_EXPLORE_EVERY", 10**9)  # no all-stream passes in between
    model, _ = _auto_model(tiny_model_dir)
    auto = model.tuner(SamplingParams())
    pin_to_lookup_arm(auto, monkeypatch, lambda e: worth_a_pass and e > 0)
    monkeypatch.setattr(auto, "since_probe", -(10**9))  # and no probes
    calls = {}
    count_calls(monkeypatch, SSPass, calls, "ss")
    prompt = mx.array([5, 9, 40, 77, 12, 5, 9, 40, 77, 12, 5, 9, 40])
    got, verified = [], 0
    for step in ss_steps(model, prompt, SamplingParams(), tree="auto", policy=auto):
        got += step.tokens
        verified += step.info.nodes > 0
        if len(got) >= 40:
            break
    want = [s.tokens[0] for s, _ in zip(ar_steps(model.base, prompt, SamplingParams()), range(len(got)))]
    assert got == want
    assert calls["ss"] == verified and verified < len(got) and (verified > 0) == worth_a_pass


def test_lookup_passes_and_stream_passes_scale_their_own_kind():
    """Lookup passes carry none of a stream pass's drafting work: what they show against
    their stored cost moves the other lookup costs only."""
    costs = PassCosts(stored={(2, 1): 2.0, (8, 1): 3.2, A.LOOKUP_ARM: 1.2}, stored_plain=0.010)
    for _ in range(C.TIME_MIN):
        costs.observe_pass(A.LOOKUP_ARM, 0.024)  # twice its stored cost
    table = costs.table([(2, 1), (8, 1), A.LOOKUP_ARM])
    assert table == pytest.approx({(2, 1): 2.0, (8, 1): 3.2, A.LOOKUP_ARM: 2.4})


def test_a_continuation_is_verified_only_where_it_pays_for_its_pass():
    """The lookup arm verifies a continuation when 1 + its expected accepted tokens reach its
    pass's cost (else a plain step decides the token), and its rate counts the plain steps."""
    costs = PassCosts(stored={A.LOOKUP_ARM: 1.5, (2, 1): 2.0})
    auto = AutoPolicy(costs, depth=4, budget=4, hosting=0)
    assert not auto.chain_pays(0.0) and not auto.chain_pays(0.4) and auto.chain_pays(0.6)
    for e in (0.0, 0.8) * 40:  # every other step has a continuation worth verifying
        auto.observe_lookup(e)
    # Per step: 1 + 0.4 tokens for 1 + 0.5 * (1.5 - 1) plain-step times.
    assert auto.chain == pytest.approx(0.4, abs=0.03) and auto.chain_share == pytest.approx(0.5, abs=0.03)
    assert auto.rate(A.LOOKUP_ARM) is None  # no verified continuation judged yet
    auto.hits, auto.hits_n = 0.8, A.WATCH_PASSES  # verified ones accepted what they promised
    assert auto.rate(A.LOOKUP_ARM) == pytest.approx(1.4 / 1.25, abs=0.03)


def test_a_short_request_that_ran_trees_is_judged_when_it_ends():
    """A reply of three passes ends before the warm-up: its trees are judged at its end, so
    the next request decodes plainly instead of trying trees again (and the evidence of
    three-pass requests, halved at each, would never reach the warm-up: 3, 4.5, 5.25, ...)."""
    auto = AutoPolicy(costs_of({2: 2.0, 4: 2.3, 8: 2.8}), depth=4, budget=4, hosting=0)
    for _ in range(3):
        auto.new_request()
        observe_many(auto, 3, accepted=0, scores=[0.3, 0.2, 0.1, 0.05])
        assert auto.evidence.steps < WARMUP_STEPS
        auto.finish()
        if auto.pending is not None:
            break
    assert auto.pending is not None and auto.skip >= 1  # after the first request already
    assert auto.evidence.steps == 3
    auto.new_request()
    assert _reason(auto.plan()) == A.BACKOFF_REASON


def test_the_reason_for_plain_decoding_is_amended_once_drafts_are_verified_again():
    """A request that started plain (the prior) and later verified drafts (its reply seen
    copying the prompt) does not end with "plain decoding" alone in its summary."""
    from specstream_mlx.runtime.generation import RESUMED, GenerationStats, _record_step_info
    from specstream_mlx.runtime.steps import StepInfo

    stats = GenerationStats(mode="ss")
    _record_step_info(stats, StepInfo(fallback=A.PRIOR_REASON))
    _record_step_info(stats, StepInfo())  # plain tokens: the reason stands as it is
    assert stats.fallback == A.PRIOR_REASON
    for _ in range(3):  # lookup passes: said once
        _record_step_info(stats, StepInfo(accepted=2, nodes=4, tree="auto:lookup"))
    assert stats.fallback == A.PRIOR_REASON + RESUMED
    fresh = GenerationStats(mode="ss")
    _record_step_info(fresh, StepInfo(accepted=1, nodes=4))  # passes from the start: no reason to amend
    assert fresh.fallback is None


def test_calibration_times_passes_at_their_median_over_enough_runs(monkeypatch):
    """The prior's pass costs are typical ones: at least the calibration's repetitions, more
    until enough seconds of passes are timed (a small model's passes take 2 ms and vary 2x),
    and their median, not the luckiest run."""
    import time

    from specstream_mlx.runtime import offline_costs

    calls = []

    def fn():  # a warm-up, then one slow run among fast ones
        calls.append(None)
        time.sleep(0.02 if len(calls) == 2 else 0.002)

    t = offline_costs.timed(fn, 3, typical_seconds=0.0)
    assert len(calls) == 4 and 0.0015 < t < 0.015  # the median, not the slow run
    calls.clear()
    offline_costs.timed(lambda: (calls.append(None), time.sleep(0.002)), 3, typical_seconds=0.03)
    assert 4 < len(calls) <= 25  # past 3 runs (6 ms) until 30 ms are timed, at most 8 x 3 and the warm-up
    calls.clear()
    offline_costs.timed(lambda: (calls.append(None), time.sleep(0.002)), 3, typical_seconds=10.0)
    assert len(calls) == 25  # the cap
    seen = {}
    monkeypatch.setattr(offline_costs, "measure_arm_costs", lambda *a, **k: seen.update(k) or "costs")
    assert A.calibrate(None, None, sampled=False, compiled=False) == "costs"
    assert seen["typical_seconds"] > 0 and seen["reps"] >= 3


def test_a_plain_probe_times_each_token_as_a_whole_step():
    """A probe's tokens are pipelined: each token's step is queued before the one before it
    is handed out, and MLX holds the host back while a step's operations are in flight, so
    its last token's step ran mostly while the one before it was queued: timed from resume
    to resume it took a fifth of a step (SmolLM2: 5 against 24 ms). Booked as a plain
    token, it pulled the plain step's average down by a fifth and every pass cost up by as
    much: `eval-bfcl` on `smollm2-fc`, starting from the costs an earlier run had stored,
    decoded plainly at 1.06x `ar` (with the last token left untimed, two runs one after the
    other: 1.32x and 1.39x, the second from the costs the first stored)."""
    import mlx.core as mx

    from specstream_mlx.models import build_model
    from specstream_mlx.runtime.cache import make_cache
    from specstream_mlx.runtime.sampling import SamplingParams
    from specstream_mlx.runtime.speculative import plain_probe

    # Deep enough that a step's operations outnumber the tasks MLX lets be in flight.
    config = dict(model_type="llama", hidden_size=128, num_hidden_layers=24, intermediate_size=256)
    model = build_model(dict(config, num_attention_heads=4, num_key_value_heads=2, vocab_size=4096))
    mx.eval(model.parameters())
    cache = make_cache(model)
    model(mx.array([[3, 1, 4, 1, 5, 9, 2, 6]]), cache=cache)
    root, seconds = 7, []
    for _ in range(3):
        probe = plain_probe(model, root, 6, SamplingParams(), cache, 0, seconds.append)
        try:
            while True:
                next(probe)
        except StopIteration as done:
            root = done.value
    typical = float(np.median(seconds))
    assert len(seconds) == 3 * 4, seconds  # each token between the first and the last
    # Each probe's last token, timed as it was, took a fifth of a step. Their median, not
    # every token's least: under a parallel test run one token among twelve came out at
    # 0.48 of the median, the second of a probe, not a last one.
    last = [seconds[i] for i in (3, 7, 11)]
    assert np.median(last) > 0.5 * typical, [round(s / typical, 2) for s in seconds]


def test_replayed_lookup_passes_score_the_continuations_the_lookup_arm_proposes():
    """Lookup passes replayed over plainly decoded tokens count in the request's hit rates,
    which the lookup branch scores its continuations by: after a copied span the next
    continuation's expected accepted tokens clear a lookup pass stored at 2.76 plain steps
    (1 + expected >= cost), where the prior alone (a branch started without them) promises
    less than one token and no pass would ever run to re-time the arm."""
    from specstream_mlx.runtime.lookup import LookupBranch, LookupReplay

    text = list(range(100, 130))
    decided = [7, 8, 9] + text + [1, 2] + text[:20]  # the reply copies the prompt's span
    replay = LookupReplay(5)
    accepted = replay.replay(decided, start=35)
    assert accepted and max(accepted) == 5
    copying_at = decided[:-4]
    chain, scores = LookupBranch(5, replay.rates).propose(copying_at)
    assert chain == decided[-4:] + [text[20]] and 1.0 + sum(scores) >= 2.76
    _, prior_only = LookupBranch(5).propose(copying_at)
    assert sum(prior_only) < 1.0


def test_a_copying_reply_runs_lookup_passes_even_where_one_is_stored_as_costly():
    """SmolLM2 on the demo's copying prompt, greedy, with the lookup pass's stored cost at
    2.76 plain steps (what this machine's store held when it stopped running them): plain
    decoding sees the copy in its replayed passes, switches to the lookup arm, and the arm
    verifies continuations (so its cost is timed again); the output equals ar. Before the
    replayed passes scored the arm's continuations, every token was decoded plainly."""
    import mlx.core as mx

    from specstream_mlx import load
    from specstream_mlx.demo.run import DEMOS
    from specstream_mlx.runtime.acceptance_prior import AcceptancePrior
    from specstream_mlx.runtime.generation import encode_prompt
    from specstream_mlx.runtime.sampling import SamplingParams
    from specstream_mlx.runtime.speculative import ss_steps
    from specstream_mlx.runtime.steps import ar_steps

    model, tok = load("smollm2", warn=False)
    demo = next(d for d in DEMOS if "Repeat" in d.prompt)
    ids = mx.array(encode_prompt(tok, demo.prompt))
    stored = {(2, 0): 1.81, (2, 1): 1.65, A.LOOKUP_ARM: 2.76, (8, 0): 3.62, (8, 1): 3.14}
    costs = PassCosts(stored=stored, stored_plain=0.009)  # no key: nothing is written
    prior = AcceptancePrior.from_extra(model.streams.config.extra)
    assert prior is not None  # the shipped streams' measured acceptance: the first request decodes plainly
    auto = AutoPolicy(costs, model.streams.num_streams, False, prior=prior, prior_picks_arm=True, lookup_arm=True)
    auto.new_request()
    assert auto.pending is not None
    got, verified = [], 0
    for step in ss_steps(model, ids, SamplingParams(), tree="auto", policy=auto):
        got += step.tokens
        verified += step.info.tree == "auto:lookup" and step.info.nodes > 0
        if len(got) >= 40:
            break
    want = [t for s, _ in zip(ar_steps(model.base, ids, SamplingParams()), range(len(got))) for t in s.tokens]
    assert got == want[: len(got)]
    assert verified > 0 and auto.costs.timed.get(A.LOOKUP_ARM, 0) > 0
