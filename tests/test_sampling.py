import math

import mlx.core as mx
import numpy as np
import pytest

from specstream_mlx.runtime.sampling import KeyStream, SamplingParams, sample_token, target_logprobs


def probs(logits, **kw):
    return np.exp(np.array(target_logprobs(mx.array(logits), SamplingParams(temperature=1.0, **kw))))


def test_temperature_only_is_softmax():
    lg = [1.0, 2.0, 0.5, -1.0]
    p = probs(lg)
    ref = np.exp(lg) / np.exp(lg).sum()
    assert np.allclose(p, ref, atol=1e-6)


def test_top_k_keeps_k_largest():
    p = probs([1.0, 3.0, 2.0, 0.0], top_k=2)
    assert p[0] == 0 and p[3] == 0
    assert math.isclose(p[1] + p[2], 1.0, rel_tol=1e-6)


def test_top_p_keeps_smallest_nucleus():
    # softmax of log([.5,.3,.15,.05]): top_p=0.7 keeps the first two (0.5 < 0.7, then 0.8 >= 0.7).
    lg = np.log([0.5, 0.3, 0.15, 0.05]).tolist()
    p = probs(lg, top_p=0.7)
    assert np.allclose(p, [0.5 / 0.8, 0.3 / 0.8, 0, 0], atol=1e-6)
    # The most likely token always stays.
    p = probs(lg, top_p=0.1)
    assert np.allclose(p, [1, 0, 0, 0])


def test_greedy_is_argmax_and_sampling_is_seeded():
    lg = mx.array([[0.1, 5.0, 0.3]])
    assert sample_token(lg, SamplingParams(), None).item() == 1
    flat = mx.zeros((1, 50))
    a = [sample_token(flat, SamplingParams(temperature=1.0), k).item() for k in _keys(7, 20)]
    b = [sample_token(flat, SamplingParams(temperature=1.0), k).item() for k in _keys(7, 20)]
    c = [sample_token(flat, SamplingParams(temperature=1.0), k).item() for k in _keys(8, 20)]
    assert a == b and a != c


def _keys(seed, n):
    ks = KeyStream(seed)
    return [ks.next() for _ in range(n)]


def test_invalid_params_are_refused():
    with pytest.raises(ValueError):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError):
        SamplingParams(top_p=0)
