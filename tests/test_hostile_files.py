"""Hostile model files: bounded loading, one-line refusals, no data loss with --force, and a
model's own template or tokenizer that cannot take a server down (docs/SECURITY.md)."""

import json
import os
import re
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.tiny_models import copy_model

CLI = [sys.executable, "-m", "specstream_mlx"]
MEMORY_LIMIT = 3 << 30  # a refusal needs a few hundred MB; reading /dev/zero would need all


def _limited():
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))


def _start(args, **kw):
    return subprocess.Popen(
        [*CLI, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=_limited, **kw
    )


def _finish(proc, timeout=120):
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def _assert_one_line(rc, err, *needles):
    errors = [line for line in err.splitlines() if "error:" in line]
    assert rc not in (0, None) and "Traceback" not in err, err[-2000:]
    assert len(errors) == 1, err[-2000:]
    for n in needles:
        assert n in errors[0], errors[0]


def _edit_config(d: Path, **changes):
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))


@pytest.fixture()
def model(tmp_path, tiny_model_dir):
    return copy_model(tiny_model_dir, tmp_path / "m", streams=False)


def test_unbounded_files_are_refused_under_a_memory_limit(tmp_path, tiny_model_dir):
    """/dev/zero as config.json or tokenizer.json, a FIFO as config.json, and a config asking
    for 100,000 layers (or 8 where the weights hold 4): one line each, quickly, with memory
    limited to 3 GB (before, they read until MemoryError, hung, or built every layer)."""
    cases = {}

    def case(name, edit, *needles):
        d = copy_model(tiny_model_dir, tmp_path / name, streams=False)
        edit(d)
        cases[name] = (d, needles)

    def dev_zero(f):
        def edit(d):
            (d / f).unlink()
            (d / f).symlink_to("/dev/zero")

        return edit

    def fifo(d):
        (d / "config.json").unlink()
        os.mkfifo(d / "config.json")

    case("zero-config", dev_zero("config.json"), "config.json", "outside the model directory")
    case("zero-tokenizer", dev_zero("tokenizer.json"), "tokenizer.json", "outside the model directory")
    case("fifo-config", fifo, "config.json", "not a regular file")
    case("layers-100000", lambda d: _edit_config(d, num_hidden_layers=100000), "num_hidden_layers", "limit")
    case("layers-8", lambda d: _edit_config(d, num_hidden_layers=8), "num_hidden_layers", "hold 4 layers")
    t0 = time.monotonic()
    procs = {n: _start(["generate", "--model", str(d), "--prompt", "hi", "-m", "1"]) for n, (d, _) in cases.items()}
    for name, proc in procs.items():
        rc, _, err = _finish(proc)
        _assert_one_line(rc, err, *cases[name][1])
    assert time.monotonic() - t0 < 90


