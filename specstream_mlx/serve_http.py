"""``specstream-mlx serve --http``: an OpenAI-compatible server on loopback.

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions`` (streaming
by server-sent events or not), ``GET /v1/models``, ``GET /health``. One model,
one generation at a time (a lock; MLX runs one stream of work per device).
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
from typing import Any, Dict, List, Optional

from .sampling import SamplingParams
from .session import ChatSession

MAX_BODY = 1 << 20


class ApiError(Exception):
    def __init__(self, status: int, message: str, code: str, type_: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.code, self.type = status, message, code, type_


def _num(body, key, default, lo, hi, integer=False):
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (integer and not isinstance(v, int)):
        raise ApiError(400, f"'{key}' must be a {'integer' if integer else 'number'}", "invalid_type")
    if not lo <= v <= hi:
        raise ApiError(400, f"'{key}' must be between {lo} and {hi}", "invalid_value")
    return int(v) if integer else float(v)


class App:
    """Request parsing, plus a job queue: MLX work runs on the thread that loaded
    the model (MLX streams are per thread), one request at a time."""

    def __init__(self, model, tokenizer, model_id: str, mode: str, max_context: int, modes: List[str]):
        self.model, self.tokenizer = model, tokenizer
        self.model_id, self.mode, self.max_context, self.modes = model_id, mode, max_context, modes
        self.session = ChatSession(model, tokenizer)
        self.jobs: "queue.Queue" = queue.Queue()

    def submit(self, ids, max_tokens, sampling, stop, mode):
        """Queue a generation; returns (events queue, cancel event). Events:
        ("delta", text), then ("done", Reply) or ("error", exception)."""
        events: "queue.Queue" = queue.Queue()
        cancel = threading.Event()
        self.jobs.put((ids, max_tokens, sampling, stop, mode, events, cancel))
        return events, cancel

    def work_forever(self, stop_event: threading.Event) -> None:
        while not stop_event.is_set():
            try:
                job = self.jobs.get(timeout=0.2)
            except queue.Empty:
                continue
            ids, max_tokens, sampling, stop, mode, events, cancel = job
            kw = {"tree": "auto"} if mode == "ss" else {}
            try:
                gen = self.session.stream_ids(ids, max_tokens=max_tokens, sampling=sampling, mode=mode,
                                              stop=stop, cancel=cancel, **kw)
                while True:
                    try:
                        events.put(("delta", next(gen)))
                    except StopIteration as s:
                        events.put(("done", s.value))
                        break
            except Exception as e:  # reported to the waiting request as a 500
                events.put(("error", e))

    def parse(self, body: Dict[str, Any], chat: bool):
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object", "invalid_request")
        model = body.get("model")
        if model is not None and model != self.model_id:
            raise ApiError(404, f"the model '{model}' does not exist; this server serves '{self.model_id}'",
                           "model_not_found")
        if body.get("n", 1) != 1:
            raise ApiError(400, "only n = 1 is supported", "invalid_value")
        if chat:
            msgs = body.get("messages")
            if not isinstance(msgs, list) or not msgs:
                raise ApiError(400, "'messages' must be a non-empty list", "invalid_type")
            out = []
            for m in msgs:
                content = m.get("content") if isinstance(m, dict) else None
                if isinstance(content, list):  # OpenAI content parts: keep the text ones
                    content = "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
                if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant") or not isinstance(content, str):
                    raise ApiError(400, "each message needs a role (system|user|assistant) and text content", "invalid_type")
                out.append({"role": m["role"], "content": content})
            from .generation import encode_prompt

            if sum(len(m["content"]) for m in out) > 64 * self.max_context:
                raise ApiError(400, f"the prompt exceeds the context of {self.max_context} tokens", "context_length_exceeded")
            ids = encode_prompt(self.tokenizer, out, use_chat_template=True)
        else:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
                prompt = prompt[0]
            if not isinstance(prompt, str):
                raise ApiError(400, "'prompt' must be a string", "invalid_type")
            if len(prompt) > 64 * self.max_context:
                raise ApiError(400, f"the prompt exceeds the context of {self.max_context} tokens", "context_length_exceeded")
            ids = list(self.tokenizer.encode(prompt))
        if not ids or (chat and not any(m["content"].strip() for m in out)) or (not chat and not prompt.strip()):
            raise ApiError(400, "the prompt is empty", "empty_prompt")
        if len(ids) >= self.max_context:
            raise ApiError(400, f"the prompt has {len(ids)} tokens; the context is {self.max_context}",
                           "context_length_exceeded")
        max_tokens = _num(body, "max_completion_tokens", None, 1, self.max_context, True) or \
            _num(body, "max_tokens", 256, 1, self.max_context, True)
        sampling = SamplingParams(
            temperature=_num(body, "temperature", 1.0, 0.0, 2.0),  # OpenAI default
            top_p=_num(body, "top_p", 1.0, 1e-9, 1.0),
            seed=_num(body, "seed", None, 0, 2**63 - 1, True),
        )
        stop = body.get("stop") or []
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop) or len(stop) > 16:
            raise ApiError(400, "'stop' must be a string or a list of strings", "invalid_type")
        mode = body.get("specstream_mode", self.mode)
        if mode not in self.modes:
            raise ApiError(400, f"'specstream_mode' must be one of {self.modes}", "invalid_value")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise ApiError(400, "'stream' must be a boolean", "invalid_type")
        return ids, min(max_tokens, self.max_context - len(ids)), sampling, stop, mode, stream


def make_handler(app: App):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        server_version = "specstream-mlx"

        def log_message(self, fmt, *args):  # access log to stderr
            sys.stderr.write("[http] " + (fmt % args) + "\n")

        def _json(self, status: int, obj: dict) -> None:
            data = json.dumps(obj).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _error(self, e: ApiError) -> None:
            self._json(e.status, {"error": {"message": e.message, "type": e.type, "code": e.code, "param": None}})

        def do_GET(self):
            if self.path == "/health":
                return self._json(200, {"status": "ok", "model": app.model_id})
            if self.path == "/v1/models":
                return self._json(200, {"object": "list", "data": [
                    {"id": app.model_id, "object": "model", "created": 0, "owned_by": "specstream-mlx"}]})
            self._error(ApiError(404, f"no route {self.path}", "not_found"))

        def do_POST(self):
            try:
                if self.path not in ("/v1/chat/completions", "/v1/completions"):
                    # Drain what we can so the connection stays usable.
                    raise ApiError(404, f"no route {self.path}", "not_found")
                length = self.headers.get("Content-Length")
                if length is None:
                    raise ApiError(411, "Content-Length is required", "length_required")
                try:
                    n = int(length)
                except ValueError:
                    raise ApiError(400, "bad Content-Length", "invalid_request") from None
                if n > MAX_BODY:
                    self.close_connection = True
                    # Drain a moderately large body so the client can read the
                    # 413 instead of seeing its upload reset mid-way.
                    left = n if n <= 32 * MAX_BODY else 0
                    while left > 0:
                        chunk = self.rfile.read(min(left, 1 << 16))
                        if not chunk:
                            break
                        left -= len(chunk)
                    raise ApiError(413, f"request bodies are limited to {MAX_BODY} bytes", "body_too_large")
                raw = self.rfile.read(n)
                try:
                    body = json.loads(raw.decode("utf-8"))
                except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
                    raise ApiError(400, f"the body is not valid JSON: {e}", "invalid_json") from None
                chat = self.path == "/v1/chat/completions"
                parsed = app.parse(body, chat)
                self._complete(chat, *parsed)
            except ApiError as e:
                self._error(e)
            except (BrokenPipeError, ConnectionResetError):
                pass
            except Exception as e:  # a bug in one request must not stop the server
                self._error(ApiError(500, f"{type(e).__name__}: {e}", "internal_error", "server_error"))

        def _complete(self, chat, ids, max_tokens, sampling, stop, mode, stream):
            rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
            created = int(time.time())
            events, cancel = app.submit(ids, max_tokens, sampling, stop, mode)
            if not stream:
                while True:
                    kind, val = events.get()
                    if kind == "error":
                        raise val
                    if kind == "done":
                        return self._json(200, self._final(chat, rid, created, val, len(ids)))
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
                        self._sse(self._chunk(chat, rid, created, val, None, first))
                        first = False
                        continue
                    if kind == "error":
                        self._sse({"error": {"message": f"{type(val).__name__}: {val}", "type": "server_error"}})
                    else:
                        self._sse(self._chunk(chat, rid, created, "", _finish(val.finish_reason), first))
                    break
                self.wfile.write(b"data: [DONE]\n\n")
                self.wfile.flush()
            except (BrokenPipeError, ConnectionResetError):
                cancel.set()  # the client went away: stop generating

        def _sse(self, obj):
            self.wfile.write(b"data: " + json.dumps(obj).encode() + b"\n\n")
            self.wfile.flush()

        def _chunk(self, chat, rid, created, text, finish, first):
            if chat:
                delta = {"content": text}
                if first:
                    delta["role"] = "assistant"
                choice = {"index": 0, "delta": delta, "finish_reason": finish}
                return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": app.model_id,
                        "choices": [choice]}
            return {"id": rid, "object": "text_completion", "created": created, "model": app.model_id,
                    "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}

        def _final(self, chat, rid, created, reply, n_prompt):
            usage = {"prompt_tokens": n_prompt, "completion_tokens": len(reply.tokens),
                     "total_tokens": n_prompt + len(reply.tokens)}
            stats = reply.stats.to_dict() if reply.stats else {}
            if chat:
                choice = {"index": 0, "message": {"role": "assistant", "content": reply.text},
                          "finish_reason": _finish(reply.finish_reason)}
                return {"id": rid, "object": "chat.completion", "created": created, "model": app.model_id,
                        "choices": [choice], "usage": usage, "specstream": stats}
            return {"id": rid, "object": "text_completion", "created": created, "model": app.model_id,
                    "choices": [{"index": 0, "text": reply.text, "logprobs": None,
                                 "finish_reason": _finish(reply.finish_reason)}],
                    "usage": usage, "specstream": stats}

    return Handler


def _finish(reason: Optional[str]) -> str:
    return "length" if reason == "length" else "stop"


def make_server(model, tokenizer, model_id, mode, max_context, modes, host="127.0.0.1", port=8080):
    app = App(model, tokenizer, model_id, mode, max_context, modes)
    server = ThreadingHTTPServer((host, port), make_handler(app))
    server.daemon_threads = True
    server.app = app
    return server


def serve_http(model, tokenizer, model_id, mode, max_context, modes, host, port) -> int:
    server = make_server(model, tokenizer, model_id, mode, max_context, modes, host, port)
    print(f"specstream-mlx: serving {model_id} on http://{host}:{server.server_port}/v1", file=sys.stderr, flush=True)
    http_thread = threading.Thread(target=server.serve_forever, daemon=True)
    http_thread.start()
    stop = threading.Event()
    try:
        server.app.work_forever(stop)  # MLX work stays on this (the loading) thread
    except KeyboardInterrupt:
        pass
    finally:
        stop.set()
        server.shutdown()
        server.server_close()
    return 0
