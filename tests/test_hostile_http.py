"""A hostile neighbour over HTTP: native panics, runaway templates, CL.0 desync, slot
exhaustion, odd Host headers, http.server's own refusals, and the prefix-cache opt-out."""

import json
import socket
import threading
import time

import pytest

from tests.helpers.tiny_models import copy_model
from tests.test_hostile import _exchange, _http, _read_all
from tests.test_hostile_files import RUNAWAY, _hostile_tokenizer, _template
from tests.test_serve import _start_server


def _statuses(data: bytes):
    return [line.split()[1] for line in data.split(b"\r\n") if line.startswith(b"HTTP/1.")]


def _health(port, timeout=5.0) -> bytes:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as c:
            c.sendall(f"GET /health HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\r\n".encode())
            return _read_all(c, timeout=timeout).split(b"\r\n")[0]
    except OSError as e:
        return repr(e).encode()


@pytest.fixture(scope="module")
def panicky(tmp_path_factory, tiny_model_dir):
    d = copy_model(tiny_model_dir, tmp_path_factory.mktemp("panicky") / "m", streams=False)
    _hostile_tokenizer(d)
    proc, port = _start_server(d, "--max-connections", "8", "--header-timeout", "3")
    yield proc, port
    proc.terminate()
    proc.wait(timeout=30)


def test_a_native_panic_is_a_400_and_the_server_keeps_serving(panicky):
    proc, port = panicky
    for path, body in (
        ("/v1/completions", {"prompt": "a" * 5000 + "b", "max_tokens": 1}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a" * 5000 + "b"}], "max_tokens": 1}),
    ):
        status, payload = _http(port, json.dumps(body).encode(), path=path)
        assert status == 400 and json.loads(payload)["error"]["code"] == "invalid_prompt", payload
    status, _ = _http(port, json.dumps({"prompt": "ok", "max_tokens": 1}).encode(), path="/v1/completions")
    assert status == 200 and proc.poll() is None


def test_a_body_on_a_get_is_refused_not_run_as_a_second_request(panicky):
    """CL.0: before, the body (a POST) was answered as a second request."""
    _, port = panicky
    inner = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
        'Content-Length: 31\r\n\r\n{"prompt":"hi","max_tokens":4}\n'
    ).encode()
    for method in ("GET /health", "OPTIONS /v1/models"):
        outer = f"{method} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Length: {len(inner)}\r\n\r\n".encode()
        data = _exchange(port, outer + inner, timeout=10)
        assert _statuses(data) == [b"400"], data[:400]
        assert b"connection: close" in data.lower() and b"take no body" in data


def test_odd_host_headers_and_http_server_refusals_are_json(panicky):
    _, port = panicky
    good = f"127.0.0.1:{port}"
    for headers in (f"Host: {good}\r\nHost: evil.com", f"Host: evil.com@{good}", "Host: a b"):
        data = _exchange(port, f"GET /health HTTP/1.1\r\n{headers}\r\n\r\n".encode(), timeout=10)
        assert _statuses(data) == [b"400"] and b"Host" in data, data[:300]
    for raw, status in (
        (b"NONSENSE\r\n\r\n", b"400"),
        (f"GET /health HTTP/2.0\r\nHost: {good}\r\n\r\n".encode(), b"505"),
        (b"GET /" + b"a" * 70000 + b" HTTP/1.1\r\n\r\n", b"414"),
        (f"GET /health HTTP/1.1\r\nHost: {good}\r\n".encode() + b"X-A: 1\r\n" * 150 + b"\r\n", b"431"),
    ):
        data = _exchange(port, raw, timeout=10)
        head, _, body = data.partition(b"\r\n\r\n")
        assert _statuses(head) == [status], data[:300]
        assert b"application/json" in head and "error" in json.loads(body), data[:300]


def test_idle_and_trickling_connections_cannot_keep_health_out(panicky):
    """8 slots: 16 idle sockets, then 20 clients trickling header lines and reconnecting when
    dropped; /health is still answered (before: 503 for as long as they stayed)."""
    _, port = panicky
    idle = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(16)]
    try:
        assert b" 200 " in _health(port)
    finally:
        for c in idle:
            c.close()
    stop = threading.Event()

    def trickle():
        while not stop.is_set():
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=5) as c:
                    c.sendall(b"GET /health HTTP/1.1\r\n")
                    while not stop.is_set():
                        c.sendall(b"X-Slow: 1\r\n")
                        time.sleep(0.5)
            except OSError:
                time.sleep(0.05)

    threads = [threading.Thread(target=trickle, daemon=True) for _ in range(20)]
    for t in threads:
        t.start()
    try:
        time.sleep(1.0)
        got = []
        t0 = time.monotonic()
        while time.monotonic() - t0 < 6:
            got.append(_health(port))
            time.sleep(0.2)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=10)
    ok = sum(b" 200 " in s for s in got)
    assert ok >= 0.9 * len(got), got


