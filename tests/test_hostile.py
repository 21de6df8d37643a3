"""A hostile client and hostile files: refusals that close, clean start-up errors, no
deleted user directories, no model code run, escaped logs, shards inside their directory."""

import json
import shutil
import socket
import subprocess
import time

import pytest

from tests.helpers.tiny_models import copy_model
from tests.test_serve import CLI, _free_port, _start_server


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from tests.helpers.tiny_models import make_tiny_model_dir

    model = make_tiny_model_dir(tmp_path_factory.mktemp("hostile") / "m")
    proc, port = _start_server(model)
    yield proc, port, model
    proc.terminate()
    proc.wait(timeout=30)


def _exchange(port: int, raw: bytes, timeout=30.0) -> bytes:
    """Send raw bytes on a new connection; everything read back until it closes or goes quiet."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as c:
        c.sendall(raw)
        return _read_all(c, timeout=timeout)


def _read_all(c: socket.socket, timeout=10.0) -> bytes:
    c.settimeout(timeout)
    data = b""
    while True:
        try:
            chunk = c.recv(65536)
        except socket.timeout:
            break
        if not chunk:
            break
        data += chunk
    return data


def test_refused_request_bodies_are_never_run_as_requests(server):
    """Request smuggling: a refused request's body, on a kept-alive connection, must not be
    parsed as a second request that escapes the outer request's Origin."""
    _, port, _ = server
    for inner in (
        b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\n\r\n",
        b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
        b'Content-Length: 31\r\n\r\n{"prompt":"hi","max_tokens":2}\n',
    ):
        outer = (
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nOrigin: https://evil.example\r\n"
            f"Content-Type: text/plain\r\nContent-Length: {len(inner)}\r\n\r\n"
        ).encode() + inner
        data = _exchange(port, outer, timeout=10)
        statuses = [line.split()[1] for line in data.split(b"\r\n") if line.startswith(b"HTTP/1.")]
        assert statuses == [b"403"], data[:400]
        assert b"connection: close" in data.lower()


def test_log_escapes_control_characters(tmp_path):
    from tests.helpers.tiny_models import make_tiny_model_dir

    model = make_tiny_model_dir(tmp_path / "m")
    proc, port = _start_server(model)
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as c:
            c.sendall(b"GET /x\x1b[31mred\x07\x00 HTTP/1.1\r\nHost: localhost\r\n\r\n")
            _read_all(c, timeout=3)
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    assert b"\x1b" not in err and b"\x07" not in err and b"\x00" not in err
    assert b"\\x1b[31mred\\x07" in err


