"""``specstream-mlx serve --http``: an OpenAI-compatible server on loopback.

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions`` (streaming
by server-sent events or not), ``GET /v1/models``, ``GET /health``. One model,
one generation at a time (MLX work runs on the thread that loaded the model).
Bad requests get 4xx JSON errors in OpenAI's shape and the server keeps
serving. Request bodies are limited to ``MAX_BODY`` bytes.
"""

from __future__ import annotations

import json
import queue
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Dict, List, Optional, Tuple

from ..runtime.generation import encode_prompt
from ..runtime.session import ChatSession, Reply
from .protocol import (
    GenerationRequest,
    ProtocolError,
    cap_max_tokens,
    check_prompt_chars,
    number,
    parse_messages,
    parse_mode,
    parse_sampling,
    parse_stop,
)

MAX_BODY = 1 << 20
CONTEXT_CODE = "context_length_exceeded"


class App:
    """Request parsing, plus a job queue: MLX work runs on the thread that loaded
    the model (MLX streams are per thread), one request at a time."""

    def __init__(self, model, tokenizer, model_id: str, mode: str, max_context: int, modes: List[str]):
        self.model, self.tokenizer = model, tokenizer
        self.model_id, self.mode, self.max_context, self.modes = model_id, mode, max_context, modes
        self.session = ChatSession(model, tokenizer)
        self.jobs: "queue.Queue[Tuple[GenerationRequest, queue.Queue]]" = queue.Queue()

    def submit(self, req: GenerationRequest) -> "queue.Queue":
        """Queue a generation; returns its events queue: ("delta", text), then
        ("done", Reply) or ("error", exception)."""
        events: "queue.Queue" = queue.Queue()
        self.jobs.put((req, events))
        return events

    def work_forever(self, stop_event: threading.Event) -> None:
        while not stop_event.is_set():
            try:
                req, events = self.jobs.get(timeout=0.2)
            except queue.Empty:
                continue
            try:
                gen = self.session.stream_ids(
                    req.prompt_ids,
                    max_tokens=req.max_tokens,
                    sampling=req.sampling,
                    mode=req.mode,
                    stop=req.stop,
                    cancel=req.cancel,
                )
                while True:
                    try:
                        events.put(("delta", next(gen)))
                    except StopIteration as s:
                        events.put(("done", s.value))
                        break
            except Exception as e:  # reported to the waiting request as a 500
                events.put(("error", e))

    def parse(self, body: Any, chat: bool) -> GenerationRequest:
        if not isinstance(body, dict):
            raise ProtocolError("invalid_request", "the request body must be a JSON object")
        model = body.get("model")
        if model is not None and model != self.model_id:
            raise ProtocolError(
                "model_not_found", f"the model '{model}' does not exist; this server serves '{self.model_id}'", 404
            )
        if body.get("n", 1) != 1:
            raise ProtocolError("invalid_value", "only n = 1 is supported")
        ids = self._prompt_ids(body, chat)
        requested = number(body, "max_completion_tokens", None, 1, self.max_context, integer=True)
        if requested is None:
            requested = number(body, "max_tokens", 256, 1, self.max_context, integer=True)
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise ProtocolError("invalid_type", '"stream" must be a boolean')
        return GenerationRequest(
            id=("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24],
            messages=None,
            prompt_ids=ids,
            max_tokens=cap_max_tokens(requested, len(ids), self.max_context, CONTEXT_CODE),
            sampling=parse_sampling(body, 1.0),  # OpenAI's default temperature
            mode=parse_mode(body.get("specstream_mode"), self.modes, self.mode, "specstream_mode"),
            stop=parse_stop(body.get("stop")),
            stream=stream,
        )

    def _prompt_ids(self, body: dict, chat: bool) -> List[int]:
        if chat:
            messages = parse_messages(body.get("messages"), strict_keys=False)
            check_prompt_chars(sum(len(m["content"]) for m in messages), self.max_context, CONTEXT_CODE)
            return encode_prompt(self.tokenizer, messages, use_chat_template=True)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise ProtocolError("invalid_type", '"prompt" must be a string')
        check_prompt_chars(len(prompt), self.max_context, CONTEXT_CODE)
        if not prompt.strip():
            raise ProtocolError("empty_prompt", "the prompt is empty")
        return list(self.tokenizer.encode(prompt))


class ApiHandler(BaseHTTPRequestHandler):
    """One HTTP connection; ``app`` is set on the subclass :func:`make_handler` builds."""

    protocol_version = "HTTP/1.1"
    server_version = "specstream-mlx"
    app: App

    def log_message(self, fmt, *args):  # access log to stderr
        sys.stderr.write("[http] " + (fmt % args) + "\n")

    def _json(self, status: int, obj: dict) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, e: ProtocolError) -> None:
        kind = "server_error" if e.status >= 500 else "invalid_request_error"
        self._json(e.status, {"error": {"message": e.message, "type": kind, "code": e.code, "param": None}})

    def do_GET(self):
        app = self.app
        if self.path == "/health":
            return self._json(200, {"status": "ok", "model": app.model_id})
        if self.path == "/v1/models":
            return self._json(
                200,
                {
                    "object": "list",
                    "data": [{"id": app.model_id, "object": "model", "created": 0, "owned_by": "specstream-mlx"}],
                },
            )
        self._error(ProtocolError("not_found", f"no route {self.path}", 404))

    def do_POST(self):
        try:
            if self.path not in ("/v1/chat/completions", "/v1/completions"):
                raise ProtocolError("not_found", f"no route {self.path}", 404)
            body = self._read_body()
            chat = self.path == "/v1/chat/completions"
            self._complete(chat, self.app.parse(body, chat))
        except ProtocolError as e:
            self._error(e)
        except (BrokenPipeError, ConnectionResetError):
            pass
        except Exception as e:  # a bug in one request must not stop the server
            self._error(ProtocolError("internal_error", f"{type(e).__name__}: {e}", 500))

    def _read_body(self) -> Any:
        length = self.headers.get("Content-Length")
        if length is None:
            raise ProtocolError("length_required", "Content-Length is required", 411)
        try:
            n = int(length)
        except ValueError:
            raise ProtocolError("invalid_request", "bad Content-Length") from None
        if n < 0:
            raise ProtocolError("invalid_request", "bad Content-Length")
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
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
            raise ProtocolError("invalid_json", f"the body is not valid JSON: {e}") from None

    def _complete(self, chat: bool, req: GenerationRequest) -> None:
        created = int(time.time())
        events = self.app.submit(req)
        if not req.stream:
            while True:
                kind, val = events.get()
                if kind == "error":
                    raise val
                if kind == "done":
                    return self._json(200, self._final(chat, req.id, created, val, len(req.prompt_ids)))
        self._stream(chat, req, created, events)

    def _stream(self, chat: bool, req: GenerationRequest, created: int, events: "queue.Queue") -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        first = True
        try:
            while True:
                kind, val = events.get()
                if kind == "delta":
                    self._sse(self._chunk(chat, req.id, created, val, None, first))
                    first = False
                    continue
                if kind == "error":
                    self._sse({"error": {"message": f"{type(val).__name__}: {val}", "type": "server_error"}})
                else:
                    self._sse(self._chunk(chat, req.id, created, "", _finish(val.finish_reason), first))
                break
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
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

    def _final(self, chat: bool, rid: str, created: int, reply: Reply, n_prompt: int) -> Dict[str, Any]:
        usage = {
            "prompt_tokens": n_prompt,
            "completion_tokens": len(reply.tokens),
            "total_tokens": n_prompt + len(reply.tokens),
        }
        stats = reply.stats.to_dict() if reply.stats else {}
        finish = _finish(reply.finish_reason)
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": reply.text}, "finish_reason": finish}
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


def make_handler(app: App) -> type:
    """A handler class bound to ``app``."""
    return type("Handler", (ApiHandler,), {"app": app})


def _finish(reason: Optional[str]) -> str:
    return "length" if reason == "length" else "stop"


def make_server(model, tokenizer, model_id, mode, max_context, modes, host="127.0.0.1", port=8080):
    app = App(model, tokenizer, model_id, mode, max_context, modes)
    server = ThreadingHTTPServer((host, port), make_handler(app))
    server.daemon_threads = True
    return server, app


def serve_http(model, tokenizer, model_id, mode, max_context, modes, host, port) -> int:
    server, app = make_server(model, tokenizer, model_id, mode, max_context, modes, host, port)
    print(f"specstream-mlx: serving {model_id} on http://{host}:{server.server_port}/v1", file=sys.stderr, flush=True)
    http_thread = threading.Thread(target=server.serve_forever, daemon=True)
    http_thread.start()
    stop = threading.Event()
    try:
        app.work_forever(stop)  # MLX work stays on this (the loading) thread
    except KeyboardInterrupt:
        pass
    finally:
        stop.set()
        server.shutdown()
        server.server_close()
    return 0
