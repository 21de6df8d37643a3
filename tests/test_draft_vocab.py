"""Streams that draft from a part of the vocabulary: the same output, the ids where they belong."""

import json
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

from specstream_mlx.convert import ConvertOptions, convert
from specstream_mlx.io.loading import load_model
from specstream_mlx.method.msa import ss_forward, stream_logits
from specstream_mlx.method.streams import (
    DRAFT_VOCAB_KEY,
    StreamConfig,
    load_streams,
    new_streams,
    save_streams,
)
from specstream_mlx.method.tree import Tree, TreeSpec
from specstream_mlx.runtime.drafting import stream_candidates
from specstream_mlx.runtime.sampling import SamplingParams
from specstream_mlx.runtime.speculative import ss_steps
from specstream_mlx.train.draft_vocab import count_reply_tokens, most_frequent
from tests.helpers.tiny_models import copy_model
from tests.test_speculative import GREEDY, check_exact, pretend_trained, take

CLI = [sys.executable, "-m", "specstream_mlx"]


def _ids(vocab: int, n: int, seed: int = 0) -> np.ndarray:
    return np.random.RandomState(seed).permutation(vocab)[:n].astype(np.int32)


@pytest.mark.parametrize("arch", ["llama", "gemma3", "phi3"])
def test_the_head_over_some_rows_gives_those_rows_logits(hf_models, arch):
    _, _, dst = hf_models(arch)
    model, _ = load_model(dst)
    ids = _ids(model.args.vocab_size, 40)
    h = mx.random.normal((1, 5, model.args.hidden_size))
    want = np.array(model.lm_logits(h))[..., ids]
    got = np.array(model.head_rows(mx.array(ids))(h))
    assert got.shape == want.shape and np.abs(got - want).max() < 1e-4


def test_the_head_over_some_rows_of_a_quantized_model(hf_models, tmp_path):
    _, src, _ = hf_models("llama-q")
    dst = convert(str(src), str(tmp_path / "q4"), ConvertOptions(quantize=True, q_bits=4, q_group_size=32))
    model, _ = load_model(dst, dequantize=False)
    assert "Quantized" in type(model.model.embed_tokens if model.args.tie_word_embeddings else model.lm_head).__name__
    ids = _ids(model.args.vocab_size, 33)
    h = mx.random.normal((1, 3, model.args.hidden_size)).astype(model.model.norm.weight.dtype)
    want = np.array(model.lm_logits(h).astype(mx.float32))[..., ids]
    got = np.array(model.head_rows(mx.array(ids))(h).astype(mx.float32))
    assert np.abs(got - want).max() < 1e-2 * max(1.0, np.abs(want).max())


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_ss_equals_ar_drafting_from_part_of_the_vocabulary(hf_models, arch):
    _, _, dst = hf_models(arch)
    model, _ = load_model(dst)
    streams = pretend_trained(new_streams(model, StreamConfig(num_streams=3, stream_layers=2, lora_rank=4)), seed=2)
    streams.use_draft_vocab(model, _ids(model.args.vocab_size, 60, seed=1))
    check_exact(model, streams, 151, seed=11)


def test_drafts_come_from_the_draft_vocabulary_and_its_logits(hf_models, monkeypatch):
    """Every drafted token is a draft-vocabulary id, and the pass's stream logits are the
    head's rows of those ids (the candidates' order maps back through the ids)."""
    _, _, dst = hf_models("llama")
    model, _ = load_model(dst)
    streams = pretend_trained(new_streams(model, StreamConfig(num_streams=3, stream_layers=2, lora_rank=4)))
    ids = _ids(model.args.vocab_size, 25, seed=3)
    full = np.array(stream_logits(model, streams, ss_forward(model, streams, Tree((5, 9, 7), (-1, 0, 1)), 0, None), 1))
    streams.use_draft_vocab(model, ids)
    out = ss_forward(model, streams, Tree((5, 9, 7), (-1, 0, 1)), 0, None)
    part = np.array(stream_logits(model, streams, out, 1))
    assert part.shape == (3, 25) and np.abs(part - full[:, ids]).max() < 1e-4
    cand = stream_candidates(mx.array(part), 4, GREEDY, vocab=streams.draft_vocab)
    want = ids[np.argsort(-part, axis=-1, kind="stable")[:, :4]]
    assert (np.array(cand.top) == want).all()
    import specstream_mlx.runtime.speculative as spec_mod

    drafted, draft_tree = set(), spec_mod.draft_tree

    def spy(*a, **k):
        d = draft_tree(*a, **k)
        drafted.update(int(t) for t in d.tree.tokens[1:])  # the root is the bonus token
        return d

    monkeypatch.setattr(spec_mod, "draft_tree", spy)
    take(ss_steps(model, mx.array([5, 17, 33]), GREEDY, streams=streams, tree=TreeSpec("dynamic", budget=6)), 12)
    assert drafted and drafted <= set(ids.tolist()), sorted(drafted - set(ids.tolist()))


