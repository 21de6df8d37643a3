"""``specstream-mlx serve --http``: an OpenAI-compatible server on loopback.

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions`` (streaming
by server-sent events or not), ``GET /v1/models``, ``GET /health``. One model,
one generation at a time (MLX work runs on the thread that loaded the model).
Bad requests get 4xx JSON errors in OpenAI's shape and the server keeps
serving. Request bodies are limited to ``MAX_BODY`` bytes.

Security defaults, because any web page the user visits can send requests to a
local port: requests whose ``Host`` is not the bound address or localhost are
refused (DNS rebinding), as are browser requests whose ``Origin`` is not in
``--allowed-origins`` (cross-site request forgery; CORS preflights are answered
for allowed origins only); ``--api-key`` requires ``Authorization: Bearer KEY``.
Request heads and whole requests have deadlines (slow clients cannot hold a
connection), open connections are capped in all and per peer, and waiting ones give
up their slot to new ones (docs/SECURITY.md). A client that disconnects cancels its
generation.
"""

from __future__ import annotations

import email.message
import hmac
import itertools
import json
import queue
import re
import select
import signal
import socket
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Dict, List, Optional, Tuple
from urllib.parse import urlsplit

from ..runtime.bounded import FATAL
from ..runtime.session import ChatSession, Reply
from ..tasks.tool_calls import may_be_call, model_tool_format
from .client_policies import ClientPolicies
from .protocol import (
    GenerationRequest,
    ProtocolError,
    cap_max_tokens,
    check_prompt_chars,
    check_text,
    number,
    parse_messages,
    parse_mode,
    parse_sampling,
    parse_stop,
    parse_tools,
    prompt_ids,
    reply_calls,
    tool_prompt,
)

MAX_BODY = 1 << 20
CONTEXT_CODE = "context_length_exceeded"
SOCKET_TIMEOUT_S = 30.0
HEADER_TIMEOUT_S = 10.0
MAX_CONNECTIONS = 32
LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1")
_HOST = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+)(?::[0-9]{1,5})?")


