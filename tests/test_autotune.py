"""--tree auto: the budget choice follows measured costs and observed acceptance."""

from specstream_mlx.runtime.autotune import WARMUP_STEPS, AutoTree


def observe_many(auto, n, accepted, scores):
    for _ in range(n):
        auto.observe(predicted_at_budget=sum(scores[: auto.budget]), accepted=accepted, path_scores=scores)


def test_choose_maximises_expected_rate():
    # Calibrated streams (accepted == predicted at budget 4): E_b = sum of the b best scores.
    scores = [0.9, 0.8, 0.7, 0.6, 0.1, 0.1, 0.1, 0.1]
    auto = AutoTree({0: 1.0, 2: 1.5, 4: 1.8, 8: 4.0}, depth=4, budget=4)
    observe_many(auto, WARMUP_STEPS, accepted=3.0, scores=scores)
    # rates: b2 (1+1.7)/1.5=1.80, b4 (1+3.0)/1.8=2.22, b8 (1+3.4)/4=1.10
    assert auto.choose() == 4
    # A step-cost table where every tree loses to plain decoding falls back.
    slow = AutoTree({0: 1.0, 2: 3.0, 4: 5.0}, depth=4, budget=4)
    observe_many(slow, WARMUP_STEPS, accepted=1.0, scores=scores)
    assert slow.choose() is None


def test_warm_up_keeps_the_budget_and_new_requests_halve_evidence():
    scores = [0.5, 0.4, 0.3, 0.2]
    auto = AutoTree({0: 1.0, 2: 1.2, 4: 3.0}, depth=4, budget=4)
    observe_many(auto, WARMUP_STEPS - 1, accepted=0.0, scores=scores)
    assert auto.choose() == 4  # still warming up
    observe_many(auto, 1, accepted=0.0, scores=scores)
    assert auto.choose() is None  # nothing is ever accepted: plain decoding wins
    before = auto.expected_speedup(2)
    auto.new_request()
    assert abs(auto.expected_speedup(2) - before) < 1e-12  # averages unchanged
    assert auto.steps < WARMUP_STEPS  # so the next request re-tries a tree
    assert auto.choose() == auto.budget


def test_fallback_backs_off_exponentially_and_resets_on_success():
    auto = AutoTree({0: 1.0, 2: 1.2}, depth=4, budget=2)
    auto.note_fallback()
    assert [auto.new_request() for _ in range(2)] == [False, True]  # skip 1, then re-try
    auto.note_fallback()
    assert [auto.new_request() for _ in range(3)] == [False, False, True]  # skip 2
    # A tree that pays off again clears the back-off.
    observe_many(auto, 2 * WARMUP_STEPS, accepted=1.0, scores=[0.9, 0.9])
    assert auto.choose() == 2 and auto.backoff == 0


def test_deeper_budgets_are_judged_on_deep_candidates():
    """Stream top-1 probabilities .85/.80/.78/.75: budget 4 is worth .85 + .85·.8 +
    .85·.8·.78 + .85·.8·.78·.75 = 2.46 accepted tokens, whatever tree is in use."""
    import numpy as np

    from specstream_mlx.runtime.drafting import draft_tree
    from specstream_mlx.runtime.sampling import SamplingParams

    p1 = np.array([0.85, 0.80, 0.78, 0.75])
    top = np.array([[10 + g, 20 + g] for g in range(4)])
    ptop = np.stack([p1, 1 - p1], axis=1)
    want = 0.85 + 0.85 * 0.8 + 0.85 * 0.8 * 0.78 + 0.85 * 0.8 * 0.78 * 0.75
    auto = AutoTree({0: 1.0, 2: 1.2, 4: 1.5}, depth=4, budget=2)
    rng = np.random.default_rng(0)
    spec = auto.spec()  # the current tree: budget 2, so 2 streams deep
    # A normal pass hosts only the 2 streams a 2-node tree can use: no evidence for budget 4.
    shallow = draft_tree(1, top[:2], ptop[:2], None, spec, SamplingParams(), rng, score_budget=4)
    auto.observe(shallow.predicted, 2, shallow.scores, shallow.candidate_depth)
    assert auto.expected_accepted(4) is None and auto.expected_accepted(2) is not None
    # An exploration pass hosts all 4 streams: budget 4 is credited its full value.
    deep = draft_tree(1, top, ptop, None, spec, SamplingParams(), rng, score_budget=4)
    assert deep.candidate_depth == 4 and len(deep.tree) == 3  # the tree itself is unchanged
    auto.observe(deep.predicted, 2, deep.scores, deep.candidate_depth)
    auto.actual = auto.predicted  # calibrated streams
    assert abs(auto.expected_accepted(4) - want) < 1e-9, auto.expected_accepted(4)


