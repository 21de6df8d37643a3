"""`train --backend torch`: parity with the MLX pass and objective, and training runs end to end."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_unflatten

from specstream_mlx.io.loading import load_model_dir
from specstream_mlx.method.msa import ss_forward, stream_logits
from specstream_mlx.method.tree import Tree
from specstream_mlx.train import TrainConfig, train
from specstream_mlx.train.data import make_batch
from specstream_mlx.train.objective import Trainable, compute_loss

pytest.importorskip("torch")
from specstream_mlx.train import torch_backend  # noqa: E402


def _load(path):
    """Model and config of a directory without tokenizer files (the parity fixtures have none)."""
    from types import SimpleNamespace

    from specstream_mlx.io.loading import load_model

    model, config = load_model(Path(path))
    return SimpleNamespace(model=model, config=config)


def _randomize(trainable, seed: int) -> None:
    """Non-zero LoRA ``b`` and pruning ``up`` (both start at zero), so every term is exercised."""
    rng = np.random.default_rng(seed)
    flat = [
        (k, mx.array(rng.normal(0, 0.05, v.shape).astype(np.float32)))
        for k, v in tree_flatten(trainable.trainable_parameters())
    ]
    trainable.update(tree_unflatten(flat))


def _trainable(loaded, mode: str, gamma=3, layers=2, seed=0, **kw):
    cfg = TrainConfig(
        mode=mode, num_streams=gamma, stream_layers=layers, lora_rank=4, segment=3, stream_positions=8, **kw
    )
    model = loaded.model
    model.freeze()
    t = Trainable(model, cfg)
    _randomize(t, seed)
    return t, cfg


@pytest.mark.parametrize("variant", ["llama", "qwen2", "qwen3", "llama3-scaled", "mistral-window", "gemma3"])
def test_torch_stream_logits_match_the_mlx_speculative_pass(hf_models, variant):
    """Teacher-forced torch stream logits == the MLX inference pass's stream logits (float32)."""
    _, _, mlx_dir = hf_models(variant)
    loaded = _load(mlx_dir)
    t, _ = _trainable(loaded, "lossless")
    tokens = np.random.default_rng(1).integers(3, loaded.model.args.vocab_size, 11)
    # MLX: a chain tree over the tokens, every node hosting all γ streams, no cache.
    n = len(tokens)
    out = ss_forward(loaded.model, t.streams, Tree(tuple(int(x) for x in tokens), tuple(range(-1, n - 1))), 0, None)
    ref = np.stack([np.array(stream_logits(loaded.model, t.streams, out, i)) for i in range(n)])
    got = torch_backend.teacher_forced_stream_logits(loaded.model, t, loaded.config, tokens[None])[0]
    assert got.shape == ref.shape
    assert np.abs(got - ref).max() < 1e-4
    # And the main logits: the torch block over the HF modules equals the MLX model.
    assert np.abs(np.array(out.main_logits) - _torch_main_logits(loaded, tokens)).max() < 1e-4


def _torch_main_logits(loaded, tokens):
    import torch

    from specstream_mlx.train import torch_objective as tobj

    hf = torch_backend.hf_model_from_mlx(loaded.model, loaded.config)
    params = tobj.TorchTrainable({}, 1.0)
    with torch.no_grad():
        main = tobj.main_pass(hf, params, torch.from_numpy(tokens[None].astype(np.int64)), 1)
        return tobj.lm_logits(hf, main.h_final)[0].numpy()


def _batch(loaded, seed=2):
    from specstream_mlx.train.data import Example

    rng = np.random.default_rng(seed)
    V = loaded.model.args.vocab_size
    exs = [Example(list(rng.integers(3, V, n)), completion_start=c) for n, c in ((20, 6), (14, 3), (17, 9))]
    return make_batch(exs, 24, 8, None)


