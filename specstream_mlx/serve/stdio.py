"""``specstream-mlx serve --stdio``: JSON lines over stdin/stdout (docs/PROTOCOL.md).

One request per line on stdin; events on stdout, one JSON object per line;
logs on stderr only. A reader thread parses and validates lines (so ``ping``
and ``cancel`` are answered while a request generates); the main thread runs
generation requests one at a time, in arrival order. Bad input of any kind
gets an ``error`` event; EOF lets queued requests finish, then exits 0.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import sys
import threading
from typing import Any, BinaryIO, Dict, List, Optional

from ..runtime.bounded import FATAL
from ..runtime.session import ChatSession
from ..tasks.tool_calls import model_tool_format
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

FIELDS = {
    "id",
    "prompt",
    "messages",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "mode",
    "stop",
    "seed",
    "cancel",
    "ping",
    "tools",
    "tool_choice",
}
MAX_LINE_BYTES = 4 << 20
_EOF = object()


def _is_id(v) -> bool:
    if isinstance(v, str):
        # JSON escapes can spell lone surrogates ("\ud800"), which are not text and cannot be echoed.
        return 0 < len(v) <= 256 and not any("\ud800" <= c <= "\udfff" for c in v)
    return isinstance(v, int) and not isinstance(v, bool)


class StdioServer:
    def __init__(self, model, tokenizer, default_mode: str, max_context: int, out: BinaryIO, modes: List[str]):
        self.model = model
        self.tokenizer = tokenizer
        self.default_mode = default_mode
        self.modes = modes
        self.max_context = max_context
        self.out = out
        self.out_lock = threading.Lock()
        self.queue: "queue.Queue" = queue.Queue()
        self.live: Dict[Any, GenerationRequest] = {}  # queued or running, by id
        self.live_lock = threading.Lock()
        self.session = ChatSession(model, tokenizer)
        self.tool_format = model_tool_format(getattr(model, "path", None))
        self.out_closed = False
        self.stop_code: Optional[int] = None

    # --- output ---------------------------------------------------------------
    def emit(self, obj: dict) -> None:
        data = (json.dumps(obj, ensure_ascii=False) + "\n").encode("utf-8", errors="replace")
        with self.out_lock:
            if self.out_closed:
                return
            try:
                self.out.write(data)
                self.out.flush()
            except (BrokenPipeError, OSError, ValueError):
                # The reader closed our stdout: nobody is listening; stop quietly.
                self.out_closed = True
                self.stop(0)

    # --- stopping ---------------------------------------------------------------
    def stop(self, code: int) -> None:
        """Cancel everything queued or running and make ``run`` return ``code``."""
        if self.stop_code is None:
            self.stop_code = code
        with self.live_lock:
            for r in self.live.values():
                r.cancel.set()

    def on_signal(self, signum, frame) -> None:
        # SIGINT: cancelled by the user (exit 130); SIGTERM: asked to shut down (exit 0).
        self.stop(130 if signum == signal.SIGINT else 0)

    def error(self, rid, code: str, message: str) -> None:
        self.emit({"id": rid, "event": "error", "code": code, "message": message})

    # --- input ----------------------------------------------------------------
    def read_lines(self, stream: BinaryIO) -> None:
        try:
            while True:
                raw = stream.readline(MAX_LINE_BYTES + 1)
                if not raw:
                    break
                if len(raw) > MAX_LINE_BYTES and not raw.endswith(b"\n"):
                    while True:  # discard the rest of the over-long line
                        more = stream.readline(MAX_LINE_BYTES)
                        if not more or more.endswith(b"\n"):
                            break
                    self.error(None, "line_too_long", f"request lines are limited to {MAX_LINE_BYTES} bytes")
                    continue
                self.handle_line(raw)
        finally:
            self.queue.put(_EOF)

    def handle_line(self, raw: bytes) -> None:
        if not raw.strip():
            return  # blank lines are ignored
        rid = None
        try:
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ProtocolError("invalid_utf8", f"line is not valid UTF-8 ({e.reason} at byte {e.start})") from None
            try:
                req = json.loads(text)
            except (ValueError, RecursionError) as e:  # ValueError: also 4,300+ digit integers
                raise ProtocolError("invalid_json", f"line is not valid JSON: {getattr(e, 'msg', e)}") from None
            if not isinstance(req, dict):
                raise ProtocolError("invalid_request", "a request must be a JSON object")
            if "id" not in req:
                raise ProtocolError("missing_id", 'every request needs an "id" (string or integer)')
            if not _is_id(req["id"]):
                raise ProtocolError("invalid_id", '"id" must be a non-empty string (<= 256 chars) or an integer')
            rid = req["id"]
            unknown = sorted(set(req) - FIELDS)
            if unknown:
                raise ProtocolError("unknown_field", f"unknown field(s): {', '.join(map(str, unknown))[:200]}")
            if "ping" in req:
                if req["ping"] is not True or len(req) != 2:
                    raise ProtocolError("invalid_request", 'a ping is exactly {"id": ..., "ping": true}')
                self.emit({"id": rid, "event": "pong"})
                return
            if "cancel" in req:
                if req["cancel"] is not True or len(req) != 2:
                    raise ProtocolError("invalid_request", 'a cancel is exactly {"id": ..., "cancel": true}')
                with self.live_lock:
                    target = self.live.get(rid)
                if target is None:
                    raise ProtocolError("not_found", f"no queued or running request with id {rid!r}")
                target.cancel.set()
                return
            r = self.parse_generation(req)
            with self.live_lock:
                if rid in self.live:
                    raise ProtocolError("duplicate_id", f"a request with id {rid!r} is already queued or running")
                self.live[rid] = r
            self.queue.put(r)
        except ProtocolError as e:
            self.error(rid, e.code, e.message)
        except FATAL:
            raise
        except BaseException as e:  # never let one line kill the reader (a native panic included)
            self.error(rid, "internal_error", f"{type(e).__name__}: {e}")

    def parse_generation(self, req: dict) -> GenerationRequest:
        has_p, has_m = "prompt" in req, "messages" in req
        if has_p == has_m:
            raise ProtocolError("invalid_request", 'give exactly one of "prompt" or "messages"')
        if has_p:
            p = req["prompt"]
            if not isinstance(p, str):
                raise ProtocolError("invalid_type", '"prompt" must be a string')
            check_text(p, "prompt")
            if not p.strip():
                raise ProtocolError("empty_prompt", '"prompt" is empty')
            messages = [{"role": "user", "content": p}]
        else:
            messages = parse_messages(req["messages"])
        tools = parse_tools(req, self.tool_format)
        messages = tool_prompt(messages, tools)
        check_prompt_chars(sum(len(x["content"]) for x in messages), self.max_context)
        return GenerationRequest(
            id=req["id"],
            messages=messages,
            prompt_ids=None,
            # Above the context left it is capped at run time (docs/PROTOCOL.md), as over HTTP.
            max_tokens=number(req, "max_tokens", 256, 1, 1 << 30, integer=True),
            sampling=parse_sampling(req, 0.0),
            mode=parse_mode(req.get("mode"), self.modes, self.default_mode),
            stop=parse_stop(req.get("stop")),
            tools=tools,
        )

    # --- generation -------------------------------------------------------------
    def run(self, stream: BinaryIO) -> int:
        """Serve until EOF (exit code 0) or a signal; see docs/PROTOCOL.md."""
        reader = threading.Thread(target=self.read_lines, args=(stream,), daemon=True)
        reader.start()
        while self.stop_code is None:
            try:
                r = self.queue.get(timeout=0.1)  # wakes up for signals, too
            except queue.Empty:
                continue
            if r is _EOF:
                return 0
            try:
                self.generate(r)
            except FATAL:
                raise
            except BaseException as e:  # one failed request must not end the server, nor a native panic
                self.error(r.id, "generation_failed", f"{type(e).__name__}: {e}")
            finally:
                with self.live_lock:
                    self.live.pop(r.id, None)
        # Stopped by a signal: every queued request still gets its "done".
        while True:
            try:
                r = self.queue.get_nowait()
            except queue.Empty:
                break
            if r is not _EOF:
                self.emit({"id": r.id, "event": "done", "text": "", "finish_reason": "cancelled", "stats": {}})
        return self.stop_code

    def generate(self, r: GenerationRequest) -> None:
        if r.cancel.is_set():
            self.emit({"id": r.id, "event": "done", "text": "", "finish_reason": "cancelled", "stats": {}})
            return
        try:
            ids = prompt_ids(self.tokenizer, r.messages, self.max_context)
            max_tokens = cap_max_tokens(r.max_tokens, len(ids), self.max_context)
        except ProtocolError as e:
            self.error(r.id, e.code, e.message)
            return
        gen = self.session.stream_ids(
            ids, max_tokens=max_tokens, sampling=r.sampling, mode=r.mode, stop=r.stop, cancel=r.cancel
        )
        while True:
            try:
                delta = next(gen)
            except StopIteration as s:
                reply = s.value
                break
            self.emit({"id": r.id, "event": "token", "text": delta})
        done = {
            "id": r.id,
            "event": "done",
            "text": reply.text,
            "finish_reason": reply.finish_reason,
            "stats": reply.stats.to_dict() if reply.stats else {},
        }
        calls = reply_calls(reply.text, r.tools) if reply.finish_reason == "stop" else None
        if calls:
            done.update(finish_reason="tool_calls", tool_calls=[c.to_json() for c in calls])
        self.emit(done)


def serve_stdio(model, tokenizer, default_mode: str, max_context: int, modes: List[str], name: str = "") -> int:
    out = sys.stdout.buffer
    # Anything else that prints (warnings, progress) goes to stderr, never into the protocol.
    sys.stdout = sys.stderr
    server = StdioServer(model, tokenizer, default_mode, max_context, out, modes)
    signal.signal(signal.SIGINT, server.on_signal)
    signal.signal(signal.SIGTERM, server.on_signal)
    server.emit({"id": None, "event": "ready", "model": name, "modes": modes, "max_context": max_context})
    code = server.run(sys.stdin.buffer)
    try:
        out.flush()
    except OSError:
        pass
    sys.stderr.flush()
    # The reader thread may be blocked in a read of stdin; a normal interpreter
    # shutdown would then abort ("_enter_buffered_busy"). Everything is flushed.
    os._exit(code)


def emit_load_error(message: str) -> None:
    """The one event a server that could not load its model writes before exiting 1."""
    line = json.dumps({"id": None, "event": "error", "code": "load_failed", "message": message}, ensure_ascii=False)
    sys.stdout.write(line + "\n")
    sys.stdout.flush()
