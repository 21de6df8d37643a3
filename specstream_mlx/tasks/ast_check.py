"""Is a function call correct? BFCL's AST rule, restated for our tool-call objects.

A call passes when it names the expected function, gives every required argument, gives no
argument the function or the answer does not know, and gives each argument a value of the
schema's type that is among the acceptable ones. Strings compare after standardization
(lower case, no spaces or ``,./-_*^``), lists element by element, objects key by key (a
key may be missing only where ``""`` is acceptable), an integer passes where a float is
expected, and a value whose type is the answer's own but not the schema's counts as a
variable name and compares exactly. Parallel calls match the answer's calls in any order;
the other categories expect exactly one call.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

from .tool_calls import ToolCall

PY_TYPES = {
    "string": str,
    "integer": int,
    "float": float,
    "number": float,
    "boolean": bool,
    "array": list,
    "tuple": list,
    "dict": dict,
    "object": dict,
    "any": str,
}
_STRIP = re.compile(r"[ ,./\-_*^]")


@dataclass(frozen=True)
class Verdict:
    valid: bool
    error: str = ""


OK = Verdict(True)


def standardize(s: str) -> str:
    return _STRIP.sub("", s).lower().replace("'", '"')


def _std(v):
    return standardize(v) if isinstance(v, str) else v


def _answer_type(acceptable: Sequence) -> Optional[type]:
    for a in acceptable:
        if a != "":
            return type(a)
    return None


def _dict_ok(value: dict, acceptable: Sequence) -> bool:
    """``value`` equals one acceptable object: each of its keys known and its value among
    that key's acceptable ones; each key it lacks optional there."""
    for ans in acceptable:
        if not isinstance(ans, dict):
            continue
        if all(k in ans and _std(v) in [_std(a) for a in ans[k]] for k, v in value.items()) and all(
            k in value or "" in vals for k, vals in ans.items()
        ):
            return True
    return False


def _list_of_dicts_ok(value: list, acceptable: Sequence) -> bool:
    return any(
        isinstance(ans, list)
        and len(ans) == len(value)
        and all(isinstance(v, dict) and _dict_ok(v, [a]) for v, a in zip(value, ans))
        for ans in acceptable
    )


def _type_name(schema) -> str:
    return schema.get("type", "") if isinstance(schema, dict) else ""


def check_value(param: str, value: Any, schema: dict, acceptable: Sequence) -> Verdict:
    kind = _type_name(schema)
    expected = PY_TYPES.get(kind)
    if expected is None:
        return OK if value in acceptable else Verdict(False, f"{param}: {value!r} not among {list(acceptable)}")
    if expected is float and type(value) is int:
        value = float(value)
    answer_type = _answer_type(acceptable)
    if type(value) is not expected:
        if answer_type is not None and type(value) is answer_type:  # a variable name in place of a value
            return OK if value in acceptable else Verdict(False, f"{param}: {value!r} not among {list(acceptable)}")
        return Verdict(False, f"{param}: expected {kind}, got {type(value).__name__}")
    item_kind = _type_name(schema.get("items")) if expected is list else ""
    item_type = PY_TYPES.get(item_kind)
    if expected is list and item_type is not None and item_type is not dict:
        for v in value:
            if type(v) is not item_type and not (item_type is float and type(v) is int):
                if not any(isinstance(a, list) and type(v) in {type(x) for x in a} for a in acceptable):
                    return Verdict(False, f"{param}: items must be {item_kind}, got {type(v).__name__}")
    if expected is dict:
        ok = _dict_ok(value, acceptable)
    elif expected is list and item_type is dict:
        ok = _list_of_dicts_ok(value, acceptable)
    elif expected is str:
        ok = standardize(value) in [standardize(a) for a in acceptable if isinstance(a, str)]
    elif expected is list:
        ok = [_std(v) for v in value] in [[_std(x) for x in a] for a in acceptable if isinstance(a, list)]
    else:
        ok = value in acceptable
    return OK if ok else Verdict(False, f"{param}: {value!r} not among {list(acceptable)}")


def check_call(call: ToolCall, tool: Optional[dict], answer: Dict[str, dict]) -> Verdict:
    """One call against one answer ``{name: {argument: [acceptable values]}}``."""
    ((name, expected_args),) = answer.items()
    if call.name != name:
        return Verdict(False, f"called {call.name!r}, expected {name!r}")
    if tool is None:
        return Verdict(False, f"{name!r} is not among the tools")
    params = tool.get("parameters", {})
    props = params.get("properties", {})
    for r in params.get("required", []):
        if r not in call.arguments:
            return Verdict(False, f"missing required argument {r!r}")
    for k, v in call.arguments.items():
        if k not in props or k not in expected_args:
            return Verdict(False, f"unexpected argument {k!r}")
        verdict = check_value(k, v, props[k], expected_args[k])
        if not verdict.valid:
            return verdict
    for k, acceptable in expected_args.items():
        if k not in call.arguments and "" not in acceptable:
            return Verdict(False, f"missing argument {k!r}")
    return OK


def check_calls(calls: Optional[List[ToolCall]], ground_truth: List[dict], tools: List[dict], category: str) -> Verdict:
    """The whole reply of one BFCL item (``calls`` None: the reply was not a call)."""
    if not calls:
        return Verdict(False, "no function call")
    by_name = {t["name"]: t for t in tools}
    if "parallel" in category:
        if len(calls) != len(ground_truth):
            return Verdict(False, f"{len(calls)} calls, expected {len(ground_truth)}")
        unused = list(range(len(calls)))
        for answer in ground_truth:
            (name,) = answer
            hit = next((i for i in unused if check_call(calls[i], by_name.get(calls[i].name), answer).valid), None)
            if hit is None:
                return Verdict(False, f"no call matches the expected {name!r} call")
            unused.remove(hit)
        return OK
    if len(calls) != 1:
        return Verdict(False, f"{len(calls)} calls, expected 1")
    return check_call(calls[0], by_name.get(calls[0].name), ground_truth[0])