@pytest.mark.parametrize(
    "variant,mode,isolate",
    [("qwen2", "lossless", False), ("qwen2", "shared", False), ("gemma3", "shared", False), ("qwen2", "shared", True)],
)
def test_torch_objective_matches_mlx_loss_and_gradients(hf_models, variant, mode, isolate):
    """Same loss terms and the same gradients (segment-wise in torch, one graph in MLX);
    gemma3's sequences (14-20 tokens) outrun its window (6)."""
    import mlx.nn as nn

    _, _, mlx_dir = hf_models(variant)
    loaded = _load(mlx_dir)
    t, cfg = _trainable(loaded, mode, isolate_streams=isolate)
    b = _batch(loaded)
    arrays = [mx.array(a) for a in (b.tokens, b.loss_mask, b.stream_pos, b.stream_weight, b.lengths)]
    (loss, m), grads = nn.value_and_grad(t, lambda *a: compute_loss(loaded.model, t, cfg, *a))(*arrays)
    got = torch_backend.backend_metrics(loaded.model, t, cfg, loaded.config, b)
    assert abs(got["metrics"]["loss"] - float(loss)) < 1e-4
    np.testing.assert_allclose(got["metrics"]["stream_acc"], np.array(m["stream_acc"]), atol=1e-6)
    flat = dict(tree_flatten(grads))
    assert set(got["grads"]) == set(flat)
    for k, g in got["grads"].items():
        ref = np.array(flat[k])
        assert np.abs(g - ref).max() <= 1e-4 * max(1.0, np.abs(ref).max()), k


def test_torch_calibration_probabilities_equal_the_mlx_ones(hf_models):
    """The pruning calibration's (B, L, 4) early-exit probabilities of the main stream's four
    best choices, best first: PyTorch's (top-k, chunked) equal MLX's (argsort)."""
    import torch

    from specstream_mlx.train import torch_objective as tobj
    from specstream_mlx.train.calibrate import mlx_top4_probabilities

    _, _, mlx_dir = hf_models("qwen2")
    loaded = _load(mlx_dir)
    t, _ = _trainable(loaded, "lossless")
    tokens = _batch(loaded).tokens
    ref = mlx_top4_probabilities(loaded.model, t.streams, tokens)
    hf = torch_backend.hf_model_from_mlx(loaded.model, loaded.config)
    params = torch_backend.torch_trainable(t, 2.0)
    s0 = len(loaded.model.layers) - 2
    got = tobj.calibration_positions(hf, params, torch.from_numpy(tokens.astype(np.int64)), s0, chunk=5).numpy()
    assert got.shape == ref.shape == (*tokens.shape, 4)
    assert np.abs(got - ref).max() < 1e-5


def test_teacher_targets_equal_the_full_forward_distribution(hf_models):
    """The teacher-forced targets (one table row per distinct sequence and position, as
    the stream loss indexes them) are the reference model's next-token distribution at
    that position, given the same prefix."""
    import torch

    from specstream_mlx.train import torch_objective as tobj

    tm, _, mlx_dir = hf_models("qwen2")
    loaded = _load(mlx_dir)
    t, _ = _trainable(loaded, "lossless")
    hf = torch_backend.hf_model_from_mlx(loaded.model, loaded.config)
    params = torch_backend.torch_trainable(t, 2.0)
    tokens = torch.from_numpy(_batch(loaded).tokens.astype(np.int64))
    with torch.no_grad():
        main = tobj.main_pass(hf, params, tokens, s0=len(loaded.model.layers) - 2)
        ref = torch.softmax(tm(tokens).logits.float(), dim=-1)
    B, L = tokens.shape
    positions = torch.tensor([[[3, 4], [4, 5]], [[0, 1], [L - 1, 3]], [[7, 7], [2, 9]]])  # repeats across streams
    table, rows = tobj.teacher_table(hf, main.h_final, positions)
    assert table.probs.shape[0] == len({(b, p) for b in range(B) for p in positions[b].flatten().tolist()})
    for b in range(B):
        for idx in np.ndindex(*positions.shape[1:]):
            got = table.probs[rows[(b, *idx)]]
            assert torch.allclose(got, ref[b, positions[(b, *idx)]], atol=1e-5)
    q = table.probs
    assert torch.allclose(table.neg_entropy, (q * q.clamp_min(1e-30).log()).sum(-1), atol=1e-5)