def test_every_few_passes_host_all_streams():
    from specstream_mlx.runtime.autotune import EXPLORE_EVERY

    auto = AutoTree({0: 1.0, 2: 1.2, 8: 2.0}, depth=4, budget=2)
    depths = [auto.next_pass()[0] for _ in range(3 * EXPLORE_EVERY)]
    assert depths.count(4) == 3 and set(depths) == {2, 4}


def test_greedy_and_sampled_decoding_keep_separate_tuners(monkeypatch):
    import specstream_mlx.runtime.engine as engine
    from specstream_mlx.runtime.sampling import SamplingParams

    made = []

    def fake(model, streams, log=None, sampled=False, compiled=False):
        made.append(sampled)
        return AutoTree({0: 1.0, 2: 1.2}, depth=4)

    monkeypatch.setattr(engine, "auto_tree_for", fake)
    sm = engine.SpeculativeModel(base=None, streams=None)
    g1, s1 = sm.tuner(SamplingParams()), sm.tuner(SamplingParams(temperature=0.7))
    assert g1 is not s1 and made == [False, True]
    assert sm.tuner(SamplingParams()) is g1 and sm.tuner(SamplingParams(temperature=1.0)) is s1


def test_one_clients_fallback_does_not_switch_another_to_plain_decoding(monkeypatch):
    """Back-off and acceptance evidence are per client; machine facts (costs, pass and
    plain timings, the compiled choice) are shared, and measured once."""
    import specstream_mlx.runtime.engine as engine
    from specstream_mlx.runtime.sampling import SamplingParams

    made = []
    monkeypatch.setattr(
        engine, "auto_tree_for", lambda *a, **k: made.append(1) or AutoTree({0: 1.0, 2: 1.2, 4: 1.5}, depth=4)
    )
    sm = engine.SpeculativeModel(base=None, streams=None)
    greedy = SamplingParams()
    a, b = sm.tuner(greedy, client="alice"), sm.tuner(greedy, client="bob")
    assert a is not b and sm.tuner(greedy, client="alice") is a and len(made) == 1
    assert a.costs is b.costs and a.pass_seconds is b.pass_seconds and a.budget == 4
    a.observe_pass_seconds(4, 0, 0.5)
    assert b.pass_timed[(4, 0)] == 1  # one client's timing is a machine fact for all
    a.note_fallback()
    assert not a.new_request()  # alice's next request decodes plainly ...
    assert b.new_request() and sm.tuner(greedy).new_request()  # ... nobody else's
    a.observe(3.0, 2, [0.9, 0.8, 0.5, 0.4], 4, 0, 4)
    assert not b.scores_sum  # acceptance evidence stays with its client
    for i in range(engine.MAX_CLIENT_TUNERS + 5):  # bounded: the least recently served go
        sm.tuner(greedy, client=i)
    assert len(sm.client_tuners) == engine.MAX_CLIENT_TUNERS and ("greedy", "alice") not in sm.client_tuners


def test_step_costs_are_remeasured_when_stale_or_taken_under_load():
    from specstream_mlx.runtime.autotune import LOADED, MAX_COST_AGE_S, _fresh

    now = 1_000_000_000.0
    entry = {"costs": {"0": 1.0, "2": 1.3}, "host_costs": {"0": 1.0, "2": 1.2}, "measured_at": now - 60, "load": 0.1}
    assert _fresh(entry, now, load_now=0.1)
    assert not _fresh({**entry, "measured_at": now - MAX_COST_AGE_S - 1}, now, 0.1)  # stale
    loaded = {**entry, "load": LOADED + 0.5}
    assert not _fresh(loaded, now, load_now=0.1)  # taken under load; quieter now
    assert _fresh(loaded, now, load_now=LOADED + 0.5)  # still loaded: nothing better to measure
    assert not _fresh({"0": 1.0, "2": 1.3}, now, 0.1)  # an older cache format


def test_hosting_policy_is_an_arm_judged_by_its_own_acceptance():
    """Hosting streams at fewer nodes is cheaper; it wins while it loses no
    acceptance, and loses once its drafts are accepted less (its calibration)."""
    from specstream_mlx.runtime.autotune import HOSTING

    scores = [0.9, 0.8, 0.7, 0.6]
    auto = AutoTree({0: 1.0, 4: 2.0}, depth=4, budget=4, host_costs={0: 1.0, 4: 1.5})
    for _ in range(WARMUP_STEPS):
        auto.observe(sum(scores), accepted=3.0, path_scores=scores, hosting=0, budget=4)
    assert auto.choose() == 4 and auto.hosting == HOSTING  # untried: assumed lossless, and cheaper
    for _ in range(WARMUP_STEPS):  # drafts from the cheaper mode are accepted far less
        auto.observe(sum(scores), accepted=0.5, path_scores=scores, hosting=HOSTING, budget=4)
    assert auto.choose() == 4 and auto.hosting == 0
    assert auto.spec().hosts == 0


