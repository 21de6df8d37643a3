"""Lossless training on cached frozen features: the same objective, a top-k teacher, rows
that survive a kill, and a training run that equals the uncached one."""

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from specstream_mlx.train import TrainConfig, train
from specstream_mlx.train.data import Example, make_batch

pytest.importorskip("torch")
import torch  # noqa: E402

from specstream_mlx.train import torch_backend  # noqa: E402
from specstream_mlx.train import torch_objective as tobj  # noqa: E402
from specstream_mlx.train.feature_cache import CacheSpec, FeatureCache  # noqa: E402
from tests.test_torch_backend import _load, _trainable  # noqa: E402

QUIET = dict(log=lambda *_: None, progress=False)


def _examples(vocab: int, seed: int = 3):
    rng = np.random.default_rng(seed)
    lens = ((20, 6), (14, 3), (17, 9), (23, 2), (9, 1))
    return [Example(list(map(int, rng.integers(3, vocab, n))), completion_start=c) for n, c in lens]


def _objective(hf, params, cfg, batch, s0, extra=None):
    """Metrics and gradients of one batch (fresh gradients)."""
    for name in params.names:
        params.get(name).grad = None
    rows = torch_backend._batch_tensors(batch, 0, 1)
    rows.update(extra or {})
    metrics = tobj.backward_segments(hf, params, cfg, rows, s0)
    grads = {n: params.get(n).grad.clone() for n in params.names if params.get(n).grad is not None}
    return metrics, grads


@pytest.mark.parametrize("variant", ["qwen2", "gemma3"])
def test_cached_objective_equals_the_uncached_one(hf_models, tmp_path, variant):
    """With the whole vocabulary kept, loss, metrics and gradients on cached features equal
    the uncached objective's (float32) on a fixed batch; gemma3's sequences outrun its window."""
    _, _, mlx_dir = hf_models(variant)
    loaded = _load(mlx_dir)
    t, cfg = _trainable(loaded, "lossless")
    hf = torch_backend.hf_model_from_mlx(loaded.model, loaded.config)
    params = torch_backend.torch_trainable(t, cfg.lora_scale)
    s0 = len(loaded.model.layers) - cfg.stream_layers
    V = loaded.model.args.vocab_size
    exs = _examples(V)
    cache = FeatureCache(hf, exs, CacheSpec("base", s0, "float32", 10**9), tmp_path)
    assert cache.k == V
    index = np.array([3, 0, 2])
    batch = make_batch([exs[i] for i in index], 24, 8, None, index)
    ref, ref_grads = _objective(hf, params, cfg, batch, s0)
    got, got_grads = _objective(hf, params, cfg, batch, s0, cache.batch(index, 24))
    assert abs(got["loss"] - ref["loss"]) < 1e-4
    for key in ("stream_ce", "stream_kl", "stream_acc"):
        np.testing.assert_allclose(got[key], ref[key], atol=1e-4)
    assert set(got_grads) == set(ref_grads)
    for k, g in ref_grads.items():
        assert (got_grads[k] - g).abs().max() <= 1e-4 * max(1.0, float(g.abs().max())), k
    # A small top-k keeps less mass: the KL term moves, the data term does not.
    small = FeatureCache(hf, exs, CacheSpec("base", s0, "float32", 3), tmp_path)
    assert small.root != cache.root and small.k == 3
    top3, _ = _objective(hf, params, cfg, batch, s0, small.batch(index, 24))
    np.testing.assert_allclose(top3["stream_ce"], ref["stream_ce"], atol=1e-4)
    assert not np.allclose(top3["stream_kl"], ref["stream_kl"], atol=1e-3)


def test_top_k_teacher_loss_and_gradients_equal_autograd():
    """The KL over the teacher's kept mass, Σ_K q (log q − log p), and its gradients in the
    chunked loss equal plain autograd over the full logits."""
    import torch.nn.functional as F

    from specstream_mlx.train.torch_objective import Teacher, head_loss

    g = torch.Generator().manual_seed(0)
    N, h, V, M, k = 13, 8, 50, 5, 7
    x = torch.randn(N, h, generator=g, requires_grad=True)
    w = torch.randn(V, h, generator=g, requires_grad=True)
    tgt = torch.randint(0, V, (N,), generator=g)
    w_ce = torch.rand(N, generator=g)
    w_kl = torch.rand(N, generator=g) * (torch.rand(N, generator=g) > 0.2)
    logq_full = torch.log_softmax(3 * torch.randn(M, V, generator=g), -1)
    logq, ids = logq_full.topk(k, -1)
    logq[M - 1] = -float("inf")  # a padding row keeps no mass
    idx = torch.randint(0, M, (N,), generator=g)

    logits = x @ w.T
    logp = F.log_softmax(logits, -1)
    q = logq[idx].exp()
    kl_ref = (q * (logq[idx].clamp_min(-1e30) - logp.gather(-1, ids[idx]))).sum(-1)
    ce_ref = F.cross_entropy(logits, tgt, reduction="none")
    ref = (w_ce * ce_ref + w_kl * kl_ref).sum()
    gx_ref, gw_ref = torch.autograd.grad(ref, (x, w))

    table = Teacher.from_top_logprobs(ids, logq)
    assert torch.allclose(table.mass[: M - 1], logq[: M - 1].exp().sum(-1)) and float(table.mass[M - 1]) == 0
    loss, ce, kl, _ = head_loss(x, w, tgt, w_ce, w_kl, table, idx, chunk=4)
    gx, gw = torch.autograd.grad(2.0 * loss, (x, w))
    assert abs(float(loss.detach()) - float(ref.detach())) < 1e-4
    assert torch.allclose(kl, kl_ref.detach(), atol=1e-5)
    assert torch.allclose(gx, 2.0 * gx_ref, atol=1e-5)
    assert torch.allclose(gw, 2.0 * gw_ref, atol=1e-5)