def test_a_runaway_template_does_not_hold_the_slots(tmp_path, tiny_model_dir):
    """Two requests whose template never ends, with --max-connections 2, their clients gone:
    /health is answered again within seconds (before: 503 for ever)."""
    d = copy_model(tiny_model_dir, tmp_path / "m", streams=False)
    _template(d, RUNAWAY)
    proc, port = _start_server(d, "--max-connections", "2")
    try:
        body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}).encode()
        request = (
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode() + body
        for _ in range(2):
            with socket.create_connection(("127.0.0.1", port), timeout=10) as c:
                c.sendall(request)
        t0 = time.monotonic()
        while b" 200 " not in _health(port) and time.monotonic() - t0 < 20:
            time.sleep(0.3)
        assert time.monotonic() - t0 < 20
        status, payload = _http(port, body)
        assert status == 400 and b"chat template ran for more than" in payload, payload
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_prefix_cache_can_be_turned_off(tmp_path, tiny_model_dir):
    proc, port = _start_server(tiny_model_dir, "--no-prefix-cache")
    try:
        reused = []
        for text in ("the same long prompt for one user", "the same long prompt for one user again"):
            body = json.dumps({"prompt": text, "max_tokens": 1, "user": "alice"}).encode()
            status, payload = _http(port, body, path="/v1/completions")
            reply = json.loads(payload)
            reused.append(reply["usage"]["prompt_tokens"] - reply["specstream"]["prompt_tokens"])
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert reused == [0, 0]


def test_connection_slots_per_peer_and_who_gives_up_a_slot():
    """One address holds at most max_per_peer connections; when the slots are full a new
    connection takes the slot of the one waiting longest for its head, never a busy one's."""
    from types import SimpleNamespace

    from specstream_mlx.serve.http import Connections

    conns = Connections(max_connections=3, max_per_peer=2, header_timeout=10, timeout=30)
    pairs = []

    def open_(peer, phase="head"):
        assert conns.admit(peer)
        a, b = socket.socketpair()
        pairs.append((a, b))
        h = SimpleNamespace(client_address=(peer, 0), connection=a, close_connection=False)
        conns.opened(h)
        conns.phase(h, phase)
        records[id(h)] = conns.open[id(h)]  # kept: a closed connection leaves conns.open
        time.sleep(0.01)  # distinct waiting times
        return h

    records = {}

    def dropped(h):
        return records[id(h)].phase == "dropped"

    a1, a2 = open_("10.0.0.1"), open_("10.0.0.1", "busy")
    a3 = open_("10.0.0.1")  # over A's cap: A's waiting connection gives up its slot
    assert dropped(a1) and not dropped(a2) and not dropped(a3)
    conns.closed(a1)
    conns.slots.release()  # what a1's thread does when it ends
    b1 = open_("10.0.0.2", "busy")  # the last free slot
    # full: 3 open (a2 busy, a3 waiting, b1 busy); a new peer takes a3's slot
    releaser = threading.Timer(0.2, lambda: (conns.closed(a3), conns.slots.release()))
    releaser.start()
    c1 = open_("10.0.0.3")
    assert dropped(a3) and not dropped(a2) and not dropped(b1) and not dropped(c1)
    conns.phase(c1, "busy")
    assert not conns.admit("10.0.0.4")  # every open connection busy: refused (503)
    for a, b in pairs:
        a.close()
        b.close()


def test_a_connection_that_just_ended_frees_its_slot_for_the_next_one():
    """A connection whose thread has left ``open`` but not yet released its slot is not a
    full server: the next connection waits that moment instead of getting 503 (it did, now
    and then, when a client closed idle connections and opened busy ones at once)."""
    from types import SimpleNamespace

    from specstream_mlx.serve.http import Connections

    conns = Connections(max_connections=1, max_per_peer=1, header_timeout=10, timeout=30)
    assert conns.admit("10.0.0.1")
    a, _ = socket.socketpair()
    h = SimpleNamespace(client_address=("10.0.0.1", 0), connection=a, close_connection=False)
    conns.opened(h)
    conns.closed(h)  # its thread ends: gone from open, the slot released a moment later
    threading.Timer(0.03, conns.slots.release).start()
    assert conns.admit("10.0.0.1")
    # Every slot held by a busy connection: refused, after that moment only.
    busy = SimpleNamespace(client_address=("10.0.0.2", 0), connection=a, close_connection=False)
    conns.opened(busy)
    conns.phase(busy, "busy")
    t = time.perf_counter()
    assert not conns.admit("10.0.0.3") and time.perf_counter() - t < 1.0