def test_oversized_values_and_bad_files_are_one_line(model, tmp_path):
    """Overflowing sizes, deep nesting, a null shard, a symlink leading outside, a huge template:
    ModelLoadError / ConvertError naming the file (before: OverflowError, RecursionError,
    TypeError tracebacks, or a file outside the directory read)."""
    from specstream_mlx.convert import ConvertError, ConvertOptions, convert
    from specstream_mlx.io.loading import ModelLoadError, load_model_dir

    cfg = json.loads((model / "config.json").read_text())

    def refused(edit, *needles, load=True):
        d = copy_model(model, tmp_path / f"case{len(list(tmp_path.iterdir()))}", streams=False)
        edit(d)
        with pytest.raises(ModelLoadError if load else ConvertError) as e:
            load_model_dir(str(d)) if load else convert(str(d), str(tmp_path / "never"), ConvertOptions())
        for n in needles:
            assert n in str(e.value), str(e.value)
        assert not (tmp_path / "never").exists()

    for key, value in (("vocab_size", 10**12), ("intermediate_size", 2**62), ("head_dim", 10**9)):
        refused(lambda d, k=key, v=value: _edit_config(d, **{k: v}), key, "limit")
        refused(lambda d, k=key, v=value: _edit_config(d, **{k: v}), key, "limit", load=False)
    deep = '{"a": ' * 100_000 + "1" + "}" * 100_000
    refused(lambda d: (d / "config.json").write_text(deep), "config.json", "nested too deeply")

    def null_shard(d):
        (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": None}}))

    refused(null_shard, "weight_map", load=False)

    def outside(name):
        def edit(d):
            target = tmp_path / f"outside-{name}"
            os.replace(d / name, target)
            (d / name).symlink_to(target)

        return edit

    refused(outside("model.safetensors"), "model.safetensors", "outside the model directory")
    refused(outside("model.safetensors"), "model.safetensors", "outside the model directory", load=False)
    (model / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    refused(outside("chat_template.jinja"), "chat_template.jinja", "outside the model directory")

    def huge_template(d):
        (d / "chat_template.jinja").unlink(missing_ok=True)
        tc = json.loads((d / "tokenizer_config.json").read_text())
        tc["chat_template"] = "x" * (50 << 20)
        (d / "tokenizer_config.json").write_text(json.dumps(tc))

    refused(huge_template, "chat template", "over the limit")
    refused(lambda d: (d / "chat_template.jinja").write_text("x" * (50 << 20)), "chat_template.jinja", "limit")
    assert cfg["num_hidden_layers"] == 4  # the original is untouched


def test_hostile_gguf_metadata_is_one_line(tmp_path):
    """GGUF sizes that divided by zero, overflowed, or built 100,000 layers before the tensors
    were looked at."""
    pytest.importorskip("gguf")
    from specstream_mlx.io.gguf import GGUFError, read_gguf
    from tests.helpers.gguf_files import TinySpec, write_tiny_gguf

    for key, value, needle in (
        ("attention.head_count", 0, "positive integer"),
        ("embedding_length", 2**31 + 64, "limit"),
        ("feed_forward_length", 4_000_000_000, "limit"),
        ("block_count", 100_000, "limit"),
        ("block_count", 3, "hold 2 layers"),
    ):
        f = tmp_path / f"{key}-{value}.gguf"
        write_tiny_gguf(f, TinySpec(overrides={key: value}))
        with pytest.raises(GGUFError) as e:
            read_gguf(f)
        assert key in str(e.value) and needle in str(e.value) and str(f) in str(e.value), str(e.value)


def test_stdio_load_failures_are_one_load_failed_event(model, tmp_path):
    for name, edit in (
        ("vocab", lambda d: _edit_config(d, vocab_size=10**12)),
        ("deep", lambda d: (d / "config.json").write_text("[" * 100_000 + "]" * 100_000)),
    ):
        d = copy_model(model, tmp_path / name, streams=False)
        edit(d)
        rc, out, err = _finish(_start(["serve", "--stdio", "--model", str(d)], stdin=subprocess.DEVNULL))
        events = [json.loads(line) for line in out.splitlines()]
        assert rc == 1 and "Traceback" not in err, err[-2000:]
        assert len(events) == 1 and events[0]["code"] == "load_failed" and "config.json" in events[0]["message"]


def test_bad_port_is_one_line():
    rc, _, err = _finish(_start(["serve", "--http", "--port", "99999", "--model", "nowhere"]))
    _assert_one_line(rc, err, "--port")


def test_force_never_deletes_a_project_with_a_config(tmp_path, tiny_model_dir):
    """A directory holding a config.json (or a file named checkpoint) and the user's work is
    not a model directory: --force refuses it and deletes nothing."""

    def force_convert(dst):
        cmd = [*CLI, "convert", "--hf-path", str(tiny_model_dir), "--mlx-path", str(dst), "--force"]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=120)

    for marker in ("config.json", "checkpoint"):
        project = tmp_path / f"project-{marker}"
        (project / "src").mkdir(parents=True)
        (project / marker).write_text("{}")
        (project / "thesis.tex").write_text("\\documentclass{article}")
        (project / "src" / "main.py").write_text("print('mine')")
        r = force_convert(project)
        _assert_one_line(r.returncode, r.stderr, "not a model directory")
        assert (project / "thesis.tex").exists() and (project / "src" / "main.py").exists()
    # a model directory of ours (with a training checkpoint inside) is still replaced
    out = tmp_path / "out"
    copy_model(tiny_model_dir, out)
    (out / "checkpoint").mkdir()
    (out / "checkpoint" / "state.json").write_text("{}")
    r = force_convert(out)
    assert r.returncode == 0 and not (out / "checkpoint").exists(), r.stderr


def _hostile_tokenizer(d: Path):
    """A pre-tokenizer regex that backtracks: Oniguruma's retry limit panics in Rust."""
    tok = json.loads((d / "tokenizer.json").read_text())
    split = {"type": "Split", "pattern": {"Regex": "(a+)+$"}, "behavior": "Isolated", "invert": False}
    tok["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [split, tok["pre_tokenizer"]]}
    (d / "tokenizer.json").write_text(json.dumps(tok))


def _template(d: Path, template: str):
    (d / "chat_template.jinja").write_text(template)


RUNAWAY = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}x"
HUGE = "{{ 'x' * 300000000 }}"


def test_stdio_survives_the_models_own_tokenizer_and_template(model, tmp_path):
    """A tokenizer that panics in native code, a template that renders 300 MB, one that never
    ends: each request gets one error event and the next request is served (before: the server
    exited with rc 1, aborted in Rust, or spun for ever)."""
    cases = {
        "panic": (_hostile_tokenizer, "a" * 5000 + "b", {"invalid_prompt"}),
        # over the size bound, or over the time bound while rendering it on a slow machine
        "huge": (lambda d: _template(d, HUGE), "hi", {"prompt_too_long", "invalid_prompt"}),
        "runaway": (lambda d: _template(d, RUNAWAY), "hi", {"invalid_prompt"}),
    }
    procs = {}
    for name, (edit, prompt, _) in cases.items():
        d = copy_model(model, tmp_path / name, streams=False)
        edit(d)
        lines = [
            json.dumps({"id": 1, "prompt": prompt, "max_tokens": 2}),
            json.dumps({"id": 2, "messages": [{"role": "user", "content": "ok"}], "max_tokens": 2}),
            json.dumps({"id": 3, "ping": True}),
        ]
        (tmp_path / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
        with open(tmp_path / f"{name}.jsonl") as requests:
            procs[name] = _start(["serve", "--stdio", "--model", str(d)], stdin=requests)
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=120)
        events = [json.loads(line) for line in out.splitlines()]
        assert proc.returncode == 0 and "Traceback" not in err, err[-2000:]
        by_id = {}
        for e in events:
            if e["event"] in ("done", "error", "pong"):
                by_id.setdefault(e["id"], []).append(e)
        assert [e["event"] for e in by_id[1]] == ["error"] and by_id[1][0]["code"] in cases[name][2], events
        # the second request uses the same template/tokenizer: it ends in exactly one event too
        assert len(by_id[2]) == 1 and by_id[3][0]["event"] == "pong", events


def test_stdio_caps_max_tokens_above_the_context_as_documented(model, tmp_path):
    """docs/PROTOCOL.md: max_tokens above the context left is capped (before: refused)."""
    (tmp_path / "in.jsonl").write_text(json.dumps({"id": 1, "prompt": "hi", "max_tokens": 1 << 20}) + "\n")
    with open(tmp_path / "in.jsonl") as requests:
        proc = _start(["serve", "--stdio", "--model", str(model), "--max-context", "48"], stdin=requests)
    rc, out, err = _finish(proc)
    done = [json.loads(line) for line in out.splitlines() if '"done"' in line]
    assert rc == 0 and len(done) == 1, out + err[-1000:]
    stats = done[0]["stats"]
    assert stats["prompt_tokens"] + stats["generated_tokens"] <= 48 and done[0]["finish_reason"] in ("length", "stop")


def test_a_bad_adapter_is_one_error_naming_its_file(tmp_path, tiny_model_dir):
    """--adapter-path and convert --adapter: an adapter_config.json with r 0 had been a
    ZeroDivisionError ("smollm2: cannot load (ZeroDivisionError…)"), one that is not JSON a
    bare "Expecting value" without the file, a list an AttributeError, nesting a
    RecursionError; LoRA matrices whose ranks differ had been MLX's matmul message without
    the file or tensor."""
    import mlx.core as mx

    from specstream_mlx import load
    from specstream_mlx.io.adapters import fuse_adapter_into

    model, _ = load(str(tiny_model_dir))
    h = json.loads((tiny_model_dir / "config.json").read_text())["hidden_size"]
    key = "base_model.model.model.layers.0.self_attn.o_proj.lora_{}.weight"

    def peft(config: str, a=(4, h), b=(h, 4)) -> Path:
        d = tmp_path / f"peft{len(list(tmp_path.iterdir()))}"
        d.mkdir()
        (d / "adapter_config.json").write_text(config)
        mx.save_safetensors(
            str(d / "adapter_model.safetensors"), {key.format("A"): mx.zeros(a), key.format("B"): mx.zeros(b)}
        )
        return d

    mlxlm = tmp_path / "mlxlm"
    mlxlm.mkdir()
    (mlxlm / "adapter_config.json").write_text('{"lora_parameters": {"scale": "big"}}')
    mx.save_safetensors(
        str(mlxlm / "adapters.safetensors"), {"model.layers.0.self_attn.o_proj.lora_a": mx.zeros((h, 4))}
    )
    for d, said in (
        (peft('{"r": 0}'), "adapter_config.json: r must be a positive integer, got 0"),
        (peft('{"r": 4, "lora_alpha": null}'), "adapter_config.json: lora_alpha must be a finite number, got None"),
        (peft("{"), "adapter_config.json: invalid JSON (Expecting property name"),
        (peft("[4]"), "adapter_config.json: must be a JSON object"),
        (peft("[" * 100000 + "]" * 100000), "adapter_config.json: invalid JSON (nested too deeply)"),
        (peft('{"r": 4}', b=(h, 3)), f"adapter_model.safetensors: {key.format('A')}: shapes ({h}, 3) and (4, {h})"),
        (mlxlm, "adapter_config.json: lora_parameters.scale must be a finite number, got 'big'"),
    ):
        with pytest.raises(ValueError, match=re.escape(str(d / said.split(":")[0]) + ":" + said.split(":", 1)[1])):
            fuse_adapter_into(model.base, d)


def test_stream_counts_and_mismatched_stream_files_are_one_line(tmp_path, tiny_model_dir):
    """convert --num-streams 1000 had attached a thousand streams (and training them ran
    the machine out of memory); a specstream.json that its weights do not match had been
    MLX's message naming every parameter, one a line (57 lines for SmolLM2's streams)."""
    from specstream_mlx.convert import ConvertError, ConvertOptions, convert
    from specstream_mlx.io.loading import ModelLoadError, load_model_dir

    with pytest.raises(ConvertError, match="--num-streams must be at most 32, got 33"):
        convert(str(tiny_model_dir), str(tmp_path / "never"), ConvertOptions(num_streams=33))
    r = subprocess.run(
        [sys.executable, "-m", "specstream_mlx", "convert", "--hf-path", str(tiny_model_dir), "--mlx-path",
         str(tmp_path / "never"), "--num-streams", "1000"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    _assert_one_line(r.returncode, r.stderr, "--num-streams must be 0 (none) to 32, got 1000")
    assert not (tmp_path / "never").exists()
    d = convert(str(tiny_model_dir), str(tmp_path / "m"), ConvertOptions(num_streams=2, stream_layers=2))
    cfg = json.loads((d / "specstream.json").read_text())
    cfg["lora"]["rank"] = 0  # the weights hold a LoRA the config no longer names
    (d / "specstream.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError) as e:
        load_model_dir(str(d))
    assert "\n" not in str(e.value) and "streams.safetensors: does not match specstream.json" in str(e.value)
    assert re.search(r"not in model: [^,]+, [^,]+, [^,]+, … \(\d+ in all\)", str(e.value)), str(e.value)
