"""The specstream-mlx command line, run as users run it."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.tiny_models import copy_model

CLI = [sys.executable, "-m", "specstream_mlx"]


def run(*args, timeout=120, **kw):
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout, **kw)


def test_help_is_fast_and_lists_commands():
    t = time.perf_counter()
    r = run("--help")
    assert r.returncode == 0
    assert "convert" in r.stdout and "generate" in r.stdout
    # No mlx import for --help (generous bound: two re-execs of Python on a busy machine).
    assert time.perf_counter() - t < 10


def test_version_reports_device_and_blas():
    r = run("--version")
    assert r.returncode == 0
    out = r.stdout
    assert "mlx:" in out and "device:" in out and "blas:" in out
    from specstream_mlx.platform_info import choose_blas

    chosen = choose_blas(os.environ.get("SPECSTREAM_BLAS"))
    if sys.platform.startswith("linux") and chosen.path is not None:
        # The CLI re-executes itself with the chosen BLAS preloaded, and says which.
        assert f"blas: {chosen.library.name}" in out
        assert "blas_version: None" not in out and "blas_threads: None" not in out


def test_generate_json(tiny_model_dir):
    r = run("generate", "--model", str(tiny_model_dir), "--prompt", "hello", "--max-tokens", "12", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    for key in ("text", "tokens", "prompt_tokens", "mode", "stats"):
        assert key in out
    s = out["stats"]
    for key in (
        "generated_tokens",
        "forward_passes",
        "tokens_per_pass",
        "tokens_per_second",
        "prompt_seconds",
        "peak_memory_gb",
    ):
        assert key in s
    assert out["mode"] == "ar"
    assert s["generated_tokens"] == len(out["tokens"]) <= 12
    assert s["forward_passes"] == s["generated_tokens"] or out["finish_reason"] == "stop"
    # The chat template wrapped the prompt.
    assert len(out["prompt_tokens"]) > len("hello")


def test_generate_streams_text_and_matches_api(tiny_model_dir):
    from specstream_mlx import SamplingParams, generate, load

    r = run(
        "generate", "--model", str(tiny_model_dir), "--prompt", "abc", "--max-tokens", "10", "--ignore-chat-template"
    )
    assert r.returncode == 0, r.stderr
    model, tok = load(str(tiny_model_dir))
    res = generate(model, tok, "abc", max_tokens=10, sampling=SamplingParams(), use_chat_template=False)
    assert r.stdout.rstrip("\n") == res.text
    assert "tok/s" in r.stderr


def test_generate_seeded_sampling_is_reproducible(tiny_model_dir):
    args = (
        "generate",
        "--model",
        str(tiny_model_dir),
        "--prompt",
        "x",
        "--max-tokens",
        "16",
        "--temp",
        "1.0",
        "--top-p",
        "0.9",
        "--top-k",
        "50",
        "--json",
    )
    a = json.loads(run(*args, "--seed", "3").stdout)["tokens"]
    b = json.loads(run(*args, "--seed", "3").stdout)["tokens"]
    c = json.loads(run(*args, "--seed", "4").stdout)["tokens"]
    assert a == b and a != c


@pytest.mark.parametrize(
    "args,needle",
    [
        (("--model", "/nonexistent/model", "--prompt", "x"), "no such model directory"),
        (("--prompt", "x", "--mode", "zz"), "unknown --mode"),
        (("--prompt", "x", "--temp", "-1"), "temperature"),
    ],
)
def test_generate_errors_are_one_line(tiny_model_dir, args, needle):
    args = list(args)
    if "--model" not in args:
        args = ["--model", str(tiny_model_dir)] + args
    r = run("generate", *args)
    assert r.returncode == 1
    assert needle in r.stderr and "Traceback" not in r.stderr


def test_generation_stops_at_eos(tiny_model_dir):
    """A model whose every next token is EOS stops after zero tokens with 'stop'."""
    import mlx.core as mx

    from specstream_mlx import generate, load

    model, tok = load(str(tiny_model_dir))
    real = model.base.lm_logits

    def always_eos(h):
        logits = real(h)
        return logits + mx.where(mx.arange(logits.shape[-1]) == 2, 1e4, 0.0)

    model.base.lm_logits = always_eos
    res = generate(model, tok, "hi", max_tokens=20)
    assert res.tokens == [] and res.finish_reason == "stop"


@pytest.fixture(scope="module")
def streams_model_dir(tmp_path_factory, tiny_model_dir):
    dst = tmp_path_factory.mktemp("withstreams") / "m"
    r = run(
        "convert",
        "--hf-path",
        str(tiny_model_dir),
        "--mlx-path",
        str(dst),
        "--num-streams",
        "3",
        "--stream-layers",
        "2",
    )
    assert r.returncode == 0, r.stderr
    assert "untrained streams" in r.stderr
    return dst


def test_convert_attaches_streams(streams_model_dir):
    cfg = json.loads((streams_model_dir / "specstream.json").read_text())
    assert cfg["num_streams"] == 3 and cfg["stream_layers"] == 2 and cfg["trained"] is False
    assert (streams_model_dir / "streams.safetensors").exists()


@pytest.mark.parametrize(
    "mode,tree", [("ss", "dynamic:8"), ("ss", "cartesian:2x2x1"), ("ss", "auto"), ("lookup", "auto")]
)
def test_generate_ss_equals_ar(streams_model_dir, mode, tree, tmp_path):
    env = dict(os.environ, SPECSTREAM_MLX_CACHE=str(tmp_path))
    base = (
        "generate",
        "--model",
        str(streams_model_dir),
        "--prompt",
        "the cat sat on the mat, the cat",
        "--max-tokens",
        "30",
        "--json",
    )
    ar = json.loads(run(*base, "--mode", "ar", env=env).stdout)
    r = run(*base, "--mode", mode, "--tree", tree, env=env)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["tokens"] == ar["tokens"] and out["mode"] == mode
    s = out["stats"]
    assert sum(s["accepted_histogram"].values()) == s["forward_passes"] or s["fallback"]
    assert s["tokens_per_pass"] >= ar["stats"]["tokens_per_pass"] - 1e-9
    if mode == "ss":
        assert "untrained speculative streams" in r.stderr  # warned at load


def test_ss_without_streams_says_how_to_add_them(tiny_model_dir):
    r = run("generate", "--model", str(tiny_model_dir), "--prompt", "x", "--mode", "ss")
    assert r.returncode == 1
    assert "--num-streams" in r.stderr and "specstream-mlx train" in r.stderr


def _one_line_error(r):
    assert r.returncode == 1, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr and r.stderr.strip().count("\n") == 0, r.stderr
    return r.stderr


def test_generate_refuses_a_prompt_over_the_context(tiny_model_dir):
    err = _one_line_error(
        run("generate", "--model", str(tiny_model_dir), "--prompt", "word " * 300, "--max-kv-size", "64")
    )
    assert "context" in err and "64" in err
    # A prompt that fits with max_tokens capped by what is left.
    r = run("generate", "--model", str(tiny_model_dir), "--prompt", "hi", "-m", "500", "--max-kv-size", "64", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert len(out["prompt_tokens"]) + out["stats"]["generated_tokens"] <= 64 and "capped" in r.stderr


def test_generate_system_prompt_and_tiny_temperatures(tiny_model_dir):
    base = ["generate", "--model", str(tiny_model_dir), "--prompt", "hi", "-m", "8", "--json"]
    plain = json.loads(run(*base).stdout)
    with_system = json.loads(run(*base, "--system-prompt", "Be brief.").stdout)
    assert len(with_system["prompt_tokens"]) > len(plain["prompt_tokens"])
    # Temperatures too small for float32 logits are greedy, not garbage.
    tiny = json.loads(run(*base, "--temp", "1e-38").stdout)
    assert tiny["tokens"] == plain["tokens"]
    assert "temperature" in _one_line_error(run(*base, "--temp", "nan"))


def test_chat_and_generate_time_auto_trees_before_the_first_prompt(streams_model_dir, tmp_path):
    """On a machine without stored pass costs, `--tree auto`'s one-off timing runs as the
    command starts: a chat that is left before its first message has done it (and said so),
    and the generation after it in the same cache times nothing."""
    env = dict(os.environ, SPECSTREAM_MLX_CACHE=str(tmp_path))
    r = run("chat", "--model", str(streams_model_dir), "-m", "4", input="/quit\n", env=env, timeout=180)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.count("timing tree passes") == 1 and "tok/s" not in r.stderr
    r = run("generate", "--model", str(streams_model_dir), "-p", "the cat", "-m", "4", env=env)
    assert r.returncode == 0 and "timing tree passes" not in r.stderr, r.stderr
    r = run("generate", "--model", str(streams_model_dir), "-p", "the cat", "-m", "4", "--mode", "ar", env=env)
    assert r.returncode == 0 and "timing" not in r.stderr, r.stderr


def test_chat_survives_bad_commands_and_outgrows_its_context(tiny_model_dir):
    # /temp -1 keeps the old temperature; the next message is answered (no traceback).
    r = run("chat", "--model", str(tiny_model_dir), "-m", "4", input="/temp -1\nhello\n", timeout=180)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert "usage: /temp" in r.stderr and r.stderr.count("tok/s") == 1
    # A long conversation in a tiny context drops its oldest turns, with a notice.
    script = "".join(f"message number {i} with some words\n" for i in range(6))
    r = run("chat", "--model", str(tiny_model_dir), "-m", "8", "--max-kv-size", "160", input=script, timeout=180)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.count("tok/s") == 6 and "dropped the" in r.stderr
    # A single message longer than the context is refused, and the chat goes on.
    r = run(
        "chat",
        "--model",
        str(tiny_model_dir),
        "-m",
        "4",
        "--max-kv-size",
        "64",
        input="word " * 100 + "\nhi\n",
        timeout=180,
    )
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert "context is 64" in r.stderr and r.stderr.count("tok/s") == 1


def _broken_copy(src, dst, edit):
    import shutil

    shutil.copytree(src, dst)
    edit(dst)
    return dst


def _set_config(key, value):
    def edit(d):
        cfg = json.loads((d / "config.json").read_text())
        if value is KeyError:
            cfg.pop(key)
        else:
            cfg[key] = value
        (d / "config.json").write_text(json.dumps(cfg))

    return edit


def _write(name, text):
    return lambda d: (d / name).write_text(text)


def _no_tokenizer(d):
    for f in d.iterdir():
        if f.name.startswith("tokenizer"):
            f.unlink()


BROKEN = {
    "config-list": (_write("config.json", "[]"), "config.json"),
    "hidden-size-string": (_set_config("hidden_size", "256"), "hidden_size"),
    "no-num-layers": (_set_config("num_hidden_layers", KeyError), "num_hidden_layers"),
    "streams-wrong-types": (_write("specstream.json", '{"num_streams": "4", "stream_layers": 2}'), "specstream.json"),
    "no-tokenizer": (_no_tokenizer, "tokenizer"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_bad_model_directories_fail_in_one_line(tmp_path, tiny_model_dir, case):
    edit, needle = BROKEN[case]
    d = _broken_copy(tiny_model_dir, tmp_path / case, edit)
    t = time.perf_counter()
    err = _one_line_error(run("generate", "--model", str(d), "--prompt", "hi", "-m", "4"))
    assert needle in err and str(d) in err, err
    assert time.perf_counter() - t < 30  # no slow fall-back search for a tokenizer
    if case == "config-list":
        err = _one_line_error(run("bench", "--model", str(d), "--prompts", "1", "--rounds", "1"))
        assert "config.json" in err


def test_broken_chat_template_fails_in_one_line(tmp_path, tiny_model_dir):
    def edit(d):
        cfg = json.loads((d / "tokenizer_config.json").read_text())
        cfg["chat_template"] = "{% for m in messages %}{{ m.content }"  # unclosed tag
        (d / "tokenizer_config.json").write_text(json.dumps(cfg))
        for f in d.glob("chat_template.*"):
            f.unlink()

    d = _broken_copy(tiny_model_dir, tmp_path / "tpl", edit)
    err = _one_line_error(run("generate", "--model", str(d), "--prompt", "hi", "-m", "4"))
    assert "template" in err.lower() or "prompt" in err


def test_adapter_path_fuses_peft_and_mlx_lm_adapters(tmp_path, tiny_model_dir):
    """--adapter-path: a PEFT adapter gives the same tokens as the model converted with it
    fused; an mlx-lm adapter with the same delta gives the same tokens too."""
    import mlx.core as mx

    from specstream_mlx.convert import ConvertOptions, convert

    cfg = json.loads((tiny_model_dir / "config.json").read_text())
    h, r = cfg["hidden_size"], 4
    mx.random.seed(1)
    peft, mlxlm = tmp_path / "peft", tmp_path / "mlxlm"
    peft.mkdir()
    mlxlm.mkdir()
    A = {i: mx.random.normal((r, h)) * 0.3 for i in range(cfg["num_hidden_layers"])}  # (r, in)
    B = {i: mx.random.normal((h, r)) * 0.3 for i in A}  # (out, r)
    mx.save_safetensors(
        str(peft / "adapter_model.safetensors"),
        {
            **{f"base_model.model.model.layers.{i}.self_attn.o_proj.lora_A.weight": A[i] for i in A},
            **{f"base_model.model.model.layers.{i}.self_attn.o_proj.lora_B.weight": B[i] for i in A},
        },
    )
    (peft / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": r, "lora_alpha": 2 * r}))
    # mlx-lm stores a = Aᵀ (in, r), b = Bᵀ (r, out) and its own scale.
    mx.save_safetensors(
        str(mlxlm / "adapters.safetensors"),
        {
            **{f"model.layers.{i}.self_attn.o_proj.lora_a": A[i].T for i in A},
            **{f"model.layers.{i}.self_attn.o_proj.lora_b": B[i].T for i in A},
        },
    )
    (mlxlm / "adapter_config.json").write_text(
        json.dumps({"fine_tune_type": "lora", "lora_parameters": {"rank": r, "scale": 2.0}})
    )
    fused = convert(str(tiny_model_dir), str(tmp_path / "fused"), ConvertOptions(dtype="float32", adapter=str(peft)))

    def tokens(model, *extra):
        r = run("generate", "--model", str(model), "--prompt", "hello", "-m", "16", "--json", *extra)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)["tokens"]

    plain, want = tokens(tiny_model_dir), tokens(fused)
    assert want != plain  # the adapter changes the model
    assert tokens(tiny_model_dir, "--adapter-path", str(peft)) == want
    assert tokens(tiny_model_dir, "--adapter-path", str(mlxlm)) == want
    err = _one_line_error(
        run("generate", "--model", str(tiny_model_dir), "--prompt", "x", "--adapter-path", str(tmp_path / "nowhere"))
    )
    assert "adapter" in err


def test_train_help_shows_the_torch_extra():
    # Rich reads "[torch]" as markup unless escaped; the install command must survive.
    r = run("train", "--help", env={**os.environ, "COLUMNS": "250"})
    assert r.returncode == 0 and "pip install 'specstream-mlx[torch]'" in r.stdout


def test_chat_template_jinja_beside_the_tokenizer_is_kept(tmp_path, tiny_model_dir):
    """transformers 5 writes the chat template to chat_template.jinja, not tokenizer_config.json."""

    from specstream_mlx.convert import ConvertOptions, convert
    from specstream_mlx.io.loading import load_tokenizer

    src = tmp_path / "hf"
    copy_model(tiny_model_dir, src, streams=False)
    cfg_path = src / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("chat_template", None)
    cfg_path.write_text(json.dumps(cfg))
    (src / "chat_template.json").unlink(missing_ok=True)
    (src / "chat_template.jinja").write_text("{% for m in messages %}<<{{ m.role }}|{{ m.content }}>>{% endfor %}")
    dst = convert(str(src), str(tmp_path / "out"), ConvertOptions())
    assert (dst / "chat_template.jinja").exists()
    tok = load_tokenizer(dst)
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert text == "<<user|hi>>"


def test_quantization_without_group_size_is_one_line(tmp_path, tiny_model_dir):

    d = tmp_path / "m"
    copy_model(tiny_model_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization"] = {"bits": 4}
    (d / "config.json").write_text(json.dumps(cfg))
    r = run("generate", "--model", str(d), "--prompt", "hi", "-m", "2")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [
        f"specstream-mlx: error: {d / 'config.json'}: 'quantization.group_size' must be a positive integer, got None"
    ]


def test_measure_acceptance_writes_the_prior_auto_reads(streams_model_dir, tmp_path):
    """measure-acceptance scores every budget on held-out prompts and, with --write, stores
    it where --tree auto reads its prior; bad prompt files are one line."""
    from specstream_mlx.method.streams import StreamConfig
    from specstream_mlx.runtime.acceptance_prior import AcceptancePrior

    model = copy_model(streams_model_dir, tmp_path / "m")
    prompts = tmp_path / "valid.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("hello there", "tell me a story")))
    r = run("measure-acceptance", "--model", str(model), "--prompts", str(tmp_path), "--max-tokens", "16", "--write")
    assert r.returncode == 0, r.stderr
    printed = json.loads(r.stdout.strip().splitlines()[-1])
    cfg = StreamConfig.from_json(json.loads((model / "specstream.json").read_text()))
    prior = AcceptancePrior.from_extra(cfg.extra)
    assert prior is not None and prior.prompts == 2 and printed["budgets"] == cfg.extra["acceptance"]["budgets"]
    before = (model / "specstream.json").read_text()
    prompts.write_text('{"nothing": 1}\n')
    r = run("measure-acceptance", "--model", str(model), "--prompts", str(prompts), "--write")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.strip().count("\n") == 0 and "valid.jsonl:1" in r.stderr
    assert (model / "specstream.json").read_text() == before  # nothing half-written


def test_one_default_tree_in_the_library_and_every_front_end():
    """generate(mode="ss") without a tree decodes as the CLI does (before: a fixed dynamic:12
    tree, 0.37-0.83x of ar on SmolLM2, while the CLI tuned and fell back to plain)."""
    import importlib
    import inspect

    import typer

    from specstream_mlx.cli.chat import ChatOptions
    from specstream_mlx.runtime import generation, session, speculative

    cli = importlib.import_module("specstream_mlx.cli.app")
    assert speculative.DEFAULT_TREE == "auto"
    for fn in (generation.generate, generation.stream_generate, speculative.ss_steps, session.ChatSession.stream_ids):
        assert inspect.signature(fn).parameters["tree"].default == speculative.DEFAULT_TREE, fn
    for command in (cli.generate, cli.chat, cli.serve, cli.bench):
        params = inspect.signature(command).parameters
        if "tree" in params:
            default = params["tree"].default
            assert (default.default if isinstance(default, typer.models.OptionInfo) else default) == "auto", command
    assert ChatOptions().tree == "auto"


def test_tau_leaves_the_prefill_pass_out_and_one_token_prints_no_rate():
    """τ as docs/DESIGN.md §5 defines it: tokens decided per decoding pass, the prefill pass
    and its token left out (before: generate and bench counted the prefill pass, demo-sql
    dynamic:4 2.67 where the tree sweep said 3.08); -m 1 printed "0.0 tok/s"."""
    r = run(
        "generate",
        "--model",
        "demo-sql",
        "--mode",
        "ss",
        "--tree",
        "dynamic:4",
        "--prompt",
        "SELECT",
        "-m",
        "40",
        "--json",
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    s = out["stats"]
    decided = s["generated_tokens"] + (out["finish_reason"] == "stop")
    assert s["forward_passes"] > 2 and s["tokens_per_pass"] > 1.2
    assert abs(s["tokens_per_pass"] * (s["forward_passes"] - 1) - (decided - 1)) < 1e-6, s
    one = run("generate", "--model", "demo-sql", "--mode", "ar", "--prompt", "SELECT", "-m", "1")
    assert one.returncode == 0 and "tok/s" not in one.stderr and "1 token," in one.stderr, one.stderr


def test_chat_help_seed_and_a_missing_template(tmp_path, tiny_model_dir):
    """/help lists the commands, --seed makes sampled replies reproducible, -h is --help, and a
    model without a chat template is said to have none."""
    from tests.helpers.tiny_models import copy_model

    def chat(model, script, *flags):
        r = run("chat", "--model", str(model), "-m", "12", *flags, input=script)
        assert r.returncode == 0, r.stderr
        return r

    r = chat(tiny_model_dir, "/help\n/quit\n")
    assert "/reset" in r.stdout and "/stats" in r.stdout and "Ctrl-C" in r.stdout
    sampled = [chat(tiny_model_dir, "hello\n", "--temp", "1.5", "--seed", "7").stdout for _ in range(2)]
    assert sampled[0] == sampled[1] and sampled[0].strip()
    assert chat(tiny_model_dir, "hello\n", "--temp", "1.5", "--seed", "8").stdout != sampled[0]
    assert "--seed" in run("chat", "-h").stdout
    bare = copy_model(tiny_model_dir, tmp_path / "bare", streams=False)
    (bare / "chat_template.jinja").unlink(missing_ok=True)
    cfg = json.loads((bare / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (bare / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert "no chat template" in chat(bare, "hello\n").stderr


def test_chat_ctrl_c_stops_a_reply_and_stats_show_it(tmp_path, tiny_model_dir):
    """Ctrl-C during a reply ends it with its text and figures (before: /stats had none)."""
    import signal
    import subprocess
    import sys
    import time

    from tests.helpers.tiny_models import copy_model

    # A model that never ends its reply: its EOS is a token it does not produce.
    endless = copy_model(tiny_model_dir, tmp_path / "endless", streams=False)
    for name, edit in (("config.json", {"eos_token_id": 258}), ("tokenizer_config.json", {"eos_token": None})):
        cfg = json.loads((endless / name).read_text())
        cfg.update(edit)
        (endless / name).write_text(json.dumps({k: v for k, v in cfg.items() if v is not None}))
    proc = subprocess.Popen(
        [sys.executable, "-m", "specstream_mlx", "chat", "--model", str(endless), "-m", "100000"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    proc.stdin.write("zzz\n")
    proc.stdin.flush()
    first = proc.stdout.read(20)  # the reply has started
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate("/stats\n/quit\n", timeout=60)
    assert proc.returncode == 0, err
    assert first and "[stopped]" in out, out[-500:]
    stats = [line for line in out.splitlines() if line.startswith("[ar]")]
    assert stats and "cancelled" in stats[-1], out[-800:]
    assert int(stats[-1].split("] ")[1].split()[0]) > 0  # the tokens of the stopped reply


def test_bench_and_generate_refuse_counts_no_run_could_use_before_loading(tiny_model_dir, tmp_path):
    """A benchmark asked for no prompts, no rounds, no tokens or a negative temperature is
    refused in one line before anything loads or runs: `bench --prompts 0` had benchmarked
    every prompt, `--rounds 0` ended its run in "no median for empty data", `--max-tokens 0`
    and `--temp -1` failed only once the model was loaded or the first sampling run came."""
    out = tmp_path / "reports" / "b.json"
    for flag, value, words in (
        ("--prompts", "0", "--prompts must be at least 1"),
        ("--prompts", "-2", "--prompts must be at least 1"),
        ("--rounds", "0", "--rounds must be at least 1"),
        ("--max-tokens", "0", "--max-tokens must be at least 1"),
        ("--temp", "-1", "temperature"),
        ("--temp", "nan", "temperature"),
    ):
        err = _one_line_error(run("bench", "--model", str(tiny_model_dir), flag, value, "--json", str(out)))
        assert words in err, (flag, value, err)
        assert not out.parent.exists(), (flag, value)  # nothing written, no folder made
    for flag, value, words in (("-m", "0", "--max-tokens must be at least 1"), ("--max-kv-size", "1", "at least 2")):
        err = _one_line_error(run("generate", "--model", str(tiny_model_dir), "--prompt", "hi", flag, value))
        assert words in err, (flag, value, err)
    # chat had loaded and then refused every message (a context of 1, a tree it cannot
    # parse) or taken --max-kv-size 0 for no limit; serve had started with a context of 1.
    model = ["--model", str(tiny_model_dir)]
    for args, words in (
        (["chat", *model, "--max-kv-size", "1"], "--max-kv-size must be at least 2"),
        (["chat", *model, "--max-kv-size", "0"], "--max-kv-size must be at least 2"),
        (["chat", *model, "--tree", "dynamic:0"], "dynamic:0"),
        (["serve", "--stdio", *model, "--max-context", "1"], "--max-context must be at least 2"),
        (["serve", "--http", *model, "--timeout", "0"], "--timeout"),
        (["serve", "--http", *model, "--max-connections", "0"], "--max-connections must be at least 1"),
        (["floor", *model, "--context", "0"], "--context must be between 1 and 32768"),
    ):
        err = _one_line_error(run(*args, input="hi\n"))
        assert words in err, (args, err)


def test_data_and_evaluation_commands_refuse_values_no_run_could_use(tiny_model_dir, tmp_path):
    """One line and nothing written for a value no run could use, before any model loads:
    `eval-bfcl -m 0` had ended in a traceback and `--limit 0` evaluated every item;
    `prepare-sharegpt --valid-fraction 2` wrote every conversation to valid and none to
    train; `calibrate-pruning --keep 1.5` was refused only once the model had loaded;
    `convert --num-streams -1` converted."""
    out = tmp_path / "out"
    (tmp_path / "a-file").write_text("")
    (tmp_path / "held").mkdir()
    (tmp_path / "held" / "train.jsonl").write_text('{"text": "my own data"}\n')
    for args, words in (
        (["eval-bfcl", "--model", str(tiny_model_dir), "-m", "0"], "--max-tokens must be at least 1"),
        (["eval-bfcl", "--model", str(tiny_model_dir), "--limit", "0"], "--limit must be at least 1"),
        # a tree no pass could use had been refused only after the model loaded, in a traceback
        (["eval-bfcl", "--model", str(tiny_model_dir), "--tree", "dynamic:0"], "bad tree spec 'dynamic:0'"),
        (["prepare-sharegpt", "--out", str(out), "--valid-fraction", "2"], "--valid-fraction"),
        (["prepare-sharegpt", "--out", str(out), "--valid-fraction", "0"], "--valid-fraction"),
        (["prepare-sharegpt", "--out", str(out), "--max-examples", "0"], "--max-examples must be at least 1"),
        (["prepare-sharegpt", "--out", str(out), "--max-turns", "0"], "--max-turns must be at least 1"),
        (["calibrate-pruning", "--model", str(tiny_model_dir), "--data", str(out), "--keep", "1.5"], "--keep"),
        (["calibrate-pruning", "--model", str(tiny_model_dir), "--data", str(out), "--keep", "0"], "--keep"),
        # an --out that is a file had ended in a FileExistsError traceback
        (["prepare-sharegpt", "--out", str(tmp_path / "a-file"), "--max-examples", "4"], "is not a folder"),
        (["prepare-bfcl", "--out", str(tmp_path / "a-file")], "is not a folder"),
        # a folder holding a user's own splits had been written over without a word
        (["prepare-sharegpt", "--out", str(tmp_path / "held"), "--max-examples", "4"], "already holds train.jsonl"),
        (["prepare-bfcl", "--out", str(tmp_path / "held")], "already holds train.jsonl; pass --force"),
        # -1 streams had converted as none
        (["convert", "--hf-path", str(tiny_model_dir), "--mlx-path", str(out), "--num-streams", "-1"], "--num-streams"),
    ):
        err = _one_line_error(run(*args))
        assert words in err, (args, err)
        assert not out.exists(), args
    assert (tmp_path / "held" / "train.jsonl").read_text() == '{"text": "my own data"}\n'


def test_a_switch_set_to_neither_0_nor_1_is_refused():
    """SPECSTREAM_COMPILE=yes had run passes op by op, as if unset, without a word."""
    for name in ("SPECSTREAM_COMPILE", "SPECSTREAM_FUSE", "SPECSTREAM_JIT_AVX2", "SPECSTREAM_JIT_STRIDED"):
        r = run("doctor", env={**os.environ, name: "yes"})
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert r.stderr.strip() == f"specstream-mlx: error: {name}='yes': expected 0 or 1", r.stderr
    for value in ("many", "-3", "7.5"):
        r = run("doctor", env={**os.environ, "SPECSTREAM_STORED_ROWS": value})
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert r.stderr.strip() == (
            f"specstream-mlx: error: SPECSTREAM_STORED_ROWS={value!r}: expected auto or a row count (0 or more)"
        ), r.stderr


def test_a_cache_folder_that_cannot_be_made_or_written_is_refused(tmp_path, monkeypatch):
    """SPECSTREAM_MLX_CACHE naming a file had turned the product kernel, the mutexes' spinning and
    the compiled kernels' flags off without a word (none of them could be built there: decoding
    several times slower), and the bundled model failed only when it was first converted."""
    (tmp_path / "a-file").write_text("")
    for cache, why in ((tmp_path / "a-file", "is not a folder"), (tmp_path / "a-file" / "sub", "is not a folder")):
        r = run("doctor", env={**os.environ, "SPECSTREAM_MLX_CACHE": str(cache)})
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert r.stderr.strip() == (
            f"specstream-mlx: error: SPECSTREAM_MLX_CACHE={cache}: the cache folder cannot be made or written "
            f"({tmp_path / 'a-file'} {why})"
        ), r.stderr
    from specstream_mlx.settings import check

    fresh = tmp_path / "new" / "cache"
    monkeypatch.setenv("SPECSTREAM_MLX_CACHE", str(fresh))
    check()  # a cache that does not exist yet is made, and the probe leaves nothing in it
    assert fresh.is_dir() and not list(fresh.iterdir())


def test_a_product_kernel_that_cannot_be_built_is_said(tmp_path):
    """Without a C compiler the product kernel is not built and decoding's products ran on the
    BLAS alone (a SmolLM2 step 62 against 22 ms on an Intel Xeon) without a word."""
    import platform

    from specstream_mlx.platform_info import find_blas

    served = platform.machine() == "x86_64" and find_blas("openblas") is not None  # where the kernel serves
    env = {**os.environ, "SPECSTREAM_MLX_CACHE": str(tmp_path / "cache"), "PATH": str(tmp_path / "empty")}
    env.pop("LD_PRELOAD", None)
    r = run("doctor", env=env)
    assert r.returncode == 0, r.stderr
    warned = [line for line in r.stderr.splitlines() if "product kernel could not be built" in line]
    assert len(warned) == (1 if served else 0) and all("no C compiler" in w for w in warned), r.stderr
    assert "blas_gemv_forwarding: False" in r.stdout
    env["PATH"] = os.environ["PATH"]
    env["SPECSTREAM_MLX_CACHE"] = os.environ["SPECSTREAM_MLX_CACHE"]  # the run's, the kernel built there
    r = run("doctor", env=env)  # with a compiler: nothing said
    assert r.returncode == 0 and "could not be built" not in r.stderr, r.stderr


def test_a_destination_no_directory_can_be_made_at_is_one_line_before_the_work(tiny_model_dir, tmp_path):
    """`convert`/`export` into a path under a file or on /proc had ended in a traceback from
    mkdtemp, and `train` ran to its end and then lost the trained streams that way."""
    (tmp_path / "a-file").write_text("")
    data = tmp_path / "data"
    data.mkdir()
    for split in ("train", "valid"):
        (data / f"{split}.jsonl").write_text('{"text": "hello there"}\n{"text": "general kenobi"}\n')
    under_a_file = (tmp_path / "a-file" / "out", f"{tmp_path / 'a-file'} is not a directory")
    for dst, why in (under_a_file, (Path("/proc/x/out"), "")):
        for args in (
            ["convert", "--hf-path", str(tiny_model_dir), "--mlx-path", str(dst)],
            ["export", "--model", str(tiny_model_dir), "--hf-path", str(dst)],
            ["train", "--model", str(tiny_model_dir), "--data", str(data), "--out", str(dst), "--iters", "2"],
            # distill's had been a bare "[Errno 2] ..." after the model and the prompts were read
            ["distill", "--model", str(tiny_model_dir), "--prompts", str(data), "--out", str(dst)],
        ):
            r = run(*args)
            err = _one_line_error(r)
            assert f"{dst}: cannot write a directory there ({why}" in err, (args, err)
            assert "[train]" not in r.stderr, "trained before the destination was checked"
    # train --export-hf had been checked only once training was done
    train = ["train", "--model", str(tiny_model_dir), "--data", str(data), "--iters", "2"]
    for out, export, words in (
        (tmp_path / "t", under_a_file[0], f"--export-hf {under_a_file[0]}: cannot write a directory there"),
        (tmp_path / "t", tmp_path / "t", "--export-hf must name another folder than --out"),
    ):
        r = run(*train, "--out", str(out), "--export-hf", str(export))
        assert words in _one_line_error(r) and not out.exists(), r.stderr
    # distill into the prompts' own folder had taken their train.jsonl for replies already written
    before = (data / "train.jsonl").read_text()
    for prompts in (data, data / "train.jsonl"):
        r = run("distill", "--model", str(tiny_model_dir), "--prompts", str(prompts), "--out", str(data))
        assert "is where the prompts are" in _one_line_error(r), r.stderr
    assert (data / "train.jsonl").read_text() == before
    from specstream_mlx.io.files import check_writable

    check_writable(tmp_path / "new" / "deeper" / "out", ValueError)  # the probe leaves nothing behind
    assert not (tmp_path / "new").exists()


def test_a_seed_or_pruning_threshold_no_generator_takes_is_one_line(tiny_model_dir, tmp_path):
    """A negative --seed had ended in a traceback from MLX's, numpy's or PyTorch's generator
    after the work began (distill and prepare-sharegpt leaving their folder behind), one over
    2**64 in a nanobind type error; --prune-threshold -1, 2 or nan had been taken (above 1
    every draft node is pruned)."""
    data = tmp_path / "data"
    data.mkdir()
    for split in ("train", "valid"):
        (data / f"{split}.jsonl").write_text('{"text": "hello there"}\n')
    out = tmp_path / "out"
    model = ["--model", str(tiny_model_dir)]
    for seed in ("-1", str(1 << 64)):
        for args in (
            ["generate", *model, "-p", "hi", "--temp", "0.7", "--seed", seed],
            ["chat", *model, "--seed", seed],
            ["bench", *model, "--seed", seed],
            ["distill", *model, "--prompts", str(data), "--out", str(out), "--seed", seed],
            ["prepare-sharegpt", "--out", str(out), "--max-examples", "3", "--seed", seed],
            ["train", *model, "--data", str(data), "--out", str(out), "--iters", "1", "--seed", seed],
        ):
            err = _one_line_error(run(*args))
            assert f"--seed must be an integer from 0 to {(1 << 63) - 1}, got {seed}" in err, (args, err)
            assert not out.exists(), args
    for threshold in ("-1", "2", "nan"):
        err = _one_line_error(run("generate", *model, "-p", "hi", "--prune-threshold", threshold))
        assert "--prune-threshold: the pruning threshold must be a probability in [0, 1]" in err, err
