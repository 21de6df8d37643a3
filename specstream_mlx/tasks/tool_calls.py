"""The tool-call format: how tools are shown to a model and how its calls are read back.

A model whose chat template has no ``tools`` support (SmolLM2's has none) is shown the
tool definitions in a system message (:func:`tools_system_message`) and answers a call
with JSON only: one ``{"name": ..., "arguments": {...}}`` object, or a list of them for
parallel calls. :func:`parse_tool_calls` reads such a reply back; anything else (prose,
truncated or malformed JSON, unknown functions) is plain text, never an error.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

TOOLS_PREAMBLE = "You are a function-calling assistant. These functions are available, one JSON schema per line:\n"
TOOLS_RULE = (
    '\nTo call functions, reply with JSON only: {"name": <function name>, "arguments": {<argument>: <value>}}'
    " for one call, or a list of such objects for several calls."
)


# In a model directory: the model answers tool calls in this module's format.
TOOLS_FILE = "tools.json"
FORMAT = "specstream-json-v1"


def model_tool_format(model_dir) -> Optional[str]:
    """The tool-call format a model directory declares in ``tools.json``, or None."""
    if model_dir is None:
        return None
    try:
        d = json.loads((Path(model_dir) / TOOLS_FILE).read_text())
    except (OSError, ValueError):
        return None
    return d.get("format") if isinstance(d, dict) and d.get("format") == FORMAT else None


def write_tools_file(model_dir) -> None:
    note = "replies to tools shown in a system message (tasks/tool_calls.py) with JSON calls only"
    (Path(model_dir) / TOOLS_FILE).write_text(json.dumps({"format": FORMAT, "note": note}, indent=2) + "\n")


class ToolError(ValueError):
    """A malformed tool definition; the message names the field."""


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: Dict[str, Any]

    def to_json(self) -> dict:
        return {"name": self.name, "arguments": self.arguments}


def compact(obj) -> str:
    """JSON without spaces after separators: tool schemas are most of a prompt's tokens."""
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def check_tools(tools, where: str = "tools") -> List[dict]:
    """The function definitions of ``tools``: OpenAI's ``{"type": "function", "function":
    {...}}`` items or bare ``{"name", "description", "parameters"}`` objects. Raises
    ToolError naming the first bad field."""
    if not isinstance(tools, list) or not tools:
        raise ToolError(f"{where}: must be a non-empty list of function definitions")
    out = []
    for i, t in enumerate(tools):
        at = f"{where}[{i}]"
        if not isinstance(t, dict):
            raise ToolError(f"{at}: must be an object")
        if "function" in t or "type" in t:
            if t.get("type", "function") != "function":
                raise ToolError(f'{at}.type: only "function" tools are supported')
            t, at = t.get("function"), f"{at}.function"
            if not isinstance(t, dict):
                raise ToolError(f"{at}: must be an object")
        name = t.get("name")
        if not isinstance(name, str) or not name or len(name) > 256:
            raise ToolError(f"{at}.name: must be a non-empty string (at most 256 characters)")
        if "description" in t and not isinstance(t["description"], str):
            raise ToolError(f"{at}.description: must be a string")
        params = t.get("parameters", {})
        if not isinstance(params, dict):
            raise ToolError(f"{at}.parameters: must be a JSON-schema object")
        props = params.get("properties", {})
        if not isinstance(props, dict):
            raise ToolError(f"{at}.parameters.properties: must be an object")
        req = params.get("required", [])
        if not isinstance(req, list) or not all(isinstance(r, str) for r in req):
            raise ToolError(f"{at}.parameters.required: must be a list of strings")
        fn = {"name": name}
        if "description" in t:
            fn["description"] = t["description"]
        fn["parameters"] = params
        out.append(fn)
    return out


def tools_system_message(tools: Sequence[dict], system: Optional[str] = None) -> str:
    """The system message that shows ``tools`` (checked definitions) to the model; a system
    prompt of the conversation's own comes first."""
    lines = "\n".join(compact(t) for t in tools)
    head = (system.strip() + "\n\n") if system and system.strip() else ""
    return head + TOOLS_PREAMBLE + lines + TOOLS_RULE


def with_tools(messages: List[dict], tools: Sequence[dict]) -> List[dict]:
    """``messages`` with the tools' system message in front (merged with a system turn)."""
    if messages and messages[0].get("role") == "system":
        return [{"role": "system", "content": tools_system_message(tools, messages[0].get("content", ""))}] + list(
            messages[1:]
        )
    return [{"role": "system", "content": tools_system_message(tools)}] + list(messages)


def format_calls(calls: Sequence[ToolCall]) -> str:
    """The reply that makes ``calls``: one object, or a list for several."""
    if len(calls) == 1:
        return compact(calls[0].to_json())
    return compact([c.to_json() for c in calls])


CALL_STARTS = "{[`"  # a call is JSON, optionally in a Markdown code fence


def may_be_call(text: str) -> bool:
    """Whether text that begins a reply can still turn out to be a call: nothing visible
    yet, or its first visible character starts JSON or a fence."""
    s = text.lstrip()
    return not s or s[0] in CALL_STARTS


def parse_tool_calls(text: str, names: Optional[Sequence[str]] = None) -> Optional[List[ToolCall]]:
    """The calls a reply makes, or None when it is not a call (plain text).

    The reply must be JSON only (surrounding whitespace and one Markdown code fence
    allowed): an object with a string ``name`` and an object ``arguments``, or a non-empty
    list of them. With ``names``, every call must name one of them."""
    s = text.strip()
    if s.startswith("```"):
        s = s[3:]
        s = s[4:] if s.startswith("json") else s
        s = s.rsplit("```", 1)[0] if s.rstrip().endswith("```") else s
        s = s.strip()
    if not s or s[0] not in "[{":
        return None
    try:
        obj = json.loads(s)
    except (ValueError, RecursionError):
        return None
    items = obj if isinstance(obj, list) else [obj]
    if not items:
        return None
    calls = []
    for it in items:
        if not isinstance(it, dict) or set(it) - {"name", "arguments"}:
            return None
        name, args = it.get("name"), it.get("arguments", {})
        if not isinstance(name, str) or not isinstance(args, dict):
            return None
        if names is not None and name not in names:
            return None
        calls.append(ToolCall(name, args))
    return calls
