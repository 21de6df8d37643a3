"""chat, serve --stdio (fuzzed) and serve --http (official openai client)."""

import json
import os
import random
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

CLI = [sys.executable, "-m", "specstream_mlx"]
EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.fixture(scope="module")
def ss_model(tmp_path_factory, tiny_model_dir):
    dst = tmp_path_factory.mktemp("serve") / "m"
    r = subprocess.run(
        [
            *CLI,
            "convert",
            "--hf-path",
            str(tiny_model_dir),
            "--mlx-path",
            str(dst),
            "--num-streams",
            "3",
            "--stream-layers",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    return dst


def bad_lines(rng: random.Random):
    """(line bytes, expect an error event?) — at least 1,000 of them."""
    out = []
    for i in range(150):  # invalid JSON
        s = "".join(rng.choice('{}[]",:abc\\ 01') for _ in range(rng.randint(1, 40)))
        try:
            json.loads(s)
            continue
        except Exception:
            out.append((s.encode(), True))
    for i in range(120):  # invalid UTF-8
        out.append((b'{"id": 1, "prompt": "' + bytes([rng.choice([0x80, 0xC3, 0xFF, 0xFE, 0xED])]) + b'"}', True))
    wrong_types = [
        {"prompt": 5},
        {"prompt": None},
        {"prompt": ["a"]},
        {"messages": "hi"},
        {"messages": [1]},
        {"messages": [{"role": "robot", "content": "x"}]},
        {"messages": [{"role": "user", "content": 3}]},
        {"prompt": "x", "max_tokens": "10"},
        {"prompt": "x", "max_tokens": -1},
        {"prompt": "x", "max_tokens": 1.5},
        {"prompt": "x", "temperature": "hot"},
        {"prompt": "x", "temperature": -1},
        {"prompt": "x", "top_p": 0},
        {"prompt": "x", "mode": "warp"},
        {"prompt": "x", "mode": 3},
        {"prompt": "x", "stop": 5},
        {"prompt": "x", "stop": [1]},
        {"prompt": "x", "seed": "s"},
        {"prompt": "x", "messages": []},
        {},
        {"ping": "yes"},
        {"cancel": 1},
        {"ping": True, "prompt": "x"},
    ]
    for i in range(300):
        req = dict(rng.choice(wrong_types))
        req["id"] = f"wt{i}"
        out.append((json.dumps(req).encode(), True))
    for i in range(120):  # unknown fields
        out.append((json.dumps({"id": f"u{i}", "prompt": "x", f"field{i}": 1}).encode(), True))
    for i in range(120):  # missing or invalid ids
        body = rng.choice(
            [
                {"prompt": "x"},
                {"id": None, "prompt": "x"},
                {"id": True, "prompt": "x"},
                {"id": "", "prompt": "x"},
                {"id": [1], "prompt": "x"},
                {"id": {"a": 1}, "prompt": "x"},
            ]
        )
        out.append((json.dumps(body).encode(), True))
    for i in range(80):  # empty prompts
        out.append(
            (
                json.dumps(
                    rng.choice(
                        [
                            {"id": f"e{i}", "prompt": ""},
                            {"id": f"e{i}", "prompt": "   "},
                            {"id": f"e{i}", "messages": [{"role": "user", "content": ""}]},
                        ]
                    )
                ).encode(),
                True,
            )
        )
    for i in range(60):  # non-object JSON
        out.append((rng.choice([b"[]", b"null", b"42", b'"str"', b"true", b"[1,2]"]), True))
    for i in range(40):  # prompts over the context (256 tokens)
        out.append((json.dumps({"id": f"long{i}", "prompt": "word " * rng.randint(300, 3000)}).encode(), True))
    for i in range(3):  # megabyte-long lines
        out.append((json.dumps({"id": f"mb{i}", "prompt": "z" * 1_000_000}).encode(), True))
    out.append((b"x" * (5 << 20), True))  # over the line limit
    out.append((b"[" * 100000 + b"]" * 100000, True))  # recursion bomb
    for i in range(30):  # unknown cancel targets
        out.append((json.dumps({"id": f"nobody{i}", "cancel": True}).encode(), True))
    for i in range(20):  # blank lines: ignored by the protocol
        out.append((rng.choice([b"", b"   ", b"\t"]), False))
    rng.shuffle(out)
    return out


def test_stdio_survives_a_thousand_bad_lines(ss_model):
    rng = random.Random(0)
    lines = bad_lines(rng)
    expected_errors = sum(1 for _, e in lines if e)
    assert expected_errors >= 1000
    proc = subprocess.Popen(
        [*CLI, "serve", "--stdio", "--model", str(ss_model), "--max-context", "256"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    out_lines = []
    reader = threading.Thread(target=lambda: out_lines.extend(proc.stdout.readlines()))
    reader.start()
    err = []
    threading.Thread(target=lambda: err.extend(proc.stderr.readlines()), daemon=True).start()
    for line, _ in lines:
        proc.stdin.write(line + b"\n")
    proc.stdin.write(json.dumps({"id": "ok", "prompt": "hello", "max_tokens": 5}).encode() + b"\n")
    proc.stdin.write(b'{"id": "p", "ping": true}\n')
    proc.stdin.flush()
    proc.stdin.close()
    rc = proc.wait(timeout=300)
    reader.join(timeout=10)
    assert rc == 0, b"".join(err)[-2000:]
    events = [json.loads(l) for l in out_lines]  # every stdout line is JSON
    errors = [e for e in events if e["event"] == "error"]
    assert len(errors) == expected_errors
    codes = {e["code"] for e in errors}
    assert {
        "invalid_json",
        "invalid_utf8",
        "invalid_type",
        "unknown_field",
        "missing_id",
        "empty_prompt",
        "prompt_too_long",
        "line_too_long",
        "invalid_request",
        "not_found",
    } <= codes, codes
    done = [e for e in events if e["event"] == "done" and e["id"] == "ok"]
    assert (
        len(done) == 1 and done[0]["finish_reason"] in ("length", "stop") and done[0]["stats"]["generated_tokens"] >= 1
    )
    assert any(e["event"] == "pong" and e["id"] == "p" for e in events)


def test_python_client_protocol_and_cancel(ss_model):
    import importlib.util

    spec = importlib.util.spec_from_file_location("python_client", EXAMPLES / "python_client.py")
    client_mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(client_mod)
    SpecStreamClient = client_mod.SpecStreamClient

    client = SpecStreamClient(str(ss_model), executable=CLI)
    events = list(client.generate("hi there", max_tokens=6, mode="ar"))
    assert events[-1]["event"] == "done" and events[-1]["finish_reason"] == "length"
    tokens = "".join(e["text"] for e in events if e["event"] == "token")
    assert tokens == events[-1]["text"]
    # Same request in ss mode: identical greedy text.
    events_ss = list(client.generate("hi there", max_tokens=6, mode="ss"))
    assert events_ss[-1]["text"] == events[-1]["text"] and events_ss[-1]["stats"]["mode"] == "ss"
    # Cancel a long request right after sending it.
    client.send({"id": "long", "prompt": "go on", "max_tokens": 200})
    client.cancel("long")
    for ev in client.events():
        if ev.get("id") == "long" and ev["event"] in ("done", "error"):
            assert ev["event"] == "done" and ev["finish_reason"] == "cancelled"
            break
    # A chat request with a stop string.
    events = list(client.generate(messages=[{"role": "user", "content": "x"}], max_tokens=30, stop=["~"]))
    assert "~" not in events[-1]["text"]
    assert client.close() == 0


def test_chat_through_a_pipe(ss_model):
    script = "hello\n/stats\n/mode ar\nagain\n/temp 0.5\n/mode warp\n/reset\nbye\n/quit\n"
    r = subprocess.run(
        [*CLI, "chat", "--model", str(ss_model), "--max-tokens", "8"],
        input=script,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert r.returncode == 0, r.stderr
    assert "\x1b[" not in r.stdout  # no colours on a pipe
    assert "[mode ar]" in r.stdout and "[temperature 0.5]" in r.stdout and "[conversation reset]" in r.stdout
    assert "usage: /mode" in r.stderr
    summaries = [l for l in r.stderr.splitlines() if "tok/s" in l]
    assert len(summaries) == 3
    # The second turn reused the first turn's cached history.
    reused = int(summaries[1].split("reused ")[1].split()[0])
    assert reused > 10
    # After /reset nothing is reused.
    assert int(summaries[2].split("reused ")[1].split()[0]) == 0


def _free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


@pytest.fixture(scope="module")
def http_server(ss_model):
    port = _free_port()
    proc = subprocess.Popen(
        [*CLI, "serve", "--http", "--model", str(ss_model), "--port", str(port), "--max-context", "256"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    base = f"http://127.0.0.1:{port}"
    import urllib.request

    for _ in range(300):
        try:
            urllib.request.urlopen(base + "/health", timeout=1)
            break
        except Exception:
            time.sleep(0.1)
    else:
        proc.kill()
        raise RuntimeError(proc.stderr.read().decode())
    yield base, ss_model.name
    proc.terminate()
    proc.wait(timeout=30)


def test_http_with_openai_client(http_server):
    from openai import OpenAI

    base, model_id = http_server
    client = OpenAI(base_url=base + "/v1", api_key="none")
    assert [m.id for m in client.models.list().data] == [model_id]
    r = client.chat.completions.create(
        model=model_id, messages=[{"role": "user", "content": "hi"}], max_tokens=8, temperature=0
    )
    text = r.choices[0].message.content
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 8
    chunks = list(
        client.chat.completions.create(
            model=model_id, messages=[{"role": "user", "content": "hi"}], max_tokens=8, temperature=0, stream=True
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason == "length"
    c = client.completions.create(model=model_id, prompt="abc", max_tokens=5, temperature=0)
    assert c.choices[0].finish_reason == "length" and c.usage.completion_tokens == 5
    streamed = list(client.completions.create(model=model_id, prompt="abc", max_tokens=5, temperature=0, stream=True))
    assert "".join(s.choices[0].text for s in streamed) == c.choices[0].text


def test_http_errors_are_4xx_json_and_server_keeps_serving(http_server):
    import urllib.error
    import urllib.request

    from openai import BadRequestError, NotFoundError, OpenAI

    base, model_id = http_server
    client = OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
    with pytest.raises(NotFoundError):
        client.chat.completions.create(model="gpt-17", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(BadRequestError) as e:
        client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "w " * 400}])
    assert "context" in str(e.value)

    def post(data: bytes, path="/v1/chat/completions"):
        req = urllib.request.Request(base + path, data=data, headers={"Content-Type": "application/json"})
        try:
            urllib.request.urlopen(req, timeout=30)
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read())
        return 200, None

    for bad in (
        b"{not json",
        b"[]",
        b'{"messages": 3}',
        b'{"messages": [{"role": "user"}]}',
        b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": "many"}',
        b"\xff\xfe",
    ):
        status, body = post(bad)
        assert 400 <= status < 500 and "error" in body and body["error"]["message"]
    status, body = post(b'{"prompt": "' + b"a" * (2 << 20) + b'"}', "/v1/completions")
    assert status == 413 and body["error"]["code"] == "body_too_large"
    status, _ = post(b"{}", "/v1/nowhere")
    assert status == 404
    # Still serving.
    r = client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "ok"}], max_tokens=3)
    assert r.choices[0].message.content is not None


def test_bench_writes_json_markdown_and_chart(ss_model, tmp_path):
    out = tmp_path / "b.json"
    r = subprocess.run(
        [
            *CLI,
            "bench",
            "--model",
            str(ss_model),
            "--prompts",
            "2",
            "--max-tokens",
            "8",
            "--json",
            str(out),
            "--draft",
            "",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, SPECSTREAM_CACHE_DIR=str(tmp_path)),
    )
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    for k in ("cpu", "cores", "os", "mlx", "device", "blas"):
        assert k in res["machine"]
    methods = {x["method"]: x for x in res["results"]}
    assert {"ar", "mlx_lm", "lookup", "ss", "ar@0.7", "ss@0.7"} <= set(methods)
    for x in res["results"]:
        for k in (
            "method",
            "temperature",
            "tokens_per_second_median",
            "speedup_vs_ar",
            "tokens_per_pass",
            "ttft_ms",
            "peak_memory_gb",
            "matches_ar",
        ):
            assert k in x
    # Greedy lossless methods reproduce ar exactly; sampling rows have no such check.
    assert methods["ss"]["matches_ar"] is True and methods["lookup"]["matches_ar"] is True
    assert methods["mlx_lm"]["matches_ar"] is True
    assert methods["ss@0.7"]["matches_ar"] is None
    assert out.with_suffix(".md").read_text().count("\n| ") >= 6
    assert out.with_suffix(".png").stat().st_size > 1000
