"""Converted models match the transformers reference: logits and greedy tokens."""

import mlx.core as mx
import numpy as np
import pytest
import torch

from specstream_mlx.io.loading import load_model
from specstream_mlx.runtime.sampling import SamplingParams
from specstream_mlx.runtime.steps import ar_steps
from tests.helpers.hf_reference import VARIANTS


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers(hf_models, variant):
    tm, _, dst = hf_models(variant)
    model, _ = load_model(dst)
    ids = np.random.RandomState(1).randint(3, 151, size=(3, 37))
    with torch.no_grad():
        ref = tm(torch.tensor(ids)).logits.numpy()
    out = np.array(model(mx.array(ids)))
    rel = np.abs(out - ref).max() / np.abs(ref).max()
    assert rel < 1e-4, f"{variant}: relative logit error {rel:.2e}"


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_tokens_match_transformers(hf_models, variant):
    tm, _, dst = hf_models(variant)
    model, _ = load_model(dst)
    tm.generation_config.eos_token_id = None
    rng = np.random.RandomState(2)
    for length in (5, 23):
        prompt = rng.randint(3, 151, size=length).tolist()
        with torch.no_grad():
            ref = tm.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False, pad_token_id=0)[
                0, length:
            ].tolist()
        steps = ar_steps(model, mx.array(prompt), SamplingParams())
        ours = [next(steps).tokens[0] for _ in range(32)]
        assert ours == ref, f"{variant}: greedy tokens differ from transformers"


def test_cached_decoding_matches_full_forward(hf_models):
    """Chunked prefill plus one-token steps give the logits of one full pass."""
    from specstream_mlx.runtime.cache import make_cache

    _, _, dst = hf_models("qwen3")
    model, _ = load_model(dst)
    ids = mx.array(np.random.RandomState(3).randint(3, 151, size=(1, 30)))
    full = model(ids)
    cache = make_cache(model)
    parts = [model(ids[:, :17], cache=cache)]
    for t in range(17, 30):
        parts.append(model(ids[:, t : t + 1], cache=cache))
    step = mx.concatenate(parts, axis=1)
    assert mx.allclose(full, step, atol=1e-4).item()
