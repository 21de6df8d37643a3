"""Telling a greedy ss/ar reply pair that parts at a tie of the two best logits (rounding's
choice) from one that parts anywhere else (a defect)."""

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from specstream_mlx.demo.tiny import tiny_config
from specstream_mlx.models import build_model
from specstream_mlx.runtime.ties import divergence, first_difference, is_rounding_tie


def test_a_tie_is_two_logits_within_a_few_float32_spacings_of_the_best():
    best = np.float32(32.25406)
    below = np.nextafter(best, np.float32(0))  # one spacing under: the BFCL item's pair
    logits = np.array([1.0, best, below, 32.0, best - np.float32(1e-3)], dtype=np.float32)
    assert is_rounding_tie(logits, 1, 2) and is_rounding_tie(logits, 2, 1)
    assert not is_rounding_tie(logits, 1, 3)  # a quarter apart
    assert not is_rounding_tie(logits, 1, 4)  # 1e-3 apart: hundreds of spacings
    assert not is_rounding_tie(logits, 2, 0)


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2


def _random_model():
    mx.random.seed(3)
    m = build_model(tiny_config(num_hidden_layers=2))
    flat = [(k, mx.random.normal(v.shape) * 0.3 if v.ndim > 1 else v) for k, v in tree_flatten(m.parameters())]
    m.update(tree_unflatten(flat))
    mx.eval(m.parameters())
    return m


def test_divergence_tells_a_tie_from_a_real_difference():
    prompt = [1, 7, 9, 4]
    m = _random_model()
    greedy = []
    for _ in range(6):  # the model's own greedy reply, one forward per token
        greedy.append(int(mx.argmax(m(mx.array([prompt + greedy]))[0, -1]).item()))
    # A twin of the reply's fourth token: another id given its (tied) embedding row gets the
    # same logit wherever it is not in the context itself, an exact tie with the best.
    best = greedy[3]
    twin = next(t for t in range(10, 100) if t not in prompt + greedy)
    tied = _random_model()
    emb = tied.model.embed_tokens.weight
    tied.model.embed_tokens.weight = mx.concatenate([emb[:twin], emb[best : best + 1], emb[twin + 1 :]])
    d = divergence(tied, prompt, greedy, greedy[:3] + [twin] + greedy[4:])
    assert d.position == 3 and d.tie and d.gap == 0.0
    # The token the logits rank last is a real difference.
    worst = int(np.argmin(np.array(m(mx.array([prompt + greedy[:3]]))[0, -1])))
    d = divergence(m, prompt, greedy, greedy[:3] + [worst] + greedy[4:])
    assert d.position == 3 and not d.tie and d.gap > 0
    # One reply stopping earlier is not a tie; equal replies do not part.
    d = divergence(m, prompt, greedy, greedy[:4])
    assert d.position == 4 and not d.tie and d.gap is None
    assert divergence(m, prompt, greedy, list(greedy)) is None


def test_eval_bfcl_counts_the_mismatches_that_part_at_a_tie(monkeypatch):
    """`eval-bfcl` reports how many ss/ar mismatches part at a tie (rounding's choice) beside
    the mismatches themselves, in its JSON, its table and its report."""
    from specstream_mlx.runtime import generation, ties
    from specstream_mlx.runtime.ties import Divergence
    from specstream_mlx.tasks import evaluate as E

    rows = E.spread(E.bfcl_test_rows(), 3)
    replies = {"ar": [5, 6, 7], "ss": [5, 6, 8]}
    monkeypatch.setattr(E, "decode_reply", lambda m, t, msgs, mode, tree, n: ("x", replies[mode], _Stats(), False))
    monkeypatch.setattr(generation, "encode_prompt", lambda tok, msgs: [1, 2])
    verdicts = iter([Divergence(2, True, 0.0), Divergence(2, False, 3.5), Divergence(2, True, -1e-6)])
    monkeypatch.setattr(ties, "divergence", lambda model, prompt, a, b: next(verdicts))
    report = E.evaluate(object(), None, rows, ("ar", "ss"), "auto", 8, "m")
    assert report.mismatches == 3 and report.mismatch_ties == 2
    assert report.to_json()["ss_ar_mismatches_at_ties"] == 2
    assert "| 3 (2 at ties) |" in E.format_table([report])
    assert "2 of them part where the two best logits are tied" in E.format_report(report)


class _Stats:
    forward_passes = 3
    tokens_per_pass = 1.0
    generation_seconds = 0.1
    prompt_tokens = 2
    prompt_seconds = 0.01


def test_bench_says_which_greedy_replies_part_from_ar_at_a_tie():
    """`bench`'s "equals ar" column: a reply that parts from ar's at a tie is reported as
    such, any other difference as NO (the tie checked in a forward of the model)."""
    from specstream_mlx.bench.report import _equals_ar
    from specstream_mlx.bench.runner import BenchSetup, Run, _summarize

    prompt = [1, 7, 9, 4]
    m = _random_model()
    greedy = []
    for _ in range(6):
        greedy.append(int(mx.argmax(m(mx.array([prompt + greedy]))[0, -1]).item()))
    best, twin = greedy[3], next(t for t in range(10, 100) if t not in prompt + greedy)
    emb = m.model.embed_tokens.weight
    m.model.embed_tokens.weight = mx.concatenate([emb[:twin], emb[best : best + 1], emb[twin + 1 :]])
    worst = int(np.argmin(np.array(m(mx.array([prompt + greedy[:3]]))[0, -1])))

    def run(tokens):
        return Run(tokens=tokens, text="", ttft=0.01, tps=10.0, passes=len(tokens), peak_gb=0.1)

    setup = BenchSetup([{"prompt": "x"}], [prompt], 6, 0.7, 0)
    tied, other = greedy[:3] + [twin] + greedy[4:], greedy[:3] + [worst] + greedy[4:]
    for ss, lookup, want_ss, want_lookup in [
        ([tied, greedy], [greedy, greedy], "at ties only (1)", "yes"),
        ([tied, other], [other, greedy], "NO (1 of 2 at ties)", "NO"),
    ]:
        runs = {"ar": [run(greedy)] * 2, "ar@0.7": [run(greedy)] * 2, "ss": [run(t) for t in ss]}
        runs["lookup"] = [run(t) for t in lookup]
        res = {r.method: r for r in _summarize(runs, setup, [2], m)}
        assert _equals_ar(vars(res["ss"])) == want_ss and _equals_ar(vars(res["lookup"])) == want_lookup