def test_sampled_proposals_spread_over_the_whole_vocabulary():
    """Sampling: the proposal distribution verification compares with is over the whole
    vocabulary, zero outside the draft vocabulary, and the draws are token ids."""
    from specstream_mlx.method.streams import DraftVocab

    ids = mx.array([7, 2, 9], dtype=mx.int32)
    vocab = DraftVocab(ids, 12)
    logits = mx.array([[0.5, 2.0, -1.0], [3.0, 0.0, 0.0]])
    cand = stream_candidates(logits, 2, SamplingParams(temperature=1.0), mx.random.key(0), 64, vocab)
    q = np.array(cand.q)
    assert q.shape == (2, 12)
    want = np.zeros((2, 12))
    want[:, [7, 2, 9]] = np.array(mx.softmax(logits, axis=-1))
    assert np.abs(q - want).max() < 1e-6
    assert set(np.array(cand.drawn).ravel().tolist()) <= {7, 2, 9}
    top = np.array(cand.top).tolist()
    assert top[0] == [2, 7] and top[1][0] == 7


def test_draft_vocabulary_is_saved_loaded_and_checked(hf_models, tmp_path):
    _, _, dst = hf_models("llama")
    model, _ = load_model(dst)
    streams = new_streams(model, StreamConfig(num_streams=2, stream_layers=1, lora_rank=2))
    ids = _ids(model.args.vocab_size, 30)
    streams.use_draft_vocab(model, ids)
    save_streams(streams, tmp_path)
    assert json.loads((tmp_path / "specstream.json").read_text())["draft_vocab"] == 30
    back = load_streams(model, tmp_path)
    assert (np.array(back.draft_vocab.ids) == ids).all() and back.draft_vocab.size == model.args.vocab_size

    def broken(edit_weights=None, edit_cfg=None):
        w = dict(mx.load(str(tmp_path / "streams.safetensors")))
        cfg = json.loads((tmp_path / "specstream.json").read_text())
        if edit_weights:
            edit_weights(w)
        if edit_cfg:
            edit_cfg(cfg)
        d = tmp_path / f"b{len(list(tmp_path.iterdir()))}"
        d.mkdir()
        mx.save_safetensors(str(d / "streams.safetensors"), w)
        (d / "specstream.json").write_text(json.dumps(cfg))
        with pytest.raises(ValueError) as e:
            load_streams(model, d)
        return str(e.value)

    assert "draft_vocab 30" in broken(lambda w: w.pop(DRAFT_VOCAB_KEY))
    assert "draft_vocab 0" in broken(edit_cfg=lambda c: c.update(draft_vocab=0))
    assert "outside the vocabulary" in broken(lambda w: w.update({DRAFT_VOCAB_KEY: mx.array([1] * 29 + [10**6])}))
    assert "repeats" in broken(lambda w: w.update({DRAFT_VOCAB_KEY: mx.array([3] * 30, dtype=mx.int32)}))
    assert "non-negative" in broken(edit_cfg=lambda c: c.update(draft_vocab=-1))


def test_most_frequent_reply_tokens_are_counted_from_the_replies(tiny_model_dir, tmp_path):
    from specstream_mlx.io.loading import load_model_dir

    tok = load_model_dir(tiny_model_dir, warn=False).tokenizer
    data = tmp_path / "train.jsonl"
    rows = [{"prompt": "zzzzzzzz", "completion": "abab"}, {"prompt": "zzzz", "completion": "aac"}]
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    counts = count_reply_tokens(data, tok, 512)
    a, b, c, z = (tok.encode(x, add_special_tokens=False)[0] for x in "abcz")
    assert counts[a] == 4 and counts[b] == 2 and counts[c] == 1 and counts[z] == 0  # prompts are not counted
    top = most_frequent(counts, 2).tolist()
    assert top == [a, b] or (top[0] == a and counts[top[1]] >= counts[b])  # the EOS may tie with b
    assert len(most_frequent(counts, 10_000)) == (counts > 0).sum()  # only tokens that occur
    data.write_text('{"prompt": "x", "completion": 3}\n')
    with pytest.raises(Exception, match=r"train.jsonl:1: "):
        count_reply_tokens(data, tok, 512)


def test_the_command_drafts_from_the_measured_default_size():
    import inspect

    from specstream_mlx.cli.app import draft_vocab_cmd
    from specstream_mlx.train.draft_vocab import DEFAULT_SIZE

    assert inspect.signature(draft_vocab_cmd).parameters["size"].default.default == DEFAULT_SIZE