@dataclass
class HttpOptions:
    """Defaults and security settings of the HTTP server.

    Attributes:
        temperature, top_p, max_tokens: defaults for requests that omit them
            (as ``mlx_lm.server``: temperature 0).
        api_key: required as ``Authorization: Bearer KEY`` when set.
        allowed_origins: browser origins allowed to call the API (CORS); none by default.
        host: the bound address (a request's ``Host`` must name it or localhost).
        timeout: seconds a socket read may wait (slow or stalled clients are dropped).
        max_connections: open connections at once; a new one beyond them takes the slot of
            the one that has waited longest for its request head, else gets 503.
        allowed_hosts: further names a request's ``Host`` may give (a LAN name when
            bound beyond loopback); ``*`` allows any and needs ``api_key``.
        header_timeout: seconds a connection may take to send a request's head (request
            line and headers), idle keep-alive time included; ``timeout`` bounds the whole request.
        max_per_peer: open connections one peer address may hold (default: half of
            ``max_connections`` when bound beyond loopback; on loopback, where every client
            has the same address, all of them).
        prefix_cache: reuse the KV cache of a client's previous request (its
            conversation); off, every request starts from an empty cache.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    max_tokens: int = 256
    api_key: Optional[str] = None
    allowed_origins: List[str] = field(default_factory=list)
    host: str = "127.0.0.1"
    timeout: float = SOCKET_TIMEOUT_S
    max_connections: int = MAX_CONNECTIONS
    allowed_hosts: List[str] = field(default_factory=list)
    header_timeout: float = HEADER_TIMEOUT_S
    max_per_peer: Optional[int] = None
    prefix_cache: bool = True


_CONNECTIONS = itertools.count()  # never reused, unlike id() of a closed connection's object

# OpenAI fields this server cannot honour: refused rather than silently ignored (their
# neutral values, null / false / 0 / [] / {}, which some clients always send, are taken).
UNSUPPORTED_FIELDS = (
    "logprobs",
    "top_logprobs",
    "functions",
    "function_call",
    "response_format",
    "frequency_penalty",
    "presence_penalty",
    "logit_bias",
)


class App:
    """Request parsing, plus a job queue: MLX work runs on the thread that loaded
    the model (MLX streams are per thread), one request at a time."""

    def __init__(
        self,
        model,
        tokenizer,
        model_id: str,
        mode: str,
        max_context: int,
        modes: List[str],
        options: Optional[HttpOptions] = None,
    ):
        self.model, self.tokenizer = model, tokenizer
        self.model_id, self.mode, self.max_context, self.modes = model_id, mode, max_context, modes
        self.options = options or HttpOptions()
        self.session = ChatSession(model, tokenizer)
        self.tool_format = model_tool_format(getattr(model, "path", None))
        # The cached prefix belongs to one client's conversation: another owner's request
        # starts from an empty cache, so no client learns (from prompt_tokens reused or
        # from timing) what another one sent.
        self.cache_owner: Any = None
        self.policies = ClientPolicies(self.session.model)
        self.current: Optional[Tuple[GenerationRequest, "queue.Queue"]] = None
        self.jobs: "queue.Queue[Tuple[GenerationRequest, queue.Queue]]" = queue.Queue()
        self.interrupted = False

    def interrupt(self) -> None:
        """Ctrl-C: the running generation stops at its next token (its cancel flag) and
        :meth:`work_forever` returns. Called from the signal handler, which runs on the
        working thread between two bytecodes: it only sets flags (no queue or lock the
        interrupted code may hold). A raised KeyboardInterrupt could land inside a
        finaliser and be swallowed, and the server would never stop."""
        self.interrupted = True
        current = self.current
        if current is not None:
            current[0].cancel.set()

    def submit(self, req: GenerationRequest) -> "queue.Queue":
        """Queue a generation; returns its events queue: ("delta", text), then
        ("done", Reply) or ("error", exception)."""
        events: "queue.Queue" = queue.Queue()
        self.jobs.put((req, events))
        return events

    def work_forever(self, stop_event: threading.Event) -> None:
        while not stop_event.is_set() and not self.interrupted:
            try:
                req, events = self.jobs.get(timeout=0.2)
            except queue.Empty:
                continue
            self.current = (req, events)
            if req.owner is None or req.owner != self.cache_owner or not self.options.prefix_cache:
                self.session.reset()
                self.cache_owner = req.owner
            try:
                gen = self.session.stream_ids(
                    req.prompt_ids,
                    max_tokens=req.max_tokens,
                    sampling=req.sampling,
                    mode=req.mode,
                    stop=req.stop,
                    cancel=req.cancel,
                    policy=self._policy(req),
                )
                while True:
                    try:
                        events.put(("delta", next(gen)))
                    except StopIteration as s:
                        events.put(("done", s.value))
                        if s.value.finish_reason == "cancelled":
                            n = s.value.stats.generated_tokens if s.value.stats else 0
                            sys.stderr.write(f"[http] {req.id} cancelled after {n} tokens\n")
                        break
            except FATAL:
                raise
            except BaseException as e:  # reported to the waiting request as a 500 (native panics too)
                events.put(("error", e))
            self.current = None

    def _policy(self, req: GenerationRequest):
        """The request's client's own ``--tree auto`` policy (None: the model's shared one)."""
        if req.mode != "ss" or req.owner is None or getattr(self.session.model, "streams", None) is None:
            return None
        return self.policies.get(req.sampling, req.owner)

    def cancel_all(self, grace_s: float = 2.0) -> None:
        """Shutting down (Ctrl-C): end the running request (if any) and every queued one with
        ``finish_reason: "cancelled"``, so each client gets a final chunk (and streams their
        ``[DONE]``), then give the connection threads ``grace_s`` to write it."""
        pending = [self.current] if self.current is not None else []
        while True:
            try:
                pending.append(self.jobs.get_nowait())
            except queue.Empty:
                break
        for req, events in pending:
            req.cancel.set()
            events.put(("done", Reply(finish_reason="cancelled")))
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(not ev.empty() for _, ev in pending):
            time.sleep(0.02)

    def parse(self, body: Any, chat: bool) -> GenerationRequest:
        if not isinstance(body, dict):
            raise ProtocolError("invalid_request", "the request body must be a JSON object")
        # Any "model" names the one model served: clients often hard-code a name.
        if body.get("model") is not None and not isinstance(body["model"], str):
            raise ProtocolError("invalid_type", '"model" must be a string')
        n = body.get("n", 1)
        if type(n) is not int or n != 1:  # not True, not 1.0
            raise ProtocolError("invalid_value", '"n" must be the integer 1 (one choice per request)')
        for key in UNSUPPORTED_FIELDS:
            if body.get(key) not in (None, False, [], {}):
                raise ProtocolError("invalid_value", f'"{key}" is not supported by this server')
        tools = None
        if chat:
            tools = parse_tools(body, self.tool_format, self.model_id)
        elif body.get("tools") not in (None, []):
            raise ProtocolError("invalid_value", '"tools" needs /v1/chat/completions')
        ids = self._prompt_ids(body, chat, tools)
        # Above the context left, max_tokens is capped (not refused), as OpenAI-style clients expect.
        requested = number(body, "max_completion_tokens", None, 1, 1 << 30, integer=True)
        if requested is None:
            requested = number(body, "max_tokens", self.options.max_tokens, 1, 1 << 30, integer=True)
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise ProtocolError("invalid_type", '"stream" must be a boolean')
        stream_options = body.get("stream_options") or {}
        if not isinstance(stream_options, dict):
            raise ProtocolError("invalid_type", '"stream_options" must be an object')
        return GenerationRequest(
            id=("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24],
            messages=None,
            prompt_ids=ids,
            max_tokens=cap_max_tokens(requested, len(ids), self.max_context, CONTEXT_CODE),
            sampling=parse_sampling(body, self.options.temperature, self.options.top_p),
            mode=parse_mode(body.get("specstream_mode"), self.modes, self.mode, "specstream_mode"),
            stop=parse_stop(body.get("stop")),
            stream=stream,
            include_usage=stream_options.get("include_usage") is True,
            tools=tools,
        )

    def _prompt_ids(self, body: dict, chat: bool, tools: Optional[List[dict]] = None) -> List[int]:
        if chat:
            messages = tool_prompt(parse_messages(body.get("messages"), strict_keys=False), tools)
            check_prompt_chars(sum(len(m["content"]) for m in messages), self.max_context, CONTEXT_CODE)
            return prompt_ids(self.tokenizer, messages, self.max_context, code=CONTEXT_CODE)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise ProtocolError("invalid_type", '"prompt" must be a string')
        check_text(prompt, "prompt")
        check_prompt_chars(len(prompt), self.max_context, CONTEXT_CODE)
        if not prompt.strip():
            raise ProtocolError("empty_prompt", "the prompt is empty")
        return prompt_ids(self.tokenizer, prompt, self.max_context, chat=False, code=CONTEXT_CODE)


class ApiHandler(BaseHTTPRequestHandler):
    """One HTTP connection; ``app`` is set on the subclass :func:`make_handler` builds."""

    protocol_version = "HTTP/1.1"
    server_version = "specstream-mlx"
    timeout = SOCKET_TIMEOUT_S  # socket reads: a slow or stalled client is dropped
    app: App

    def log_message(self, fmt, *args):  # access log to stderr
        sys.stderr.write("[http] " + escape_controls(fmt % args) + "\n")

    def log_error(self, fmt, *args):  # timeouts and bad request lines: one short line
        sys.stderr.write("[http] " + escape_controls(fmt % args) + "\n")

    def handle(self):
        # A client that resets or leaves between requests is not an error worth a traceback.
        try:
            super().handle()
        except (ConnectionResetError, BrokenPipeError, socket.timeout, OSError):
            self.close_connection = True

    def setup(self):
        super().setup()
        self.server.connections.opened(self)

    def finish(self):
        try:
            super().finish()
        finally:
            self.server.connections.closed(self)

    def handle_one_request(self):
        """One request. The server's watchdog bounds its head by ``header_timeout`` (idle
        keep-alive time included) and head plus body by ``timeout``: the socket timeout alone
        bounds each read, so a client sending a header line every few seconds (slow loris)
        would hold its connection slot for ever."""
        self.server.connections.phase(self, "head")
        super().handle_one_request()

    def parse_request(self) -> bool:
        ok = super().parse_request()
        if ok:
            self.server.connections.phase(self, "body")
        return ok

    def _request_read(self) -> None:
        """The request is in: what follows (generation) is not bounded by the read timeouts."""
        self.server.connections.phase(self, "busy")

    def send_error(self, code, message=None, explain=None):
        """``http.server``'s own refusals (bad request line, 414, 431, HTTP/2.0) as the same
        JSON error as every other, and the connection closed."""
        if not hasattr(self, "headers"):
            self.headers = email.message.Message()  # refused before any header was read
        if self.request_version == "HTTP/0.9":  # an unparsable request line: answer in HTTP/1.1
            self.request_version = "HTTP/1.1"
        status = HTTPStatus(code) if code in HTTPStatus._value2member_map_ else None
        text = message or (status.phrase if status else "error")
        self._error(ProtocolError(_status_code(code), escape_controls(str(text)), code))

    def _json(self, status: int, obj: dict, close: bool = False) -> None:
        data = json.dumps(obj).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            if close:
                self.send_header("Connection", "close")
                self.close_connection = True
            self._cors_headers()
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError, socket.timeout):
            self.close_connection = True  # the client left before reading the answer

    def _error(self, e: ProtocolError) -> None:
        """Answer an error and close the connection: a refused request's body was not read,
        and on a kept-alive connection it would be parsed as the next request, without
        the outer request's Host or Origin (request smuggling past the checks)."""
        kind = "server_error" if e.status >= 500 else "invalid_request_error"
        body = {"error": {"message": e.message, "type": kind, "code": e.code, "param": None}}
        self._json(e.status, body, close=True)

    # --- who may call ---------------------------------------------------------
    def _route(self) -> str:
        return urlsplit(self.path).path.rstrip("/") or "/"

    def _origin_allowed(self) -> bool:
        origin = self.headers.get("Origin")
        return origin is None or origin in self.app.options.allowed_origins

    def _cors_headers(self) -> None:
        origin = self.headers.get("Origin")
        if origin is not None and origin in self.app.options.allowed_origins:
            self.send_header("Access-Control-Allow-Origin", origin)
            self.send_header("Vary", "Origin")

    def _check_access(self) -> None:
        """Refuse other hosts' names (DNS rebinding), foreign origins (CSRF) and missing keys."""
        opts = self.app.options
        hosts = self.headers.get_all("Host") or []
        if len(hosts) > 1:
            raise ProtocolError("invalid_request", "more than one Host header")
        host = hosts[0] if hosts else ""
        # A name or address and a port, nothing else: "evil.com@127.0.0.1" is userinfo to a URL parser.
        m = _HOST.fullmatch(host)
        if m is None:
            raise ProtocolError("invalid_request", f"bad Host header {escape_controls(host)[:100]!r}")
        name = m.group(1).strip("[]").lower()
        allowed = name in LOCAL_HOSTS or name == opts.host.strip("[]") or name in opts.allowed_hosts
        if not allowed and not ("*" in opts.allowed_hosts and opts.api_key is not None):
            raise ProtocolError("forbidden_host", f"Host {host!r} is not this server", 403)
        if not self._origin_allowed():
            raise ProtocolError("forbidden_origin", "this origin may not call the API (see --allowed-origins)", 403)
        if opts.api_key is not None:
            auth = self.headers.get("Authorization", "")
            given = auth[7:] if auth.startswith("Bearer ") else ""
            if not hmac.compare_digest(given.encode(), opts.api_key.encode()):
                raise ProtocolError("invalid_api_key", "missing or wrong API key (Authorization: Bearer KEY)", 401)

    # --- methods ----------------------------------------------------------------
    def do_OPTIONS(self):
        """CORS preflight: answered for allowed origins only."""
        self._request_read()
        try:
            self._no_body()
        except ProtocolError as e:
            return self._error(e)
        if self.headers.get("Origin") is None or not self._origin_allowed():
            return self._error(ProtocolError("forbidden_origin", "this origin may not call the API", 403))
        self.send_response(204)
        self._cors_headers()
        self.send_header("Access-Control-Allow-Methods", "GET, POST, OPTIONS")
        self.send_header("Access-Control-Allow-Headers", "Authorization, Content-Type")
        self.send_header("Access-Control-Max-Age", "600")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _method_not_allowed(self):
        self._request_read()
        self._error(ProtocolError("method_not_allowed", f"{self.command} is not supported here", 405))

    def _no_body(self) -> None:
        """A method that takes no body must come without one: an unread body on a kept-alive
        connection would be parsed as the next request (CL.0 desync, request smuggling)."""
        lengths = self.headers.get_all("Content-Length") or []
        if self.headers.get("Transfer-Encoding") is not None or any(v.strip() != "0" for v in lengths):
            raise ProtocolError("invalid_request", f"{self.command} requests take no body")

    do_PUT = do_DELETE = do_PATCH = do_HEAD = _method_not_allowed

    def do_GET(self):
        self._request_read()
        try:
            self._no_body()
            self._check_access()
        except ProtocolError as e:
            return self._error(e)
        app, route = self.app, self._route()
        if route == "/health":
            return self._json(200, {"status": "ok", "model": app.model_id})
        if route == "/v1/models":
            return self._json(
                200,
                {
                    "object": "list",
                    "data": [{"id": app.model_id, "object": "model", "created": 0, "owned_by": "specstream-mlx"}],
                },
            )
        self._error(ProtocolError("not_found", f"no route {route}", 404))

    def do_POST(self):
        try:
            self._check_access()
            route = self._route()
            if route not in ("/v1/chat/completions", "/v1/completions"):
                raise ProtocolError("not_found", f"no route {route}", 404)
            body = self._read_body()
            self._request_read()
            chat = route == "/v1/chat/completions"
            req = self.app.parse(body, chat)
            req.owner = self._owner(body)
            self._complete(chat, req)
        except ProtocolError as e:
            self._error(e)
        except (BrokenPipeError, ConnectionResetError, socket.timeout):
            self.close_connection = True
        except FATAL:
            raise
        except BaseException as e:  # a bug in one request must not stop the server
            self._error(ProtocolError("internal_error", f"{type(e).__name__}: {e}", 500))

    def _read_body(self) -> Any:
        lengths = self.headers.get_all("Content-Length") or []
        # Framing a proxy in front could read differently is refused: two lengths, a length
        # beside Transfer-Encoding, or a length that is not plain digits ("+5", " 5").
        if self.headers.get("Transfer-Encoding") is not None and lengths:
            raise ProtocolError("invalid_request", "Transfer-Encoding and Content-Length together")
        if not lengths:
            raise ProtocolError("length_required", "Content-Length is required", 411)
        if len(lengths) > 1:
            raise ProtocolError("invalid_request", "more than one Content-Length")
        length = lengths[0]
        if not (length.isascii() and length.isdigit()):
            raise ProtocolError("invalid_request", f"bad Content-Length {length!r}")
        n = int(length)
        if n > MAX_BODY:
            self.close_connection = True
            # Drain a moderately large body so the client can read the 413
            # instead of seeing its upload reset mid-way.
            left = n if n <= 32 * MAX_BODY else 0
            while left > 0:
                chunk = self.rfile.read(min(left, 1 << 16))
                if not chunk:
                    break
                left -= len(chunk)
            raise ProtocolError("body_too_large", f"request bodies are limited to {MAX_BODY} bytes", 413)
        raw = self.rfile.read(n)
        try:
            return json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError) as e:  # ValueError: also 4,300+ digit integers
            raise ProtocolError("invalid_json", f"the body is not valid JSON: {e}") from None

    def _owner(self, body: dict) -> Any:
        """Whose conversation the KV cache holds: the OpenAI ``user`` field under the given
        API key, else this connection (multi-turn chat over a kept-alive connection)."""
        user = body.get("user")
        if isinstance(user, str) and user:
            return ("user", self.headers.get("Authorization", ""), user)
        if not hasattr(self, "_connection_number"):  # one handler object per connection
            self._connection_number = next(_CONNECTIONS)
        return ("connection", self._connection_number)

    def _client_gone(self) -> bool:
        """The client closed its side (readable with no data); a non-streaming
        request finds out no other way before it writes its answer."""
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True

    def _complete(self, chat: bool, req: GenerationRequest) -> None:
        created = int(time.time())
        events = self.app.submit(req)
        if req.stream:
            return self._stream(chat, req, created, events)
        while True:
            try:
                kind, val = events.get(timeout=0.1)
            except queue.Empty:
                kind = None
            # Between tokens too: while tokens flow the queue is never empty.
            if kind in (None, "delta"):
                if self._client_gone():
                    req.cancel.set()  # stop generating for nobody; the worker moves on
                    self.close_connection = True
                    return
                continue
            if kind == "error":
                raise val
            if kind == "done":
                self._access_log(val)
                return self._json(200, self._final(chat, req, created, val))

    def _access_log(self, reply: Reply) -> None:
        st = reply.stats
        if st is None:
            return
        sys.stderr.write(
            f"[http] {self.client_address[0]} {self._route()} {reply.finish_reason}: {st.generated_tokens} tokens, "
            f"τ {st.tokens_per_pass:.2f}, {st.tokens_per_second:.1f} tok/s ({st.mode})\n"
        )

    def _stream(self, chat: bool, req: GenerationRequest, created: int, events: "queue.Queue") -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self._cors_headers()
        self.end_headers()
        self.close_connection = True
        first = True
        # With tools, text that may be a call is held back until the reply ends (then it is
        # sent as delta.tool_calls, or as text if it did not parse); text that cannot be a
        # call (:func:`may_be_call`) streams as it comes.
        held = "" if req.tools else None
        try:
            while True:
                kind, val = events.get()
                if kind == "delta":
                    if held is not None:
                        held += val
                        if may_be_call(held):
                            continue
                        val, held = held, None
                    self._sse(self._chunk(chat, req.id, created, val, None, first))
                    first = False
                    continue
                if kind == "error":
                    self._sse({"error": {"message": f"{type(val).__name__}: {val}", "type": "server_error"}})
                else:
                    finish = _finish(val.finish_reason)
                    calls = reply_calls(held, req.tools) if held is not None and val.finish_reason == "stop" else None
                    if calls:
                        chunk = self._chunk(chat, req.id, created, "", None, first)
                        chunk["choices"][0]["delta"].update(content=None, tool_calls=_openai_calls(calls, True))
                        self._sse(chunk)
                        finish, first = "tool_calls", False
                    elif held:
                        self._sse(self._chunk(chat, req.id, created, held, None, first))
                        first = False
                    self._sse(self._chunk(chat, req.id, created, "", finish, first))
                    if req.include_usage:
                        usage = self._chunk(chat, req.id, created, "", None, False)
                        usage["choices"] = []
                        usage["usage"] = _usage(len(req.prompt_ids), val)
                        self._sse(usage)
                    self._access_log(val)
                break
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError, socket.timeout):
            req.cancel.set()  # the client went away: stop generating

    def _sse(self, obj: dict) -> None:
        self.wfile.write(b"data: " + json.dumps(obj).encode() + b"\n\n")
        self.wfile.flush()

    def _chunk(self, chat: bool, rid: str, created: int, text: str, finish: Optional[str], first: bool) -> dict:
        model_id = self.app.model_id
        if chat:
            delta = {"content": text}
            if first:
                delta["role"] = "assistant"
            choice = {"index": 0, "delta": delta, "finish_reason": finish}
            return {
                "id": rid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model_id,
                "choices": [choice],
            }
        return {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": model_id,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}],
        }

    def _final(self, chat: bool, req: GenerationRequest, created: int, reply: Reply) -> Dict[str, Any]:
        rid = req.id
        usage = _usage(len(req.prompt_ids), reply)
        stats = reply.stats.to_dict() if reply.stats else {}
        finish = _finish(reply.finish_reason)
        if chat:
            message = {"role": "assistant", "content": reply.text}
            calls = reply_calls(reply.text, req.tools) if reply.finish_reason == "stop" else None
            if calls:
                message = {"role": "assistant", "content": None, "tool_calls": _openai_calls(calls)}
                finish = "tool_calls"
            choice = {"index": 0, "message": message, "finish_reason": finish}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": reply.text, "logprobs": None, "finish_reason": finish}
            obj = "text_completion"
        return {
            "id": rid,
            "object": obj,
            "created": created,
            "model": self.app.model_id,
            "choices": [choice],
            "usage": usage,
            "specstream": stats,
        }