def test_blas_threads_are_measured_stored_and_used_only_while_decoding(tmp_path, monkeypatch, tiny_model_dir):
    """Where the BLAS has a thread control (OpenBLAS, preloaded by `make test`), the faster
    count wins the timing, is stored with the step costs, and is set again when they are read."""
    import json

    import mlx.core as mx

    import specstream_mlx.runtime.autotune as A
    from specstream_mlx import load
    from specstream_mlx.platform_info import blas_threads, set_blas_threads

    default = blas_threads()
    assert default is not None, "run with OpenBLAS preloaded (make test does)"
    from specstream_mlx.method.streams import StreamConfig, new_streams

    model, _ = load(str(tiny_model_dir), warn=False)
    model.streams = new_streams(model.base, StreamConfig(num_streams=2, stream_layers=1, lora_rank=2))
    if default < 2:
        set_blas_threads(default := 2)
    # Fake timings: one thread is three times faster (what a loaded 2-core machine can show).
    monkeypatch.setattr(A, "_plain_step_seconds", lambda *a, **k: 1.0 if blas_threads() == 1 else 3.0)
    monkeypatch.setattr(A, "_timed", lambda fn, reps: 1.0 if blas_threads() == 1 else 3.0)
    try:
        # Chosen by measurement; the process keeps the count it had.
        assert A.choose_blas_threads(model.base, model.streams) == 1 and blas_threads() == default
        monkeypatch.setattr(A, "CACHE_FILE", tmp_path / "costs.json")
        monkeypatch.setattr(A, "measure_step_costs", lambda *a, **k: {0: 1.0, 2: 1.5} if blas_threads() == 1 else {})
        assert A.load_or_measure_costs(model.base, model.streams)[3] == 1 and blas_threads() == default
        entries = list(json.loads((tmp_path / "costs.json").read_text()).values())
        assert [e["blas_threads"] for e in entries if "costs" in e] == [1]
        assert [e["threads"] for e in entries if "threads" in e] == [1]
        auto = A.auto_tree_for(model.base, model.streams)  # from the cache: the stored count again
        assert auto.blas_threads == 1 and auto.costs == {0: 1.0, 2: 1.5} and blas_threads() == default
        # Speculative decoding runs with it, and gives the process its count back when done.
        from specstream_mlx.runtime.sampling import SamplingParams
        from specstream_mlx.runtime.speculative import ss_steps

        model.tuners["greedy"] = auto
        seen = []
        for _ in ss_steps(model, mx.array([3, 4, 5]), SamplingParams(), tree="auto"):
            seen.append(blas_threads())
            if len(seen) == 3:
                break
        assert seen == [1, 1, 1]
        assert blas_threads() == default
    finally:
        set_blas_threads(default)


def test_auto_chooses_pruning_by_measured_seconds_per_token():
    """Each threshold is tried, the cheaper one per decided token wins, the other is re-tried
    periodically, and the choice follows when the costs change."""
    from specstream_mlx.runtime.autotune import PRUNE_EXPLORE, PRUNE_MIN_PASSES

    auto = AutoTree({0: 1.0, 4: 1.5}, depth=4, budget=4)
    assert auto.pruning_threshold() == 0.0  # one level until told otherwise
    auto.set_pruning_levels((0.0, 0.2))
    cost = {0.0: 2.0, 0.2: 1.0}  # seconds per pass; one token decided per pass

    def run(n):
        seen = []
        for _ in range(n):
            level = auto.pruning_threshold()
            seen.append(level)
            auto.observe_pruning(level, cost[level], 1)
        return seen

    first = run(2 * PRUNE_MIN_PASSES)
    assert sorted(set(first)) == [0.0, 0.2]  # both measured before choosing
    later = run(4 * PRUNE_EXPLORE)
    assert later.count(0.2) > later.count(0.0) > 0  # the cheaper wins; the other is re-tried
    cost[0.0], cost[0.2] = 0.5, 3.0  # pruning became the expensive one
    run(20 * PRUNE_EXPLORE)
    assert run(4 * PRUNE_EXPLORE).count(0.0) > 2 * PRUNE_EXPLORE
    auto.set_pruning_levels((0.0,))
    assert auto.pruning_threshold() == 0.0 and set(auto.prune_cost) == {0.0}