@pytest.mark.parametrize("with_teacher", [False, True])
def test_chunked_head_loss_equals_the_whole_vocabulary_loss(with_teacher):
    """The chunked loss (vocabulary-wide tensors for a few rows at a time, gradient taken
    in the forward pass) gives the loss, metrics and gradients of plain autograd over
    the full (rows × V) logits."""
    import torch
    import torch.nn.functional as F

    from specstream_mlx.train.torch_objective import Teacher, head_loss

    g = torch.Generator().manual_seed(0)
    N, h, V, M = 13, 8, 50, 5
    x = torch.randn(N, h, generator=g, requires_grad=True)
    w = torch.randn(V, h, generator=g, requires_grad=True)
    tgt = torch.randint(0, V, (N,), generator=g)
    w_ce = torch.rand(N, generator=g) * (torch.rand(N, generator=g) > 0.2)
    w_kl = torch.rand(N, generator=g) if with_teacher else None
    teacher = torch.log_softmax(torch.randn(M, V, generator=g), -1) if with_teacher else None
    idx = torch.randint(0, M, (N,), generator=g) if with_teacher else None

    logits = x @ w.T
    ce_ref = F.cross_entropy(logits, tgt, reduction="none")
    ref = (w_ce * ce_ref).sum()
    if with_teacher:
        kl_ref = (teacher[idx].exp() * (teacher[idx] - F.log_softmax(logits, -1))).sum(-1)
        ref = ref + (w_kl * kl_ref).sum()
    gx_ref, gw_ref = torch.autograd.grad(ref, (x, w))

    table = Teacher.from_logits(teacher) if with_teacher else None
    loss, ce, kl, hit = head_loss(x, w, tgt, w_ce, w_kl, table, idx, chunk=4)
    gx, gw = torch.autograd.grad(3.0 * loss, (x, w))  # an outer factor reaches both gradients
    assert abs(float(loss.detach()) - float(ref.detach())) < 1e-4
    assert torch.allclose(ce, ce_ref.detach(), atol=1e-5)
    assert torch.equal(hit.bool(), logits.argmax(-1) == tgt)
    if with_teacher:
        assert torch.allclose(kl, kl_ref.detach(), atol=1e-5)
    assert torch.allclose(gx, 3.0 * gx_ref, atol=1e-5)
    assert torch.allclose(gw, 3.0 * gw_ref, atol=1e-5)


def _data_dir(root: Path) -> Path:
    from specstream_mlx.demo.datagen import write_phrase_corpus

    write_phrase_corpus(root / "data", n_keys=6, words_per_phrase=5)
    return root / "data"


def _spy_release(monkeypatch) -> list:
    """The bytes each call of ``release_base_weights`` released, in order."""
    from specstream_mlx.train import torch_backend

    calls, real = [], torch_backend.release_base_weights
    monkeypatch.setattr(torch_backend, "release_base_weights", lambda m: calls.append(real(m)) or calls[-1])
    return calls


def test_torch_backend_trains_and_writes_a_loadable_model(tmp_path, tiny_model_dir, monkeypatch):
    from specstream_mlx import load
    from specstream_mlx.runtime.generation import generate

    data = _data_dir(tmp_path)
    cfg = TrainConfig(
        mode="lossless", num_streams=3, stream_layers=2, lora_rank=4, iters=6, batch_size=4, backend="torch"
    )
    released = _spy_release(monkeypatch)
    res = train(str(tiny_model_dir), str(data), str(tmp_path / "out"), cfg, log=lambda *_: None, progress=False)
    assert res.steps == 6 and res.history and res.tokens_per_second > 0
    # The MLX copy of the frozen base was dropped once the torch copy existed (one copy in memory).
    base_bytes = sum(
        v.nbytes for _, v in tree_flatten(load_model_dir(str(tiny_model_dir), warn=False).model.parameters())
    )
    assert released == [base_bytes]
    log = json.loads((tmp_path / "out" / "training_log.json").read_text())
    assert log["config"]["backend"] == "torch"
    model, tok = load(str(tmp_path / "out"), warn=False, fuse=False)  # the layout as written
    base = load_model_dir(str(tiny_model_dir), warn=False)
    # The streams moved from their initial values; the frozen base did not.
    assert any(np.abs(np.array(v)).max() > 0 for k, v in tree_flatten(model.streams.parameters()) if k.endswith(".b"))
    for (k, a), (_, b) in zip(tree_flatten(model.base.parameters()), tree_flatten(base.model.parameters())):
        assert np.array_equal(np.array(a), np.array(b)), k
    r = generate(model, tok, "abc", max_tokens=12, mode="ss", tree="dynamic:12")  # a tree, never plain
    assert r.tokens == generate(model, tok, "abc", max_tokens=12, mode="ar").tokens