def test_port_in_use_and_ipv6_loopback(tmp_path, server):
    _, port, model = server
    r = subprocess.run(
        [*CLI, "serve", "--http", "--model", str(model), "--port", str(port)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    errors = [line for line in r.stderr.splitlines() if "error:" in line]
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert len(errors) == 1 and f"cannot listen on 127.0.0.1:{port}" in errors[0]
    if not socket.has_ipv6:
        return
    try:
        socket.socket(socket.AF_INET6).bind(("::1", 0))
    except OSError:
        return  # no IPv6 loopback on this machine
    port6 = _free_port()
    proc = subprocess.Popen(
        [*CLI, "serve", "--http", "--model", str(model), "--host", "::1", "--port", str(port6)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        for _ in range(300):
            try:
                with socket.create_connection(("::1", port6), timeout=1) as c:
                    c.sendall(f"GET /health HTTP/1.1\r\nHost: [::1]:{port6}\r\nConnection: close\r\n\r\n".encode())
                    assert b" 200 " in _read_all(c).split(b"\r\n")[0]
                break
            except ConnectionRefusedError:
                time.sleep(0.1)
        else:
            raise AssertionError(proc.stderr.read().decode())
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_force_replaces_model_directories_only(tmp_path, tiny_model_dir):
    precious = tmp_path / "precious"
    (precious / "sub").mkdir(parents=True)
    (precious / "precious.txt").write_text("keep me")
    for args in (
        ["convert", "--hf-path", str(tiny_model_dir), "--mlx-path", str(precious), "--force"],
        ["export", "--model", str(tiny_model_dir), "--hf-path", str(precious), "--force"],
    ):
        r = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=120)
        errors = [line for line in r.stderr.splitlines() if "error:" in line]
        assert r.returncode == 1 and len(errors) == 1 and "not a model directory" in errors[0], r.stderr
        assert (precious / "precious.txt").read_text() == "keep me" and (precious / "sub").is_dir()
    from specstream_mlx.train import TrainConfig, TrainError, train

    with pytest.raises(TrainError, match="not a model directory"):
        train(str(tiny_model_dir), str(tmp_path), str(precious), TrainConfig(iters=1, force=True), progress=False)
    assert (precious / "precious.txt").exists()
    # a model directory is replaced, and the new one has the usual permissions
    out = tmp_path / "model"
    for _ in range(2):
        r = subprocess.run(
            [*CLI, "convert", "--hf-path", str(tiny_model_dir), "--mlx-path", str(out), "--force"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 0, r.stderr
    assert (out / "config.json").exists() and (out.stat().st_mode & 0o777) == 0o777 & ~_umask()


def _umask() -> int:
    import os

    m = os.umask(0)
    os.umask(m)
    return m


def test_tokenizer_custom_code_is_refused_in_one_line(tmp_path, tiny_model_dir):
    d = tmp_path / "m"
    copy_model(tiny_model_dir, d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["auto_map"] = {"AutoTokenizer": ["evil.EvilTokenizer", None]}
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    (d / "evil.py").write_text("open('PWNED', 'w').write('ran')\n")
    r = subprocess.run(
        [*CLI, "serve", "--stdio", "--model", str(d)],
        input="y\n",
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert not (tmp_path / "PWNED").exists()
    lines = [json.loads(line) for line in r.stdout.splitlines()]
    assert len(lines) == 1 and lines[0]["code"] == "load_failed" and "auto_map" in lines[0]["message"]


def test_a_tokenizer_with_ids_past_the_vocabulary_is_refused_not_decoded(tmp_path, hf_models):
    """A model directory holding a tokenizer with more ids than the model's vocabulary (here
    the byte tokenizer beside a 151-token model): its ids past the embedding table had been
    decoded from whatever memory follows it (fluent garbage, exit 0) by generate, distill,
    measure-acceptance and calibrate-pruning; eval-bfcl's error had been a traceback."""
    from specstream_mlx import generate, load
    from specstream_mlx.convert import ConvertOptions, convert
    from specstream_mlx.demo.byte_tokenizer import save_byte_tokenizer
    from specstream_mlx.runtime.bounded import PromptError

    _, src, _ = hf_models("llama-q")
    d = convert(str(src), str(tmp_path / "m"), ConvertOptions(dtype="float32", num_streams=2, stream_layers=1))
    save_byte_tokenizer(d)
    data = tmp_path / "data"
    data.mkdir()
    for split in ("train", "valid"):
        (data / f"{split}.jsonl").write_text('{"text": "hello there"}\n')
    bfcl = tmp_path / "bfcl"
    bfcl.mkdir()
    row = {"id": "simple_0", "category": "simple", "tools": [], "ground_truth": [], "messages": []}
    row["messages"] = [{"role": "user", "content": "hello there"}]
    (bfcl / "test.jsonl").write_text(json.dumps(row) + "\n")
    # (bench takes the same check as generate: stream_generate's)
    for args in (
        ["generate", "--prompt", "hello there", "-m", "4", "--temp", "0"],
        ["eval-bfcl", "--data", str(bfcl), "--mode", "ar"],
        ["measure-acceptance", "--prompts", str(data)],
        ["calibrate-pruning", "--data", str(data)],
    ):
        r = subprocess.run([*CLI, args[0], "--model", str(d), *args[1:]], capture_output=True, text=True, timeout=120)
        assert r.returncode != 0 and "Traceback" not in r.stderr, (args, r.stderr)
        assert "outside the model's vocabulary (0..150)" in r.stderr.strip().splitlines()[-1], (args, r.stderr)
    from specstream_mlx.train.data import DataError
    from specstream_mlx.train.distill import DistillOptions, distill

    with pytest.raises(DataError, match=r"\(valid\): token id \d+ is outside the model's vocabulary \(0..150\)"):
        distill(str(d), str(data), str(tmp_path / "replies"), DistillOptions(max_tokens=4))
    assert not (tmp_path / "replies").exists()  # nothing written: every split is checked first
    model, tok = load(str(d))
    with pytest.raises(PromptError, match="token id 201"):
        generate(model, tok, "hello there", max_tokens=4)
    assert generate(model, tok, [3, 4, 5], max_tokens=4).tokens  # ids inside it decode as before


def test_text_that_is_not_utf8_or_unicode_is_one_line_naming_where(tmp_path, tiny_model_dir):
    """Bytes that are not UTF-8 (a Latin-1 file, a pasted line) and JSON escapes of lone
    surrogates had reached the tokenizer: `tokenizers`' "TextInputSequence must be str" as
    generate's error, a traceback from the training-data readers, and, under a locale that
    reads stdin strictly (macOS's en_US.UTF-8), a decoding traceback that ended `chat` (the
    conversation lost) and `generate -p -`. A line nested too deeply for the JSON parser had
    been a RecursionError traceback, an integer of 5,000 digits a ValueError without the
    file; `--tools` nested too deeply, a traceback."""
    import os
    import re

    from specstream_mlx.io.prompts import PromptFileError, read_prompt_rows
    from specstream_mlx.tasks.evaluate import read_test_rows
    from specstream_mlx.train.data import DataError, load_dataset

    strict = dict(os.environ, PYTHONIOENCODING="utf-8:strict")
    model = ["--model", str(tiny_model_dir), "-m", "3"]

    def run(args, stdin=b""):
        r = subprocess.run([*CLI, *args], input=stdin, capture_output=True, env=strict, timeout=120)
        return r.returncode, r.stderr.decode("utf-8", "replace")

    tools = tmp_path / "tools.json"
    tools.write_text("[" * 100000 + "]" * 100000)
    for args, stdin, said in (
        (["generate", *model, "-p", "hi", "--tools", str(tools)], b"", "tools.json: not JSON (nested too deeply)"),
        (["generate", *model, "-p", b"caf\xe9"], b"", "--prompt is not UTF-8 text: byte 0xe9 at character 4"),
        (["generate", *model, "-p", "-"], b"hi \xff\n", "standard input is not UTF-8 text: byte 0xff at character 4"),
        (["generate", *model, "-p", "hi", "--system-prompt", b"\xfe"], b"", "--system-prompt is not UTF-8"),
    ):
        code, err = run(args, stdin)
        assert code == 1 and "Traceback" not in err, (args, err)
        assert said in err.strip().splitlines()[-1], (args, err)
    code, err = run(["chat", *model], b"caf\xe9 au lait\nhello\n")
    assert code == 0 and "Traceback" not in err, err
    assert "[not sent: the line is not UTF-8 text: byte 0xe9 at character 4]" in err
    assert err.count("tok/s") == 1  # the next line is answered
    # Files: the line and what is wrong with it, for every reader of user JSONL.
    for name, line, said in (
        ("latin1", b'{"text": "caf\xe9"}\n', ":2: not UTF-8 text: byte 0xe9 at character 14"),
        ("escape", b'{"text": "a \\ud800 b"}\n', ":2: not Unicode text: a lone surrogate U+D800 at character 3"),
        ("key", b'{"\\udc80": 1, "text": "x"}\n', ":2: not Unicode text: a lone surrogate U+DC80 at character 1"),
        ("deep", b"[" * 100000 + b"]" * 100000 + b"\n", ":2: invalid JSON (nested too deeply)"),  # was a RecursionError
        ("digits", b'{"text": "x", "n": ' + b"9" * 5000 + b"}\n", ":2: invalid JSON (Exceeds the limit"),
    ):
        data = tmp_path / name
        data.mkdir()
        for split in ("train", "valid"):
            (data / f"{split}.jsonl").write_bytes(b'{"messages": [{"role": "user", "content": "fine"}]}\n' + line)
        with pytest.raises(DataError, match=re.escape(f"train.jsonl{said}")):
            load_dataset(str(data), _tokenizer(tiny_model_dir), 64)
        with pytest.raises(PromptFileError, match=re.escape(f"valid.jsonl{said}")):
            read_prompt_rows(data / "valid.jsonl")
        with pytest.raises(ValueError, match=re.escape(f"valid.jsonl{said}")):
            read_test_rows(data / "valid.jsonl")
    from specstream_mlx.runtime.bounded import PromptError
    from specstream_mlx.runtime.generation import encode_prompt

    with pytest.raises(PromptError, match=re.escape("the user's text is not Unicode text: a lone surrogate U+D800")):
        encode_prompt(_tokenizer(tiny_model_dir), "a \ud800")  # the library's callers, e.g. a JSON file's prompt
    out = tmp_path / "streams"
    code, err = run(["train", "--model", str(tiny_model_dir), "--data", str(tmp_path / "escape"), "--out", str(out)])
    assert code != 0 and "Traceback" not in err, err
    assert "train.jsonl:2: not Unicode text: a lone surrogate U+D800" in err.strip().splitlines()[-1], err
    assert not out.exists()


def _tokenizer(model_dir):
    from specstream_mlx.io.loading import load_tokenizer

    return load_tokenizer(model_dir)


def test_index_shards_must_stay_inside_the_model_directory(tmp_path, tiny_model_dir):
    src = tmp_path / "hf"
    copy_model(tiny_model_dir, src, streams=False)
    outside = tmp_path / "outside.safetensors"
    shutil.move(src / "model.safetensors", outside)
    (src / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"model.norm.weight": "../outside.safetensors"}})
    )
    r = subprocess.run(
        [*CLI, "convert", "--hf-path", str(src), "--mlx-path", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    errors = [line for line in r.stderr.splitlines() if "error:" in line]
    assert r.returncode == 1 and len(errors) == 1 and "outside the model directory" in errors[0], r.stderr
    assert not (tmp_path / "out").exists()


def _http(port, body: bytes, path="/v1/chat/completions", host=None):
    host = host or f"127.0.0.1:{port}"
    req = (
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode() + body
    head, _, payload = _exchange(port, req).partition(b"\r\n\r\n")
    return int(head.split()[1]), payload


def test_client_errors_are_4xx_not_500(tmp_path, tiny_model_dir):
    """Bad content parts, a template that refuses the messages, a broken Host header and a
    4,300+ digit integer are the client's errors: 400 naming the problem, over HTTP and stdio."""
    d = tmp_path / "m"
    copy_model(tiny_model_dir, d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = (
        "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('roles must alternate') }}{% endif %}{{ m['content'] }}{% endfor %}"
    )
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    for f in d.glob("chat_template.*"):
        f.unlink()
    proc, port = _start_server(d)
    try:
        bad_part = {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}], "max_tokens": 2}
        status, body = _http(port, json.dumps(bad_part).encode())
        assert status == 400 and b"invalid_type" in body, body
        twice = {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], "max_tokens": 2}
        status, body = _http(port, json.dumps(twice).encode())
        assert status == 400 and b"roles must alternate" in body, body
        status, body = _http(port, b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}", path="/v1/completions")
        assert status == 400 and b"invalid_json" in body, body
        status, body = _http(port, b'{"prompt": "hi"}', path="/v1/completions", host="[evil")
        assert status == 400 and b"Host" in body, body
        ok = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        assert _http(port, json.dumps(ok).encode())[0] == 200
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    lines = [
        json.dumps({"id": 1, "messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}),
        '{"id": 2, "prompt": "hi", "max_tokens": ' + "9" * 5000 + "}",
    ]
    r = subprocess.run(
        [*CLI, "serve", "--stdio", "--model", str(d)],
        input="\n".join(lines) + "\n",
        capture_output=True,
        text=True,
        timeout=120,
    )
    events = [json.loads(line) for line in r.stdout.splitlines()][1:]  # after "ready"
    # parse errors are answered by the reader at once, the request's error when it runs
    assert sorted((str(e["id"]), e["code"]) for e in events) == [("1", "invalid_value"), ("None", "invalid_json")]


def test_allowed_hosts_serve_a_lan_name(tmp_path, tiny_model_dir):
    r = subprocess.run(
        [*CLI, "serve", "--http", "--model", str(tiny_model_dir), "--allowed-hosts", "*"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 1 and "needs --api-key" in r.stderr
    proc, port = _start_server(tiny_model_dir, "--allowed-hosts", "myhost.lan")
    try:
        ok = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
        assert _http(port, ok, path="/v1/completions", host=f"myhost.lan:{port}")[0] == 200
        assert _http(port, ok, path="/v1/completions", host=f"other.lan:{port}")[0] == 403
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    proc, port = _start_server(tiny_model_dir, "--allowed-hosts", "*", "--api-key", "s3cret")
    try:
        req = (
            f"POST /v1/completions HTTP/1.1\r\nHost: anything.example:{port}\r\nAuthorization: Bearer s3cret\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(ok)}\r\nConnection: close\r\n\r\n"
        ).encode() + ok
        assert b" 200 " in _exchange(port, req).split(b"\r\n")[0]
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_non_streaming_request_is_cancelled_when_its_client_leaves(tmp_path):
    """The disconnect check must run between tokens, not only when no token is waiting."""
    from specstream_mlx.io.loading import resolve_model_path

    proc, port = _start_server(resolve_model_path("demo-sql"), "--mode", "ar")
    try:
        body = json.dumps(
            {"prompt": "CREATE TABLE t (a INT)\n--", "max_tokens": 900, "temperature": 100, "seed": 11}
        ).encode()
        req = (
            f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode() + body
        c = socket.create_connection(("127.0.0.1", port), timeout=10)
        c.sendall(req)
        # Leave while it decodes: demo-sql decodes ~1,000 tokens/s here, so 900 take about a
        # second; at 0.3 s the request is well under way and far from done.
        time.sleep(0.3)
        c.close()
        ok = json.dumps({"prompt": "hi", "max_tokens": 1}).encode()
        assert _http(port, ok, path="/v1/completions")[0] == 200
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    cancelled = [line for line in err.decode().splitlines() if "cancelled after" in line]
    assert len(cancelled) == 1, err.decode()[-2000:]
    assert int(cancelled[0].split("cancelled after ")[1].split()[0]) < 900, cancelled


def test_slow_loris_cannot_hold_the_connection_slots(tmp_path, tiny_model_dir):
    proc, port = _start_server(tiny_model_dir, "--timeout", "2", "--max-connections", "4")
    slow = []
    try:
        for _ in range(4):
            c = socket.create_connection(("127.0.0.1", port), timeout=10)
            c.sendall(b"GET /health HTTP/1.1\r\n")
            slow.append(c)
        t0 = time.monotonic()
        statuses = []
        while time.monotonic() - t0 < 6:
            for c in slow:  # one header line each every 0.5 s: every single read is quick
                try:
                    c.sendall(b"X-Slow: 1\r\n")
                except OSError:
                    pass
            time.sleep(0.5)
            if time.monotonic() - t0 > 3:
                try:
                    with socket.create_connection(("127.0.0.1", port), timeout=5) as c:
                        c.sendall(
                            f"GET /health HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\r\n".encode()
                        )
                        statuses.append(_read_all(c, timeout=5).split(b"\r\n")[0])
                except OSError as e:
                    statuses.append(repr(e).encode())
        assert statuses and all(b" 200 " in s for s in statuses), statuses
    finally:
        for c in slow:
            c.close()
        proc.terminate()
        proc.wait(timeout=30)


def test_cached_prefixes_are_not_shared_between_clients(tmp_path, tiny_model_dir):
    proc, port = _start_server(tiny_model_dir)

    def reused(text, user=None):
        """Prompt tokens the server did not have to prefill (taken from its cache)."""
        body = {"prompt": text, "max_tokens": 1}
        if user:
            body["user"] = user
        status, payload = _http(port, json.dumps(body).encode(), path="/v1/completions")
        assert status == 200, payload
        reply = json.loads(payload)
        return reply["usage"]["prompt_tokens"] - reply["specstream"]["prompt_tokens"]

    try:
        secret = "the admin pin is 4721 and nobody else may know it"
        reused(secret, user="alice")
        again = reused(secret + " really", user="alice")  # the same client continues: fast
        guess = reused("the admin pin is 47 ok", user="mallory")  # another client right after
        reused(secret, user="alice")
        anon = reused("the admin pin is 47 ok")  # a new connection, no user
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert guess == 0 and anon == 0, (guess, anon)
    assert again > 10, again


def test_n_and_unsupported_fields_are_refused(server):
    _, port, _ = server
    for extra, word in (
        ({"n": True}, b"integer 1"),
        ({"n": 1.0}, b"integer 1"),
        ({"logprobs": True}, b"logprobs"),
        ({"tools": [{"type": "function"}]}, b"tools"),
        ({"response_format": {"type": "json_object"}}, b"response_format"),
        # Penalties and biases change the distribution sampled: they had been ignored.
        ({"frequency_penalty": 0.5}, b"frequency_penalty"),
        ({"presence_penalty": -1}, b"presence_penalty"),
        ({"logit_bias": {"42": 100}}, b"logit_bias"),
        ({"stop": [""]}, b"must not be empty"),  # had ended every reply before its first token
    ):
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **extra}
        status, payload = _http(port, json.dumps(body).encode())
        assert status == 400 and word in payload, (extra, payload)
    # Their neutral values, which some clients always send, are taken.
    neutral = {"n": 1, "frequency_penalty": 0, "presence_penalty": 0.0, "logit_bias": {}, "logprobs": False}
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **neutral}
    assert _http(port, json.dumps(body).encode())[0] == 200


def test_ambiguous_request_framing_is_refused(server):
    _, port, _ = server
    body = json.dumps({"prompt": "hi", "max_tokens": 1}).encode()
    n = len(body)
    for headers in (
        f"Content-Length: {n}\r\nContent-Length: {n}\r\n",
        f"Transfer-Encoding: chunked\r\nContent-Length: {n}\r\n",
        f"Content-Length: +{n}\r\n",
    ):
        req = (
            f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n{headers}"
            "Connection: close\r\n\r\n"
        ).encode() + body
        data = _exchange(port, req)
        assert data.split(b"\r\n")[0].split()[1] == b"400", (headers, data[:200])


def test_stdio_id_that_is_not_text_is_invalid_id(tiny_model_dir):
    lines = ['{"id": "\\ud800", "prompt": "hi", "max_tokens": 1}', '{"id": "ok", "prompt": "hi", "max_tokens": 1}']
    r = subprocess.run(
        [*CLI, "serve", "--stdio", "--model", str(tiny_model_dir)],
        input="\n".join(lines) + "\n",
        capture_output=True,
        text=True,
        timeout=120,
    )
    events = [json.loads(line) for line in r.stdout.splitlines()]
    assert r.returncode == 0
    assert [e.get("code") for e in events if e["event"] == "error"] == ["invalid_id"]
    assert any(e["event"] == "done" and e["id"] == "ok" for e in events)


def test_ctrl_c_ends_a_running_stream_with_a_final_chunk_and_done():
    """Ctrl-C while a stream is being generated: the client gets a final chunk
    (finish_reason "length": cut off, never "stop") and [DONE], and the server exits. Repeated, because a
    KeyboardInterrupt raised at a random bytecode was sometimes swallowed (the server
    then finished the request and never stopped)."""
    import signal

    from specstream_mlx.io.loading import resolve_model_path

    body = json.dumps(
        {"prompt": "CREATE TABLE t (a INT)\n--", "max_tokens": 900, "temperature": 100, "seed": 11, "stream": True}
    ).encode()
    for attempt in range(4):
        proc, port = _start_server(resolve_model_path("demo-sql"), "--mode", "ar")
        try:
            c = socket.create_connection(("127.0.0.1", port), timeout=30)
            c.sendall(
                (
                    f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
                    f"Content-Length: {len(body)}\r\n\r\n"
                ).encode()
                + body
            )
            first = b""
            while b"data: {" not in first:
                first += c.recv(4096)
            time.sleep(0.05 * attempt)  # interrupt at different points of the generation
            proc.send_signal(signal.SIGINT)
            rest = first + _read_all(c, timeout=30)
            c.close()
            assert proc.wait(timeout=30) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
            _, err = proc.communicate(timeout=30)
        text = rest.decode(errors="replace")
        # The OpenAI stream's final chunk (finish_reason "length": the API has no "cancelled", and a
        # truncated answer must not claim "stop"), then [DONE].
        assert '"finish_reason": "stop"' not in text, text[-500:]
        final = text.rfind('"finish_reason": "length"')
        assert 0 <= final < text.find("data: [DONE]"), (attempt, text[-500:])
        log = [line for line in err.decode().splitlines() if "cancelled after" in line]
        assert len(log) == 1 and int(log[0].split("cancelled after ")[1].split()[0]) < 900, err.decode()[-1000:]
