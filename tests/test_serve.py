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
        {"prompt": "x", "stop": ""},  # had stopped every reply before its first token
        {"prompt": "x", "stop": ["a", ""]},
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


def test_http_with_openai_client(http_server, ss_model):
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
    # Both paths give plain greedy decoding's reply (not merely each other's).
    from specstream_mlx import generate, load

    model, tok = load(str(ss_model), warn=False)
    assert generate(model, tok, [{"role": "user", "content": "hi"}], max_tokens=8, mode="ar").text == text
    c = client.completions.create(model=model_id, prompt="abc", max_tokens=5, temperature=0)
    assert c.choices[0].finish_reason == "length" and c.usage.completion_tokens == 5
    streamed = list(client.completions.create(model=model_id, prompt="abc", max_tokens=5, temperature=0, stream=True))
    assert "".join(s.choices[0].text for s in streamed) == c.choices[0].text


def test_http_errors_are_4xx_json_and_server_keeps_serving(http_server):
    import urllib.error
    import urllib.request

    from openai import BadRequestError, OpenAI

    base, model_id = http_server
    client = OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
    # Any model name addresses the one model served (clients hard-code names).
    r = client.chat.completions.create(model="gpt-17", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert r.choices[0].message.content is not None
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
    out = tmp_path / "reports" / "b.json"  # a folder that does not exist yet is made
    # Your own prompts, in train's formats (messages with a reference reply, plain prompt).
    pf = tmp_path / "valid.jsonl"
    rows = [
        {"messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"}]},
        {"prompt": "abc"},
        {"prompt": "unused"},
    ]
    pf.write_text("".join(json.dumps(x) + "\n" for x in rows))
    bad = subprocess.run(
        [*CLI, "bench", "--model", str(ss_model), "--prompts-file", str(tmp_path / "nope.jsonl")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 1 and "nope.jsonl" in bad.stderr and "Traceback" not in bad.stderr
    # A report that cannot be written is refused before the run, not after its minutes.
    (tmp_path / "a-file").write_text("")
    for cmd in (["bench", "--model", str(ss_model)], ["floor", "--model", str(ss_model)]):
        for where in (tmp_path / "a-file" / "b.json", tmp_path):
            bad = subprocess.run([*CLI, *cmd, "--json", str(where)], capture_output=True, text=True, timeout=120)
            lines = bad.stderr.strip().splitlines()
            assert bad.returncode == 1 and len(lines) == 1 and "--json" in lines[0], (cmd, where, bad.stderr)
            assert str(where) in lines[0] and "Traceback" not in bad.stderr, bad.stderr
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
            "--prompts-file",
            str(pf),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, SPECSTREAM_MLX_CACHE=str(tmp_path)),
    )
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    assert res["settings"]["prompts"] == 2 and res["settings"]["prompts_file"] == "valid.jsonl"
    # --tree auto's pass kind, measured per decoding kind, is recorded with the run.
    assert set(res["settings"]["ss_passes"]) == {"greedy", "sampled"}
    assert set(res["settings"]["ss_passes"].values()) <= {"compiled", "op by op"}
    assert "ss passes" in out.with_suffix(".md").read_text()
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