def test_torch_backend_shared_mode_fuses_its_lora_and_stays_exact(tmp_path, tiny_model_dir, monkeypatch):
    """Shared mode through the torch backend: the base LoRA trained in torch is fused into the
    written base weights, and greedy ss still equals ar on the result."""
    from specstream_mlx import load
    from specstream_mlx.runtime.generation import generate

    data = _data_dir(tmp_path)
    cfg = TrainConfig(
        mode="shared", num_streams=2, stream_layers=1, lora_rank=4, iters=4, batch_size=4, backend="torch"
    )
    released = _spy_release(monkeypatch)
    train(str(tiny_model_dir), str(data), str(tmp_path / "out"), cfg, log=lambda *_: None, progress=False)
    assert released == []  # the base LoRA is fused into the MLX weights at the end: they stay
    model, tok = load(str(tmp_path / "out"), warn=False, fuse=False)  # the layout as written
    base = load_model_dir(str(tiny_model_dir), warn=False)
    changed = [
        k
        for (k, a), (_, b) in zip(tree_flatten(model.base.parameters()), tree_flatten(base.model.parameters()))
        if not np.array_equal(np.array(a), np.array(b))
    ]
    assert any("q_proj" in k for k in changed), changed
    assert (
        generate(model, tok, "abc", max_tokens=12, mode="ss", tree="dynamic:12").tokens
        == generate(model, tok, "abc", max_tokens=12, mode="ar").tokens
    )


def test_torch_resume_equals_an_uninterrupted_run(tmp_path, tiny_model_dir, monkeypatch):
    """Interrupted at step 3 and resumed: the same weights as 6 steps in one go (Adam state restored);
    the MLX backend refuses the torch checkpoint with one clear error."""
    import specstream_mlx.train.loop as T
    from specstream_mlx.train import TrainError
    from tests.test_training import _interrupt_at_batch

    data = _data_dir(tmp_path)
    kw = dict(mode="lossless", num_streams=2, stream_layers=1, lora_rank=4, iters=6, batch_size=4, stream_positions=4)
    quiet = dict(progress=False, log=lambda *_: None)
    train(str(tiny_model_dir), str(data), str(tmp_path / "whole"), TrainConfig(backend="torch", **kw), **quiet)
    real = _interrupt_at_batch(monkeypatch, 3)
    res = train(str(tiny_model_dir), str(data), str(tmp_path / "r"), TrainConfig(backend="torch", **kw), **quiet)
    assert res.interrupted and res.steps == 3
    monkeypatch.setattr(T, "iterate_batches", real)
    with pytest.raises(TrainError, match="torch backend"):
        train(str(tiny_model_dir), str(data), str(tmp_path / "r"), TrainConfig(**kw), resume=True, **quiet)
    res = train(
        str(tiny_model_dir), str(data), str(tmp_path / "r"), TrainConfig(backend="torch", **kw), resume=True, **quiet
    )
    assert res.steps == 6 and not res.interrupted
    whole = mx.load(str(tmp_path / "whole" / "streams.safetensors"))
    resumed = mx.load(str(tmp_path / "r" / "streams.safetensors"))
    for k in whole:
        assert np.abs(np.array(whole[k]) - np.array(resumed[k])).max() < 1e-5, k


class _RankZeroOfTwo:
    """An accelerator of two processes as rank 0 sees it, in one process: each collective
    returns what this rank holds (the other rank agrees), every call recorded."""

    process_index, num_processes, is_main_process = 0, 2, True

    def __init__(self):
        import torch

        self.device = torch.device("cpu")
        self.calls = []

    def reduce(self, tensor, reduction):
        self.calls.append("reduce")
        return tensor

    def gather(self, tensor):
        import torch

        self.calls.append("gather")
        return torch.cat([tensor, tensor])

    def wait_for_everyone(self):
        self.calls.append("wait")

    def end_training(self):
        self.calls.append("end")