def test_the_draft_vocab_command_writes_the_streams_and_refuses_bad_input(tiny_model_dir, tmp_path):
    model_dir = copy_model(tiny_model_dir, tmp_path / "m")
    model, _ = load_model(model_dir)
    save_streams(new_streams(model, StreamConfig(num_streams=2, stream_layers=1, lora_rank=2)), model_dir)
    before = {f: (model_dir / f).read_bytes() for f in ("streams.safetensors", "specstream.json")}
    tensors = {k: np.array(v) for k, v in mx.load(str(model_dir / "streams.safetensors")).items()}
    data = tmp_path / "data"
    data.mkdir()
    rows = [{"prompt": "q", "completion": "hello there, hello"}] * 3
    (data / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (data / "valid.jsonl").write_text(json.dumps({"prompt": "q", "completion": "hello you"}) + "\n")

    def run(*args):
        return subprocess.run([*CLI, "draft-vocab", *args], capture_output=True, text=True, timeout=120)

    for args, says in [
        (["--model", str(model_dir), "--data", str(data), "--size", "-1"], "--size"),
        (["--model", str(model_dir), "--data", str(tmp_path / "none")], "train.jsonl is not a file"),
        (["--model", str(model_dir), "--data", str(data), "--size", "100000"], "not smaller than"),
        (["--model", str(tmp_path / "nomodel"), "--data", str(data)], "nomodel"),
    ]:
        r = run(*args, "--write")
        assert r.returncode != 0 and says in r.stderr and "Traceback" not in r.stderr, (args, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert before == {f: (model_dir / f).read_bytes() for f in before}  # nothing written
    r = run("--model", str(model_dir), "--data", str(data), "--size", "4", "--write")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["size"] == 4 and 0 < report["valid_coverage"] < 1 and report["train_coverage"] > 0.5
    streams = load_streams(model, model_dir)
    assert streams.draft_vocab is not None and streams.draft_vocab.ids.size == 4
    doctor = subprocess.run([*CLI, "doctor", "--model", str(model_dir)], capture_output=True, text=True, timeout=120)
    assert f"drafting from 4 of {model.args.vocab_size} token ids" in doctor.stdout, doctor.stdout
    # --size 0 drafts from every entry again; the streams' own tensors stay as they were stored.
    r = run("--model", str(model_dir), "--data", str(data), "--size", "0", "--write")
    assert r.returncode == 0 and load_streams(model, model_dir).draft_vocab is None
    got = {k: np.array(v) for k, v in mx.load(str(model_dir / "streams.safetensors")).items()}
    assert got.keys() == tensors.keys() and all(np.array_equal(got[k], tensors[k]) for k in got)


@pytest.mark.parametrize("arch", ["llama", "phi3"])
def test_a_tokens_logit_from_its_head_row(hf_models, arch):
    _, _, dst = hf_models(arch)
    model, _ = load_model(dst)
    h = mx.random.normal((6, model.args.hidden_size))
    ids = mx.array(_ids(model.args.vocab_size, 6, seed=4))
    want = np.array(model.lm_logits(h))[np.arange(6), np.array(ids)]
    assert np.abs(np.array(model.token_logits(h, ids)) - want).max() < 1e-4


def test_a_tokens_logit_from_a_quantized_head_row(hf_models, tmp_path):
    _, src, _ = hf_models("llama-q")
    dst = convert(str(src), str(tmp_path / "q4"), ConvertOptions(quantize=True, q_bits=4, q_group_size=32))
    model, _ = load_model(dst, dequantize=False)
    h = mx.random.normal((5, model.args.hidden_size)).astype(model.model.norm.weight.dtype)
    ids = mx.array(_ids(model.args.vocab_size, 5, seed=5))
    want = np.array(model.lm_logits(h).astype(mx.float32))[np.arange(5), np.array(ids)]
    got = np.array(model.token_logits(h, ids).astype(mx.float32))
    assert np.abs(got - want).max() < 1e-2 * max(1.0, np.abs(want).max())


def test_early_exit_over_a_draft_vocabulary_prunes_no_more_than_over_the_whole_one(hf_models):
    """Normalised over fewer entries, every transition probability is at least the whole
    vocabulary's: what the whole vocabulary keeps is kept. Over every id (permuted) the
    probabilities are the same, and so is the kept set."""
    from specstream_mlx.method import msa
    from specstream_mlx.method.tree import tree_buffers

    _, _, dst = hf_models("llama")
    model, _ = load_model(dst)
    streams = pretend_trained(new_streams(model, StreamConfig(num_streams=3, stream_layers=2, lora_rank=4)), seed=3)
    rng = np.random.RandomState(0)
    parents = (-1, 0, 0, 1, 1, 2, 3, 4, 5, 6, 6, 7)
    tree = Tree(tuple(int(t) for t in rng.randint(3, 151, len(parents))), parents)
    buf = tree_buffers(parents)
    h = mx.random.normal((1, len(parents), model.args.hidden_size))
    thresholds = [0.002, 0.005, 0.01, 0.02]
    full = [msa._early_exit_keep(model, streams, h, tree, buf, t) for t in thresholds]
    assert any(not k.all() for k in full) and any(k[1:].any() for k in full)  # the thresholds prune
    streams.use_draft_vocab(model, rng.permutation(model.args.vocab_size))
    for t, k in zip(thresholds, full):
        assert (msa._early_exit_keep(model, streams, h, tree, buf, t) == k).all()
    streams.use_draft_vocab(model, _ids(model.args.vocab_size, 20, seed=6))
    for t, k in zip(thresholds, full):
        part = msa._early_exit_keep(model, streams, h, tree, buf, t)
        assert (part | ~k).all()  # a superset of the whole vocabulary's kept nodes