def escape_controls(text: str) -> str:
    """``text`` with control characters (ESC, BEL, NUL, ...) written as escapes, so a
    request line cannot drive the terminal that shows the log."""
    return "".join(c if c.isprintable() or c == " " else repr(c)[1:-1] for c in text)


def make_handler(app: App) -> type:
    """A handler class bound to ``app`` (and its socket timeout)."""
    return type("Handler", (ApiHandler,), {"app": app, "timeout": app.options.timeout})


def _usage(n_prompt: int, reply: Reply) -> dict:
    n = len(reply.tokens)
    return {"prompt_tokens": n_prompt, "completion_tokens": n, "total_tokens": n_prompt + n}


def _status_code(status: int) -> str:
    """The machine-readable code of one of ``http.server``'s own refusals."""
    return {414: "uri_too_long", 431: "headers_too_large", 505: "http_version_not_supported"}.get(
        status, "invalid_request"
    )


def _openai_calls(calls, streamed: bool = False) -> List[dict]:
    """OpenAI's ``tool_calls``: arguments as a JSON string, a fresh id per call (and, in a
    streamed delta, each call's index)."""
    out = []
    for i, c in enumerate(calls):
        item = {
            "id": "call_" + uuid.uuid4().hex[:24],
            "type": "function",
            "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)},
        }
        out.append({"index": i, **item} if streamed else item)
    return out