def test_auto_with_a_calibrated_threshold_stays_exact(tiny_model_dir):
    """Greedy ss with --tree auto and the model's pruning threshold equals ar, and the
    tuner was offered both pruning levels."""
    from specstream_mlx import SamplingParams, generate, load
    from specstream_mlx.method.streams import StreamConfig, new_streams

    model, tok = load(str(tiny_model_dir), warn=False)
    model.streams = new_streams(model.base, StreamConfig(num_streams=2, stream_layers=1, lora_rank=2))
    model.streams.config.pruning_threshold = 0.05
    ar = generate(model, tok, "hello there", max_tokens=24, mode="ar").tokens
    ss = generate(model, tok, "hello there", max_tokens=24, mode="ss", tree="auto")
    assert ss.tokens == ar
    auto = model.tuner(SamplingParams(), None)
    assert auto.prune_levels == (0.0, 0.05)
    # Both levels were used, the pruned one on passes that did prune.
    assert auto.prune_n.get(0.0, 0) > 0 and auto.prune_n.get(0.05, 0) > 0, auto.prune_n
    assert ss.stats.pruned_nodes > 0


def test_online_timings_replace_a_pessimistic_cost_table():
    """The offline table (bare passes and plain steps) can overstate a tree pass's cost:
    once passes and plain tokens are timed inside real generations, their ratio is the
    cost, and arms not timed yet are scaled by what the timed ones showed."""
    from specstream_mlx.runtime.autotune import PLAIN_EVERY, TIME_MIN

    scores = [0.9, 0.6, 0.0, 0.0]  # E_4 = 1.5 with calibrated streams
    auto = AutoTree({0: 1.0, 4: 3.0, 8: 4.5}, depth=4, budget=4)
    observe_many(auto, WARMUP_STEPS, accepted=1.5, scores=scores)
    assert auto.choose() is None  # table: (1 + 1.5) / 3.0 < 1
    for _ in range(TIME_MIN - 1):
        auto.observe_plain_seconds(0.010)
        auto.observe_pass_seconds(4, 0, 0.020)
    assert auto.cost(4) == 3.0  # too few samples yet: the table
    assert not auto.plain_probe_due()  # fewer timed passes than TIME_MIN
    auto.observe_pass_seconds(4, 0, 0.020)
    assert auto.plain_probe_due()  # trees timed, plain tokens not yet: probe now
    assert not auto.plain_probe_due()
    auto.observe_plain_seconds(0.010)
    assert abs(auto.cost(4) - 2.0) < 1e-9  # 20 ms per pass over 10 ms per plain token
    assert abs(auto.cost(8) - 4.5 * 2.0 / 3.0) < 1e-9  # untimed arm: the table, scaled
    assert auto.choose() == 4  # (1 + 1.5) / 2.0 > 1
    # Timings follow the machine (an EMA), and probes come back every PLAIN_EVERY passes.
    for _ in range(40):
        auto.observe_pass_seconds(4, 0, 0.040)
    assert auto.cost(4) > 3.5 and auto.choose() is None
    for _ in range(PLAIN_EVERY - 41):
        auto.observe_pass_seconds(4, 0, 0.040)
    assert not auto.plain_probe_due()
    auto.observe_pass_seconds(4, 0, 0.040)
    assert auto.plain_probe_due()


def test_trees_stay_through_estimates_near_break_even():
    """Plain decoding takes over only when the best arm is clearly slower (below
    FALLBACK_BELOW): near break-even, estimates move from pass to pass, and each fall-back
    costs the rest of the request and a back-off."""
    from specstream_mlx.runtime.autotune import FALLBACK_BELOW

    scores = [0.5, 0.5, 0.0, 0.0]  # E_2 = E_4 = 1.0 with calibrated streams
    for cost, keeps in ((2.0 / FALLBACK_BELOW - 0.01, True), (2.0 / FALLBACK_BELOW + 0.05, False)):
        auto = AutoTree({0: 1.0, 2: cost, 4: cost + 1}, depth=4, budget=2)
        auto.note_fallback()  # an earlier fall-back: only a real gain clears the back-off
        observe_many(auto, WARMUP_STEPS, accepted=1.0, scores=scores)
        assert (auto.choose() == 2) is keeps and auto.backoff == 1
    auto = AutoTree({0: 1.0, 2: 1.5}, depth=4, budget=2)
    auto.note_fallback()
    observe_many(auto, WARMUP_STEPS, accepted=1.0, scores=scores)
    assert auto.choose() == 2 and auto.backoff == 0  # (1 + 1) / 1.5 > 1