def test_every_rank_ends_the_process_group_after_its_last_collective(tmp_path, tiny_model_dir, monkeypatch):
    """A multi-process run ends the group on every rank right after the agreement's barrier,
    before the main process evaluates and writes (no collective after it): a rank that exited
    with gloo's group alive aborted in the interpreter's teardown now and then, failing the
    launch after a finished run. A rank whose run fails ends the group too."""
    from specstream_mlx.train import TrainError, trainer

    data = _data_dir(tmp_path)
    kw = dict(mode="lossless", num_streams=2, stream_layers=1, lora_rank=4, iters=3, batch_size=4)
    quiet = dict(progress=False, log=lambda *_: None)
    acc = _RankZeroOfTwo()
    monkeypatch.setattr(trainer, "_torch_accelerator", lambda: acc)
    real_finish = trainer._finish
    monkeypatch.setattr(trainer, "_finish", lambda *a: acc.calls.append("write") or real_finish(*a))
    res = train(str(tiny_model_dir), str(data), str(tmp_path / "out"), TrainConfig(backend="torch", **kw), **quiet)
    assert res.written and res.steps == 3
    assert acc.calls == ["reduce"] * 3 + ["gather", "wait", "end", "write"]

    acc.calls.clear()

    def failing(run, step):
        raise TrainError("a failing rank")

    monkeypatch.setattr(torch_backend, "run_epochs", failing)
    with pytest.raises(TrainError, match="a failing rank"):
        train(str(tiny_model_dir), str(data), str(tmp_path / "again"), TrainConfig(backend="torch", **kw), **quiet)
    assert acc.calls == ["end"]


@pytest.mark.skipif(
    shutil.which("accelerate", path=str(Path(sys.executable).parent)) is None, reason="needs accelerate"
)
def test_accelerate_launch_two_cpu_processes(tmp_path, tiny_model_dir):
    """Two CPU processes under `accelerate launch` (torchrun; accelerate 1.x's `--cpu` starts one
    process unless given an MPI host file) train one model, averaging gradients, written once.

    Every rank ends with gloo's threads gone: a group that outlived destroy_process_group
    (bound by a module imported after it formed) kept them running into the interpreter's
    teardown, where they aborted a finished launch now and then. The CLI runs under a
    wrapper that names the process's threads at exit, after every other exit handler."""
    data = _data_dir(tmp_path)
    out = tmp_path / "out"
    wrapper = tmp_path / "cli_naming_threads_at_exit.py"
    wrapper.write_text(
        "import atexit, os, runpy, sys\n"
        "def report():\n"
        "    names = []\n"
        "    for t in os.listdir('/proc/self/task'):\n"
        "        try:\n"
        "            names.append(open(f'/proc/self/task/{t}/comm').read().strip())\n"
        "        except OSError:  # a thread that ended since the listing\n"
        "            pass\n"
        "    sys.stderr.write(f\"\\n[threads at exit] rank {os.environ['RANK']}: {' '.join(sorted(names))}\\n\")\n"
        "atexit.register(report)\n"
        "runpy.run_module('specstream_mlx', run_name='__main__', alter_sys=True)\n"
    )
    exe = str(Path(sys.executable).parent / "accelerate")
    env = dict(os.environ, OMP_NUM_THREADS="1", TRANSFORMERS_VERBOSITY="error")
    cmd = [
        exe,
        "launch",
        "--multi_gpu",
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        str(wrapper),
        "train",
        "--backend",
        "torch",
        "--model",
        str(tiny_model_dir),
        "--data",
        str(data),
        "--out",
        str(out),
        "--mode",
        "lossless",
        "--num-streams",
        "2",
        "--stream-layers",
        "1",
        "--lora-rank",
        "4",
        "--iters",
        "3",
        "--batch-size",
        "4",
        "--export-hf",
        str(tmp_path / "hf"),
    ]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "(2 processes)" in p.stderr
    assert "the 2 processes agree on the trained weights" in p.stderr
    assert p.stderr.count("[train] wrote") == 1  # only the main process writes
    assert json.loads((out / "training_log.json").read_text())["config"]["backend"] == "torch"
    # The wrapper writes its reports on lines of their own (a progress bar may precede them).
    at_exit = sorted(line for line in p.stderr.splitlines() if line.startswith("[threads at exit]"))
    assert [line.split(":")[0] for line in at_exit] == ["[threads at exit] rank 0", "[threads at exit] rank 1"]
    assert not [line for line in at_exit if "gloo" in line], at_exit
    # --export-hf: the Hugging Face layout, written once, loadable by transformers.
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert hf.config.model_type == "llama"