def _finish(reason: Optional[str]) -> str:
    """OpenAI's finish reason. A reply cut short (shutdown, cancel) never claims ``stop``: it is
    ``length``, the API's one value for an answer that was cut off (strict clients accept no other)."""
    return "length" if reason in ("length", "cancelled") else "stop"


@dataclass
class _Connection:
    handler: Any
    peer: str
    phase: str  # head (reading a request line and headers, or idle), body, busy, dropped
    since: float  # when this phase began
    started: float  # when this request's head began


class Connections:
    """Open connections: their slots, their phases, and a watchdog that drops the slow ones.

    A connection still sending its head (or idle between requests) may hold its slot
    ``header_timeout`` seconds, a whole request ``timeout``; one peer address may hold
    ``max_per_peer``. When every slot is taken, a new connection takes the slot of the
    connection that has waited longest in its head, so connections that trickle bytes
    or sit idle never keep a well-behaved client (or ``/health``) out."""

    def __init__(self, max_connections: int, max_per_peer: int, header_timeout: float, timeout: float):
        self.max_per_peer = max_per_peer
        self.header_timeout = min(header_timeout, timeout)
        self.timeout = timeout
        self.slots = threading.BoundedSemaphore(max_connections)
        self.lock = threading.Lock()
        self.open: Dict[int, _Connection] = {}
        self.stopped = threading.Event()

    def opened(self, handler) -> None:
        now = time.monotonic()
        with self.lock:
            self.open[id(handler)] = _Connection(handler, handler.client_address[0], "head", now, now)

    def closed(self, handler) -> None:
        with self.lock:
            self.open.pop(id(handler), None)

    def phase(self, handler, phase: str) -> None:
        now = time.monotonic()
        with self.lock:
            c = self.open.get(id(handler))
            if c is None or c.phase == "dropped":
                return
            if phase == "head":
                c.started = now
            c.phase, c.since = phase, now

    def _oldest_waiting(self, peer: Optional[str] = None) -> Optional[_Connection]:
        waiting = [c for c in self.open.values() if c.phase == "head" and (peer is None or c.peer == peer)]
        return min(waiting, key=lambda c: c.since, default=None)

    def drop(self, c: _Connection) -> None:
        c.phase = "dropped"
        c.handler.close_connection = True
        try:
            c.handler.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def admit(self, peer: str) -> bool:
        """A slot for a new connection from ``peer`` (taken from a waiting one if need be)."""
        with self.lock:
            victim = None
            if sum(c.peer == peer and c.phase != "dropped" for c in self.open.values()) >= self.max_per_peer:
                victim = self._oldest_waiting(peer)
                if victim is None:
                    return False
            if victim is not None:
                self.drop(victim)
            if self.slots.acquire(blocking=False):
                return True
            if victim is None:
                victim = self._oldest_waiting()
                if victim is not None:
                    self.drop(victim)
        # The dropped connection's thread frees its slot; without one, a connection that has
        # just ended (gone from ``open``, its thread not yet past its slot) may be about to.
        return self.slots.acquire(timeout=2.0 if victim is not None else 0.1)

    def watch(self) -> None:
        """Drop connections past their head or request deadline, until stopped."""
        while not self.stopped.wait(0.2):
            now = time.monotonic()
            with self.lock:
                for c in list(self.open.values()):
                    late_head = c.phase == "head" and now - c.since > self.header_timeout
                    late_request = c.phase in ("head", "body") and now - c.started > self.timeout
                    if late_head or late_request:
                        self.drop(c)


