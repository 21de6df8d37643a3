"""The bundled demo models: present, small, trained, and exact under ss."""

import json

import pytest

from specstream_mlx import load
from specstream_mlx.io.loading import bundled_models_dir
from specstream_mlx.method.tree import TreeSpec
from specstream_mlx.runtime.generation import generate

NAMES = ["demo-sql", "demo-sql-baseline", "demo-sql-draft", "demo-chat", "demo-chat-draft"]


@pytest.mark.parametrize("name", NAMES)
def test_bundled_model_is_small_and_loads(name):
    d = bundled_models_dir() / name
    size = sum(f.stat().st_size for f in d.iterdir() if f.is_file())
    assert size <= 25e6, f"{name} is {size / 1e6:.1f} MB"
    model, tok = load(name, warn=False)
    has_streams = (d / "specstream.json").exists()
    assert has_streams == (name in ("demo-sql", "demo-chat"))
    if has_streams:
        assert json.loads((d / "specstream.json").read_text())["trained"] is True


@pytest.mark.parametrize("name", ["demo-sql", "demo-chat"])
def test_bundled_ss_equals_ar(name):
    model, tok = load(name)
    rows = [json.loads(l) for l in (bundled_models_dir() / name / "bench_prompts.jsonl").read_text().splitlines()][:3]
    taus = []
    for r in rows:
        ss = generate(model, tok, r["prompt"], max_tokens=48, mode="ss", tree=TreeSpec("dynamic", budget=12))
        ar = generate(model, tok, r["prompt"], max_tokens=48, mode="ar")
        assert ss.tokens == ar.tokens
        taus.append(ss.stats.tokens_per_pass)
    # Trained streams: clearly more than one token per pass (untrained ones give ~1.0).
    assert sum(taus) / len(taus) > 1.2
