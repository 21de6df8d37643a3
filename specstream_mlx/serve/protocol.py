"""What both servers accept: one request representation and its validators.

The stdio and HTTP front ends differ in framing (JSON lines vs HTTP bodies)
and in a few field names (``specstream_mode`` over HTTP), but a generation
request is the same :class:`GenerationRequest` and every field goes through
the same checks, so a value rejected by one server is rejected by the other.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from ..io.limits import SEED_MAX
from ..runtime.sampling import SamplingParams
from ..tasks.tool_calls import ToolCall, ToolError, check_tools, format_calls, parse_tool_calls, with_tools

ROLES = ("system", "user", "assistant")
MAX_STOP_STRINGS = 16
# Cheap bound before tokenizing: no tokenizer packs more than ~64 chars per token.
CHARS_PER_TOKEN_BOUND = 64


class ProtocolError(Exception):
    """A request the server refuses; ``code`` is machine-readable, ``status`` the HTTP status."""

    def __init__(self, code: str, message: str, status: int = 400):
        super().__init__(message)
        self.code = code
        self.message = message
        self.status = status


@dataclass
class GenerationRequest:
    """One validated generation request.

    Attributes:
        id: the client's id (stdio) or a generated one (HTTP).
        messages: chat messages to render with the template, or None.
        prompt_ids: raw prompt token ids (HTTP completions), or None.
        max_tokens: most tokens to generate (capped by the context left at run time).
        sampling: temperature, top-p, top-k and seed.
        mode: decoding mode (ss, ar or lookup).
        stop: stop strings.
        stream: stream events/chunks (HTTP); stdio always streams.
        include_usage: HTTP streaming: end with a chunk carrying the usage.
        cancel: set to stop the request early.
    """

    id: Any
    messages: Optional[List[Dict[str, str]]]
    prompt_ids: Optional[List[int]]
    max_tokens: int
    sampling: SamplingParams
    mode: str
    stop: List[str]
    stream: bool = True
    include_usage: bool = False
    cancel: threading.Event = field(default_factory=threading.Event)
    # Who may reuse the KV cache this request leaves (HTTP: one client's conversation).
    owner: Any = None
    # Checked tool definitions shown to the model (its reply may then be tool calls), or None.
    tools: Optional[List[dict]] = None


def number(body: dict, key: str, default, lo, hi, integer: bool = False):
    """``body[key]`` as a finite number in [lo, hi], or ``default`` when absent or null."""
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (integer and not isinstance(v, int)):
        raise ProtocolError("invalid_type", f'"{key}" must be {"an integer" if integer else "a number"}')
    if not math.isfinite(v) or not lo <= v <= hi:
        raise ProtocolError("invalid_value", f'"{key}" must be between {lo} and {hi}')
    return int(v) if integer else float(v)


def check_text(text: str, key: str) -> str:
    """``text`` if it is valid Unicode (JSON allows lone surrogates like "\\ud800", which no
    tokenizer can encode)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ProtocolError("invalid_value", f'"{key}" contains a lone surrogate: not valid Unicode') from None
    return text


def text_of(content: Any) -> Optional[str]:
    """A message's text: a string, or OpenAI content parts of type text; None if neither."""
    if isinstance(content, list):
        parts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
        if not all(isinstance(t, str) for t in parts):
            return None  # a text part whose text is not a string
        content = "".join(parts)
    return check_text(content, "content") if isinstance(content, str) else None


def parse_messages(raw: Any, strict_keys: bool = True) -> List[Dict[str, str]]:
    """Validated chat messages ``[{"role", "content"}]``.

    ``strict_keys``: refuse keys besides role and content (stdio); HTTP clients
    send extra keys (``name``...) that are ignored, and the turns of OpenAI tool use: an
    assistant turn with ``tool_calls`` (its content the calls in the model's format) and
    ``tool`` turns with the results."""
    if not isinstance(raw, list) or not raw:
        raise ProtocolError("invalid_type", '"messages" must be a non-empty list')
    out = []
    for i, m in enumerate(raw):
        if not strict_keys and isinstance(m, dict) and m.get("role") == "tool":
            content = text_of(m.get("content"))
            if content is None:
                raise ProtocolError("invalid_type", f'messages[{i}]: a "tool" message needs a string "content"')
            out.append({"role": "tool", "content": content})
            continue
        if not strict_keys and isinstance(m, dict) and m.get("role") == "assistant" and m.get("tool_calls"):
            out.append({"role": "assistant", "content": format_calls(_history_calls(m["tool_calls"], i))})
            continue
        content = text_of(m.get("content")) if isinstance(m, dict) else None
        ok = isinstance(m, dict) and m.get("role") in ROLES and content is not None
        if ok and strict_keys:
            ok = set(m) <= {"role", "content"} and isinstance(m.get("content"), str)
        if not ok:
            raise ProtocolError("invalid_type", 'each message is {"role": system|user|assistant, "content": string}')
        out.append({"role": m["role"], "content": content})
    if not any(m["content"].strip() for m in out):
        raise ProtocolError("empty_prompt", "the prompt is empty")
    return out