def test_filled_rows_survive_a_restart_and_are_never_recomputed(hf_models, tmp_path, monkeypatch):
    """Sequences are filled on first use, one main pass for a batch's missing ones; a cache
    opened again (a killed run restarted) keeps the marked rows, computes only what is
    missing, and holds what a cache filled in one go holds. Rows written but not marked
    (killed in between) are computed again."""
    from specstream_mlx.train import feature_cache as fc

    _, _, mlx_dir = hf_models("qwen2")
    loaded = _load(mlx_dir)
    hf = torch_backend.hf_model_from_mlx(loaded.model, loaded.config)
    exs = _examples(loaded.model.args.vocab_size) * 2  # 10 sequences
    spec = CacheSpec("base", 2, "float32", 5)
    whole = FeatureCache(hf, exs, spec, tmp_path / "a")
    assert whole.fill(range(10)) == 10 and whole.fill([3]) == 0

    passes, real = [], tobj.main_pass
    monkeypatch.setattr(fc.tobj, "main_pass", lambda *a: passes.append(a[2].shape[0]) or real(*a))
    first = FeatureCache(hf, exs, spec, tmp_path / "b")
    first.batch(np.array([0, 4, 4, 7]), 24)
    assert passes == [3]
    calls, top_k = [], fc.teacher_top_k

    def killed_at_the_second(*a):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return top_k(*a)

    monkeypatch.setattr(fc, "teacher_top_k", killed_at_the_second)
    with pytest.raises(KeyboardInterrupt):  # killed while writing the rows of 1 and 2
        first.fill([1, 2])
    monkeypatch.setattr(fc, "teacher_top_k", top_k)
    passes.clear()
    again = FeatureCache(hf, exs, spec, tmp_path / "b")
    assert again.filled.sum() == 3
    assert again.fill(range(10)) == 7 and passes == [7]
    # The same rows as one fill of everything; batches of other widths round differently
    # in the last bits (other matrix shapes), a row never written would be zeros.
    assert np.array_equal(whole.ids.rows(), again.ids.rows())
    for a, b in ((whole.h, again.h), (whole.logq, again.logq)):
        np.testing.assert_allclose(a.rows(), b.rows(), rtol=1e-5, atol=1e-5)
    passes.clear()
    assert FeatureCache(hf, exs, spec, tmp_path / "b").fill(range(10)) == 0 and passes == []
    # Other tokens are another cache, never these rows.
    assert FeatureCache(hf, exs[:-1], spec, tmp_path / "b").root != again.root


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs Linux's /proc/self/maps")
def test_the_cache_is_not_mapped_into_the_process(hf_models, tmp_path):
    """Filling and reading leave no mapping of the cache's files: a memory map counted every
    page a run had touched in its resident set (SmolLM2's 800-step build peaked at 5.96 GB,
    about 4 GB of it the cache's pages), where reads and writes at offsets leave them to the
    page cache."""
    _, _, mlx_dir = hf_models("qwen2")
    loaded = _load(mlx_dir)
    hf = torch_backend.hf_model_from_mlx(loaded.model, loaded.config)
    cache = FeatureCache(hf, _examples(loaded.model.args.vocab_size), CacheSpec("base", 2, "bfloat16", 5), tmp_path)
    feats = cache.batch(np.array([0, 3]), 24)
    assert cache.filled[[0, 3]].all() and feats["h_s0"].abs().sum() > 0
    mapped = [line for line in Path("/proc/self/maps").read_text().splitlines() if str(cache.root) in line]
    assert mapped == []


def test_training_on_cached_features_equals_training_without(tmp_path, tiny_model_dir):
    """`train --cached-features` with the whole vocabulary kept trains the same streams as the
    uncached run (same batches, same objective); the cache lands where it is told."""
    from tests.test_torch_backend import _data_dir

    data = _data_dir(tmp_path)
    kw = dict(mode="lossless", num_streams=2, stream_layers=1, lora_rank=4, iters=4, batch_size=4, backend="torch")
    train(str(tiny_model_dir), str(data), str(tmp_path / "plain"), TrainConfig(**kw), **QUIET)
    cached = TrainConfig(**kw, cached_features=True, teacher_top_k=10**9, feature_cache=str(tmp_path / "feat"))
    train(str(tiny_model_dir), str(data), str(tmp_path / "cached"), cached, **QUIET)
    assert any(Path(tmp_path / "feat").glob("*/hidden.bin"))
    a = mx.load(str(tmp_path / "plain" / "streams.safetensors"))
    b = mx.load(str(tmp_path / "cached" / "streams.safetensors"))
    for k in a:
        assert np.abs(np.array(a[k]) - np.array(b[k])).max() < 1e-4, k


def test_cached_features_need_a_frozen_base_and_the_torch_backend():
    with pytest.raises(ValueError, match="cached-features"):
        TrainConfig(mode="shared", backend="torch", cached_features=True)
    with pytest.raises(ValueError, match="cached-features"):
        TrainConfig(mode="lossless", cached_features=True)