def _start_server(model_dir, *extra):
    port = _free_port()
    proc = subprocess.Popen(
        [*CLI, "serve", "--http", "--model", str(model_dir), "--port", str(port), *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    import urllib.request

    headers = {"Authorization": "Bearer s3cret"} if "--api-key" in extra else {}
    for _ in range(300):
        try:
            urllib.request.urlopen(
                urllib.request.Request(f"http://127.0.0.1:{port}/health", headers=headers), timeout=1
            )
            return proc, port
        except Exception:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError(proc.stderr.read().decode())


def _raw(port, request: bytes, timeout=30.0):
    """Send raw bytes; (status, headers text, body bytes) of the answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as c:
        c.sendall(request)
        data = b""
        while True:
            chunk = c.recv(65536)
            if not chunk:
                break
            data += chunk
            head, _, body = data.partition(b"\r\n\r\n")
            if b"content-length:" in head.lower():
                n = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                if len(body) >= n:
                    break
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), head.decode("latin-1"), body


def _post(port, body, path="/v1/chat/completions", headers=""):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n{headers}"
        f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n"
    ).encode() + data
    return _raw(port, req)


def test_http_security_defaults(ss_model):
    proc, port = _start_server(ss_model, "--api-key", "s3cret", "--allowed-origins", "http://ok.example")
    try:
        ok = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        key = "Authorization: Bearer s3cret\r\n"
        assert _post(port, ok)[0] == 401  # no key
        assert _post(port, ok, headers="Authorization: Bearer wrong\r\n")[0] == 401
        assert _post(port, ok, headers=key)[0] == 200
        # DNS rebinding: a foreign Host name is refused even with the key.
        req = b"GET /v1/models HTTP/1.1\r\nHost: evil.example:80\r\nAuthorization: Bearer s3cret\r\n"
        assert _raw(port, req + b"Connection: close\r\n\r\n")[0] == 403
        # CSRF: a browser request from a foreign origin is refused; an allowed origin gets CORS headers.
        assert _post(port, ok, headers=key + "Origin: http://evil.example\r\n")[0] == 403
        status, head, _ = _post(port, ok, headers=key + "Origin: http://ok.example\r\n")
        assert status == 200 and "Access-Control-Allow-Origin: http://ok.example" in head
        pre = b"OPTIONS /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nAccess-Control-Request-Method: POST\r\n"
        status, head, _ = _raw(port, pre + b"Origin: http://ok.example\r\nConnection: close\r\n\r\n")
        assert status == 204 and "Access-Control-Allow-Origin: http://ok.example" in head
        assert _raw(port, pre + b"Origin: http://evil.example\r\nConnection: close\r\n\r\n")[0] == 403
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    # Binding beyond loopback without a key warns.
    p = subprocess.Popen(
        [*CLI, "serve", "--http", "--model", str(ss_model), "--host", "0.0.0.0", "--port", str(_free_port())],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        lines = [p.stderr.readline() for _ in range(3)]  # up to the "serving on" line
    finally:
        p.terminate()
        p.wait(timeout=30)
    assert any("without --api-key" in line for line in lines), lines


def test_http_compatibility_and_bad_values(http_server):
    base, model_id = http_server
    port = int(base.rsplit(":", 1)[1])
    msg = [{"role": "user", "content": "hi"}]
    status, _, body = _raw(port, "GET /v1/models?x=1 HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n".encode())
    assert status == 200 and json.loads(body)["data"][0]["id"] == model_id
    status, head, body = _raw(
        port, b"PUT /v1/models HTTP/1.1\r\nHost: localhost\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    )
    assert status == 405 and "application/json" in head and json.loads(body)["error"]
    # max_tokens above the context left is capped, not refused (context 256).
    status, _, body = _post(port, {"messages": msg, "max_tokens": 100000, "temperature": 0})
    out = json.loads(body)
    assert status == 200 and out["usage"]["total_tokens"] <= 256
    # Tiny temperatures decode greedily; NaN-like and surrogate inputs are 400s.
    greedy = json.loads(_post(port, {"messages": msg, "max_tokens": 6, "temperature": 0})[2])
    tiny = json.loads(_post(port, {"messages": msg, "max_tokens": 6, "temperature": 1e-38})[2])
    assert tiny["choices"][0]["message"]["content"] == greedy["choices"][0]["message"]["content"]
    for bad in (
        b'{"messages": [{"role": "user", "content": "\\ud800"}]}',
        b'{"messages": [{"role": "user", "content": "x"}], "top_p": NaN}',
        b'{"prompt": "x", "temperature": Infinity}',
    ):
        path = "/v1/completions" if b'"prompt"' in bad else "/v1/chat/completions"
        status, _, body = _post(port, bad, path)
        assert status == 400 and json.loads(body)["error"]["code"] in ("invalid_value", "invalid_json"), body
    req = b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Length: -5\r\nConnection: close\r\n\r\n"
    assert _raw(port, req)[0] == 400
    # stream_options.include_usage: a last chunk with the usage.
    status, _, body = _post(
        port, {"messages": msg, "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}}
    )
    chunks = [json.loads(line[6:]) for line in body.decode().splitlines() if line.startswith("data: {")]
    assert chunks[-1]["usage"]["completion_tokens"] == 3 and chunks[-1]["choices"] == []


def test_http_disconnect_cancels_and_slow_clients_time_out(ss_model):
    proc, port = _start_server(ss_model, "--max-context", "8192", "--timeout", "1", "--max-connections", "3")
    try:
        # (this tiny model continues "zzz" without an EOS for thousands of tokens)
        long = json.dumps({"prompt": "zzz", "max_tokens": 8000, "temperature": 0}).encode()
        c = socket.create_connection(("127.0.0.1", port))
        c.sendall(
            f"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Length: {len(long)}\r\n\r\n".encode() + long
        )
        time.sleep(0.5)
        c.close()  # the client gives up: its generation must stop
        time.sleep(0.3)
        t = time.perf_counter()
        status, _, _ = _post(port, {"prompt": "hi", "max_tokens": 2}, "/v1/completions")
        assert status == 200 and time.perf_counter() - t < 5
        # A client that sends half a request is dropped after the timeout.
        slow = socket.create_connection(("127.0.0.1", port))
        slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Length: 100\r\n\r\n{")
        slow.settimeout(10)
        t = time.perf_counter()
        answer = slow.recv(1000)
        assert time.perf_counter() - t < 5
        assert answer == b"" or answer.startswith(b"HTTP/1.1 4"), answer
        slow.close()
        # Beyond the connection cap: idle connections give up their slots (docs/SECURITY.md) ...
        health = b"GET /health HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
        idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(3)]
        time.sleep(0.2)
        assert _raw(port, health)[0] == 200
        for s in idle:
            s.close()
        # ... and when every slot holds a request being served, 503 at once. (Streamed: the
        # response head arrives as soon as a request is accepted, queued or generating.)
        streamed = json.dumps({"prompt": "zzz", "max_tokens": 8000, "temperature": 0, "stream": True}).encode()
        busy = []
        for _ in range(3):
            b = socket.create_connection(("127.0.0.1", port), timeout=30)
            b.sendall(
                f"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Length: {len(streamed)}\r\n\r\n".encode()
                + streamed
            )
            head = b""
            while b"\r\n\r\n" not in head:
                head += b.recv(4096)
            assert head.startswith(b"HTTP/1.1 200"), head
            busy.append(b)
        assert _raw(port, health)[0] == 503
        for b in busy:
            b.close()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    log = proc.stderr.read().decode()
    assert "Traceback" not in log and "tok/s" in log  # per-request access-log lines


def test_stdio_ready_event_and_signals(ss_model):
    """SIGINT (exit 130) and SIGTERM (exit 0) cancel the running and queued requests, each
    ending with done/cancelled, with stdin still open; a closed stdout ends the server
    quietly; a model that cannot load gives one error event and exit 1."""
    import signal

    def start():
        p = subprocess.Popen(
            [*CLI, "serve", "--stdio", "--model", str(ss_model)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        ready = json.loads(p.stdout.readline())
        assert ready["event"] == "ready" and ready["id"] is None and "ar" in ready["modes"]
        for rid in ("L", "Q"):  # a long request and one queued behind it
            p.stdin.write((json.dumps({"id": rid, "prompt": "a", "max_tokens": 4000, "mode": "ar"}) + "\n").encode())
        p.stdin.flush()
        assert json.loads(p.stdout.readline())["event"] == "token"
        return p

    for sig, code in ((signal.SIGINT, 130), (signal.SIGTERM, 0)):
        p = start()
        p.send_signal(sig)
        rest = [json.loads(line) for line in p.stdout]  # every line whole, up to EOF
        assert p.wait(timeout=30) == code
        done = {e["id"]: e for e in rest if e["event"] == "done"}
        assert done["L"]["finish_reason"] == "cancelled" and done["Q"]["finish_reason"] == "cancelled"
        assert b"Fatal Python error" not in p.stderr.read()
    p = start()
    p.stdout.close()  # the reader goes away
    assert p.wait(timeout=30) == 0
    assert b"Fatal Python error" not in p.stderr.read()
    r = subprocess.run(
        [*CLI, "serve", "--stdio", "--model", str(ss_model) + "-missing"], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 1
    ev = json.loads(r.stdout.strip())
    assert ev["event"] == "error" and ev["code"] == "load_failed" and "missing" in ev["message"]


def test_bench_rotates_the_method_order_per_prompt():
    """Each method takes every position in the per-prompt order equally often, and each
    method's runs stay in (round, prompt) order for pairing across methods."""
    from collections import Counter

    from specstream_mlx.bench.runner import _run_all

    calls = []

    def method(name):
        def fn(i):
            calls.append((name, i))
            return (name, i)

        return fn

    names = ["ar", "ss", "lookup"]
    runs = _run_all({n: method(n) for n in names}, n_prompts=3, rounds=2, progress=False)
    timed = calls[len(names) :]  # after one warm-up each
    positions = Counter((name, k % len(names)) for k, (name, _) in enumerate(timed))
    assert all(positions[(n, p)] == 2 for n in names for p in range(len(names)))
    assert all(runs[n] == [(n, i) for _ in range(2) for i in range(3)] for n in names)


def test_bench_closes_its_progress_bar_before_an_error_is_said(capsys):
    """A run that fails (a prompt the model cannot take) had left the bar open: tqdm drew its
    last line after the CLI's error, so the error was not the output's last line."""
    from specstream_mlx.bench.runner import _run_all

    def fails(i):
        if i == 1:
            raise ValueError("token id 201 is outside the model's vocabulary")
        return i

    from tqdm import tqdm

    with pytest.raises(ValueError) as failure:  # held, as the CLI holds it while it says the error
        _run_all({"ar": fails}, n_prompts=2, rounds=1, progress=True)
    assert "bench" in capsys.readouterr().err  # the bar was drawn
    assert not list(getattr(tqdm, "_instances", [])), "a bar left open draws after the error"
    del failure


def test_decode_prompts_sums_what_sweeps_compare(ss_model):
    """The examples' shared decoding loop: figures after each prompt's first step, summed."""
    from specstream_mlx import load
    from specstream_mlx.bench import decode_prompts

    model, tok = load(str(ss_model), warn=False)
    ids = [tok.encode(p) for p in ("the cat sat", "a b c d e", "hello there")]
    ar = decode_prompts(model, tok, ids, "ar", max_tokens=20)
    ss = decode_prompts(model, tok, ids, "ss", "dynamic:4", max_tokens=20)
    assert ar.steps == ar.tokens > 0 and ar.draft_nodes == 0  # one token per plain step
    assert ss.tokens == ar.tokens and ss.steps <= ss.tokens  # greedy ss decides the same tokens
    assert ss.draft_nodes > 0 and 0.0 <= ss.pruned_share <= 1.0
    assert ar.seconds > 0 and abs(ar.seconds_per_step * ar.steps - ar.seconds) < 1e-9


def test_bench_runs_mlx_lm_on_the_weights_and_dtype_ours_runs(tmp_path, tiny_model_dir):
    """On the CPU backend our loader expands quantized weights to float32; the mlx_lm peer
    of `bench` must do the same, or the comparison times 4-bit matmuls against float32 ones."""
    import mlx.core as mx
    import mlx.nn as nn
    import mlx_lm
    from mlx.utils import tree_flatten

    from specstream_mlx.bench.runner import _f32
    from specstream_mlx.convert import ConvertOptions, convert

    q = convert(str(tiny_model_dir), str(tmp_path / "q4"), ConvertOptions(quantize=True, q_group_size=32))
    theirs, _ = mlx_lm.load(str(q))
    assert any(isinstance(m, nn.QuantizedLinear) for _, m in theirs.named_modules())
    _f32(theirs)
    if mx.default_device() == mx.cpu:
        assert not any(isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) for _, m in theirs.named_modules())
        assert all(
            v.dtype == mx.float32 for _, v in tree_flatten(theirs.parameters()) if mx.issubdtype(v.dtype, mx.floating)
        )


def test_bench_runs_its_mlx_lm_peer_with_condition_waits_that_sleep(monkeypatch):
    """The forwarder's library makes condition waits poll before they sleep (our decoding's
    builder thread wakes without a system call); `bench` runs the mlx_lm peer with that
    paused, as it runs without this project, and restores it after (also when the peer
    fails)."""
    from types import SimpleNamespace

    import mlx_lm

    from specstream_mlx import platform_info as P
    from specstream_mlx.bench import runner

    if P.cond_spin_us() == 0:
        pytest.fail("condition waits do not poll here: run under `make test` (the forwarder preloaded)")
    before, seen = P.cond_spin_us(), []

    def fake(model, tok, ids, **kw):
        for t in ids:
            seen.append(P.cond_spin_us())
            yield SimpleNamespace(token=t, text=str(t))
        if ids[0] == 99:
            raise RuntimeError("the peer failed")

    monkeypatch.setattr(mlx_lm, "stream_generate", fake)
    setup = runner.BenchSetup([{}, {}], [[5, 6, 7], [99]], 8, 0.0, 0)
    run = runner._mlx_lm(None, SimpleNamespace(eos_token_ids={7}), setup)
    assert run(0).tokens == [5, 6] and seen == [0, 0, 0] and P.cond_spin_us() == before
    with pytest.raises(RuntimeError):
        run(1)
    assert seen[-1] == 0 and P.cond_spin_us() == before


def test_http_worker_decodes_each_client_with_its_own_auto_policy(ss_model):
    """The server keeps the per-client ``--tree auto`` policies: a client's requests run
    with its own policy (shared pass costs), a request without an owner with the model's."""

    from specstream_mlx import load
    from specstream_mlx.runtime.sampling import SamplingParams
    from specstream_mlx.serve.http import App
    from specstream_mlx.serve.protocol import GenerationRequest

    model, tok = load(str(ss_model), warn=False)
    app = App(model, tok, "m", "ss", 256, ["ss", "ar"])
    used = []
    real = app.session.stream_ids

    def spy(ids, **kw):
        used.append(kw["policy"])
        return real(ids, **kw)

    app.session.stream_ids = spy
    queues = [
        app.submit(GenerationRequest(owner, None, [1, 2, 3], 4, SamplingParams(), mode, [], owner=owner))
        for owner, mode in (("alice", "ss"), ("bob", "ss"), ("alice", "ss"), (None, "ss"), ("alice", "ar"))
    ]
    stop, outcomes = threading.Event(), []

    def collect():  # MLX work stays on the thread that loaded the model (as in the server)
        for events in queues:
            while True:
                kind, value = events.get(timeout=120)
                if kind != "delta":
                    outcomes.append((kind, value))
                    break
        stop.set()

    threading.Thread(target=collect, daemon=True).start()
    app.work_forever(stop)
    assert [k for k, _ in outcomes] == ["done"] * 5, outcomes
    alice, bob, alice_again, shared, plain = used
    assert alice is not None and bob is not None and alice is not bob and alice_again is alice
    assert alice.costs is bob.costs is model.tuner(SamplingParams()).costs
    assert shared is None and plain is None  # the model's shared policy; ar has none
    assert len(app.policies) == 2


def test_bench_refuses_a_draft_model_it_cannot_use_before_loading(tmp_path, tiny_model_dir):
    """bench --draft naming a folder that holds no model had been a bare "[Errno 2] …
    config.json" after the model loaded; a draft with another vocabulary (demo-sql's 1,024 tokens for demo-chat's 4,096)
    had been timed as if mlx-lm's speculative decoding could verify its ids."""
    from specstream_mlx.bench.runner import _draft_path

    with pytest.raises(ValueError, match="--draft .*nowhere: no such model directory"):
        _draft_path(tiny_model_dir, str(tmp_path / "nowhere"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="--draft .*empty: not a model directory"):
        _draft_path(tiny_model_dir, str(tmp_path / "empty"))
    other = tmp_path / "other"
    other.mkdir()
    cfg = json.loads((tiny_model_dir / "config.json").read_text())
    (other / "config.json").write_text(json.dumps(dict(cfg, vocab_size=cfg["vocab_size"] + 1)))
    with pytest.raises(ValueError, match=f"a vocabulary of {cfg['vocab_size'] + 1} tokens, the model's has"):
        _draft_path(tiny_model_dir, str(other))
    assert _draft_path(tiny_model_dir, str(tiny_model_dir)) == tiny_model_dir  # the same vocabulary: taken