def _history_calls(raw: Any, i: int) -> List[ToolCall]:
    """An earlier assistant turn's OpenAI ``tool_calls``, as calls."""
    import json

    where = f"messages[{i}].tool_calls"
    if not isinstance(raw, list):
        raise ProtocolError("invalid_type", f"{where}: must be a list")
    calls = []
    for j, c in enumerate(raw):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ProtocolError("invalid_type", f'{where}[{j}]: needs a "function" with a string "name"')
        args = fn.get("arguments", "{}")
        try:
            args = json.loads(args) if isinstance(args, str) else args
        except ValueError:
            raise ProtocolError("invalid_value", f"{where}[{j}].function.arguments: not valid JSON") from None
        if not isinstance(args, dict):
            raise ProtocolError("invalid_type", f"{where}[{j}].function.arguments: must be a JSON object")
        calls.append(ToolCall(fn["name"], args))
    return calls


TOOL_CHOICES = ("auto", "none")


def parse_tools(body: dict, tool_format: Optional[str], model_name: str = "this model") -> Optional[List[dict]]:
    """The request's checked tool definitions, or None when it gives none (or
    ``tool_choice`` is "none": then they are checked but not shown). A model without a
    tool-call format refuses tools it would be shown."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if choice is not None and choice not in TOOL_CHOICES:
        raise ProtocolError("invalid_value", '"tool_choice" must be "auto" or "none" (forced calls are not supported)')
    if tools in (None, []):
        return None
    try:
        checked = check_tools(tools, "tools")
    except ToolError as e:
        raise ProtocolError("invalid_value", str(e)) from None
    if choice == "none":  # the model is not shown them: any model can answer
        return None
    if tool_format is None:
        raise ProtocolError(
            "invalid_value", f'"tools" is not supported by {model_name}: it was not fine-tuned with a tool-call format'
        )
    return checked


def tool_prompt(messages: List[Dict[str, str]], tools: Optional[List[dict]]) -> List[Dict[str, str]]:
    return with_tools(messages, tools) if tools else messages


def reply_calls(text: str, tools: Optional[List[dict]]) -> Optional[List[ToolCall]]:
    """The tool calls a finished reply makes, or None (then it is plain text)."""
    if not tools:
        return None
    return parse_tool_calls(text, [t["name"] for t in tools])


def parse_stop(raw: Any) -> List[str]:
    """Stop strings: a string, a list of at most 16 strings, or nothing."""
    if raw is None:
        return []
    stop = [raw] if isinstance(raw, str) else raw
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop) or len(stop) > MAX_STOP_STRINGS:
        raise ProtocolError("invalid_type", f'"stop" must be a string or a list of at most {MAX_STOP_STRINGS} strings')
    if any(s == "" for s in stop):  # it would match before the first token: every reply empty
        raise ProtocolError("invalid_value", '"stop" strings must not be empty')
    return [check_text(s, "stop") for s in stop]


def parse_mode(raw: Any, modes: List[str], default: str, key: str = "mode") -> str:
    mode = default if raw is None else raw
    if not isinstance(mode, str) or mode not in modes:
        raise ProtocolError("invalid_value", f'"{key}" must be one of {", ".join(modes)}')
    return mode


def check_prompt_chars(n_chars: int, max_context: int, code: str = "prompt_too_long") -> None:
    """Refuse prompts that cannot fit before paying for tokenization."""
    if n_chars > CHARS_PER_TOKEN_BOUND * max_context:
        raise ProtocolError(code, f"the prompt exceeds the context of {max_context} tokens")


def parse_sampling(body: dict, default_temperature: float, default_top_p: float = 1.0) -> SamplingParams:
    """Temperature, top-p, top-k and seed of a request (temperatures below 1e-5 are greedy)."""
    return SamplingParams(
        temperature=number(body, "temperature", default_temperature, 0.0, 100.0),
        top_p=number(body, "top_p", default_top_p, 1e-9, 1.0),
        top_k=number(body, "top_k", 0, 0, 1 << 30, integer=True),
        seed=number(body, "seed", None, 0, SEED_MAX, integer=True),
    )


def cap_max_tokens(requested: int, n_prompt: int, max_context: int, code: str = "prompt_too_long") -> int:
    """``requested`` capped by the context left after ``n_prompt`` tokens."""
    if n_prompt >= max_context:
        raise ProtocolError(code, f"the prompt has {n_prompt} tokens; the context is {max_context}")
    return min(requested, max_context - n_prompt)


def prompt_ids(tokenizer, prompt, max_context: int, chat: bool = True, code: str = "prompt_too_long") -> List[int]:
    """Token ids of validated messages through the chat template (``chat``), or of a raw
    prompt string. A template that refuses the messages (``raise_exception``, e.g. "roles
    must alternate"), runs too long, renders more text than the context can hold, or a
    tokenizer that fails on the text (a native panic included) is one ProtocolError."""
    from jinja2 import TemplateError

    from ..runtime.bounded import PromptError
    from ..runtime.generation import encode_prompt

    try:
        return encode_prompt(tokenizer, prompt, use_chat_template=chat, max_chars=CHARS_PER_TOKEN_BOUND * max_context)
    except TemplateError as e:
        raise ProtocolError("invalid_value", f'"messages": the chat template refused them: {e}') from None
    except PromptError as e:
        over = "over the limit" in str(e)
        raise ProtocolError(code if over else "invalid_prompt", str(e), 400) from None
