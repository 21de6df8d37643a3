"""KV cache: growth, trim and commit round-trips."""

import mlx.core as mx
import numpy as np
import pytest

from specstream_mlx.runtime.cache import KVCache, commit_cache, make_cache


def rows(start, n, H=2, D=4):
    # Row r holds the value r everywhere, so gathered rows are easy to read back.
    v = mx.arange(start, start + n, dtype=mx.float32)[None, None, :, None]
    return mx.broadcast_to(v, (1, H, n, D))


def visible(c: KVCache):
    k, _ = c.keys[..., : c.offset, :], None
    return np.array(k[0, 0, :, 0]).tolist()


def test_update_grows_in_chunks_and_keeps_rows():
    c = KVCache()
    c.step = 8
    c.update_and_fetch(rows(0, 5), rows(0, 5))
    assert c.capacity == 8 and c.offset == 5
    k, v = c.update_and_fetch(rows(5, 6), rows(5, 6))
    assert c.capacity == 16 and c.offset == 11
    assert k.shape[2] == 11
    assert visible(c) == list(range(11))


def test_trim_then_rewrite():
    c = KVCache()
    c.update_and_fetch(rows(0, 6), rows(0, 6))
    assert c.trim(2) == 2 and c.offset == 4
    assert c.trim(100) == 4 and c.offset == 0
    c.update_and_fetch(rows(10, 3), rows(10, 3))
    assert visible(c) == [10, 11, 12]


@pytest.mark.parametrize("slots", [[0], [0, 1, 2], [0, 2, 5], [0, 3], []])
def test_commit_gathers_accepted_path(slots):
    c = KVCache()
    c.update_and_fetch(rows(0, 4), rows(0, 4))  # prefix
    c.update_and_fetch(rows(100, 6), rows(100, 6))  # a 6-node tree step
    c.commit(slots if slots == list(range(len(slots))) else mx.array(slots))
    assert c.offset == 4 + len(slots)
    assert visible(c) == [0, 1, 2, 3] + [100 + s for s in slots]
    # Values move with keys.
    assert np.array(c.values[0, 0, 4 : c.offset, 0]).tolist() == [100 + s for s in slots]


def test_commit_then_next_step_overwrites_rejected_rows():
    c = KVCache()
    c.update_and_fetch(rows(0, 2), rows(0, 2))
    c.update_and_fetch(rows(50, 4), rows(50, 4))
    c.commit(mx.array([0, 3]))
    c.update_and_fetch(rows(70, 2), rows(70, 2))
    assert visible(c) == [0, 1, 50, 53, 70, 71]


def test_commit_more_than_step_is_refused():
    c = KVCache()
    c.update_and_fetch(rows(0, 2), rows(0, 2))
    with pytest.raises(ValueError):
        c.commit([0, 1, 2])


def test_model_commit_equals_plain_decoding(hf_models):
    """Run a step of several candidate rows, commit one path: the cache then
    equals the cache of plain decoding of that path."""
    from specstream_mlx.io.loading import load_model

    _, _, dst = hf_models("llama")
    model, _ = load_model(dst)
    prefix = mx.array([[5, 9, 17, 33]])
    plain = make_cache(model)
    model(prefix, cache=plain)
    model(mx.array([[40, 41]]), cache=plain)

    spec = make_cache(model)
    model(prefix, cache=spec)
    # Candidates: 40 (depth 0), 77 (depth 1, child of 40 - rejected), 41 (depth 1, child of 40).
    cand = mx.array([[40, 77, 41]])
    off = 4
    positions = mx.array([[off, off + 1, off + 1]])
    tree = mx.array([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=mx.bool_)
    mask = mx.concatenate([mx.ones((3, off), dtype=mx.bool_), tree], axis=1)
    model(cand, cache=spec, positions=positions, mask=mask)
    commit_cache(spec, [0, 2])
    nxt = mx.array([[60]])
    a = model(nxt, cache=plain)
    b = model(nxt, cache=spec)
    assert spec[0].offset == plain[0].offset == 7
    assert mx.allclose(a, b, atol=1e-5).item()