class _CappedServer(ThreadingHTTPServer):
    """A threading server whose connections :class:`Connections` admits and bounds."""

    daemon_threads = True

    def __init__(self, address, handler, options: HttpOptions):
        # On loopback every client has the same address: a per-peer cap would be the total.
        loopback = options.host.strip("[]") in LOCAL_HOSTS
        default_per_peer = options.max_connections if loopback else max(1, options.max_connections // 2)
        per_peer = options.max_per_peer or default_per_peer
        # Before binding: a failed bind calls server_close, which stops the watchdog.
        self.connections = Connections(options.max_connections, per_peer, options.header_timeout, options.timeout)
        super().__init__(address, handler)
        threading.Thread(target=self.connections.watch, daemon=True).start()

    def process_request(self, request, client_address):
        if not self.connections.admit(client_address[0]):
            try:
                request.sendall(
                    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                    b"Content-Length: 70\r\nConnection: close\r\n\r\n"
                    b'{"error": {"message": "too many connections", "code": "overloaded"}}  '
                )
            except OSError:
                pass
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def handle_error(self, request, client_address):
        exc = sys.exc_info()[1]
        sys.stderr.write(f"[http] {client_address[0]}: {type(exc).__name__}: {exc}\n")

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.connections.slots.release()

    def server_close(self):
        self.connections.stopped.set()
        super().server_close()


class _CappedServer6(_CappedServer):
    address_family = socket.AF_INET6


def make_server(
    model, tokenizer, model_id, mode, max_context, modes, host="127.0.0.1", port=8080, options=None
) -> "tuple[ThreadingHTTPServer, App]":
    options = options or HttpOptions(host=host)
    app = App(model, tokenizer, model_id, mode, max_context, modes, options)
    server_cls = _CappedServer6 if ":" in host.strip("[]") else _CappedServer
    try:
        server = server_cls((host.strip("[]"), port), make_handler(app), options)
    except OSError as e:  # port in use, address not on this machine, no permission
        raise ServeError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return server, app


class ServeError(RuntimeError):
    """The server cannot start; the message says why in one line."""


def serve_http(model, tokenizer, model_id, mode, max_context, modes, host, port, options=None) -> int:
    options = options or HttpOptions(host=host)
    if host not in LOCAL_HOSTS and options.api_key is None:
        print(
            f"specstream-mlx: warning: serving on {host} without --api-key: anyone who can reach this "
            "address can use the model",
            file=sys.stderr,
            flush=True,
        )
    server, app = make_server(model, tokenizer, model_id, mode, max_context, modes, host, port, options)
    print(f"specstream-mlx: serving {model_id} on http://{host}:{server.server_port}/v1", file=sys.stderr, flush=True)
    http_thread = threading.Thread(target=server.serve_forever, daemon=True)
    http_thread.start()
    stop = threading.Event()
    on_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, lambda signum, frame: app.interrupt()) if on_main else None
    try:
        app.work_forever(stop)  # MLX work stays on this (the loading) thread
        if app.interrupted:
            app.cancel_all()  # queued requests get their final chunk too
    except KeyboardInterrupt:
        app.cancel_all()
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
        stop.set()
        server.shutdown()
        server.server_close()
    return 0
