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
