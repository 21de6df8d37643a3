"""BFCL (the Berkeley Function Calling Leaderboard, PyPI ``bfcl-eval``) -> chat JSONL.

The package is located with ``importlib.util.find_spec`` and read as files, never
imported (its ``__init__`` pulls in its own dependencies). Each single-turn item of
the eight categories with answers becomes one chat row::

    {"id", "category", "tools", "ground_truth",
     "messages": [system (the tools, :mod:`.tool_calls`), user..., assistant (the target)]}

The target is the call(s) in one canonical JSON form: ``{"name", "arguments"}`` with the
first acceptable value of each argument, an argument whose acceptable values include
``""`` (BFCL's "may be omitted") left out unless the schema requires it, and several calls as a list in the answer's
order. The split is a pure function of the id (:func:`split_of`), so the test split never
changes with the data's order or the length cap.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Tuple

from .ast_check import check_calls
from .tool_calls import ToolCall, ToolError, check_tools, format_calls, with_tools

PACKAGE = "bfcl-eval"
# The version whose data the shipped split and fine-tune were built from (Makefile pins it).
VERSION = "2026.3.23"
MODULE = "bfcl_eval"
CATEGORIES = (
    "simple_python",
    "multiple",
    "parallel",
    "parallel_multiple",
    "live_simple",
    "live_multiple",
    "live_parallel",
    "live_parallel_multiple",
)
# Out of every 20 ids (by hash): 2 test, 1 valid, 17 train.
TEST_BUCKETS, VALID_BUCKETS, BUCKETS = 2, 1, 20


class BFCLError(RuntimeError):
    pass


@dataclass
class BFCLItem:
    id: str
    category: str
    messages: List[dict]
    tools: List[dict]
    ground_truth: List[dict]

    def target(self) -> List[ToolCall]:
        return canonical_calls(self.ground_truth, self.tools)


@dataclass
class ReadReport:
    items: List[BFCLItem] = field(default_factory=list)
    skipped: Dict[str, int] = field(default_factory=dict)

    def skip(self, why: str) -> None:
        self.skipped[why] = self.skipped.get(why, 0) + 1


def data_dir() -> Path:
    """The package's ``data`` folder."""
    spec = importlib.util.find_spec(MODULE)
    if spec is None or not spec.submodule_search_locations:
        raise BFCLError(f"the {PACKAGE} package is not installed: pip install --no-deps {PACKAGE}=={VERSION}")
    d = Path(list(spec.submodule_search_locations)[0]) / "data"
    if not (d / "possible_answer").is_dir():
        raise BFCLError(f"{d}: no possible_answer folder (an unexpected {PACKAGE} layout)")
    return d


def split_of(item_id: str) -> str:
    """ "train", "valid" or "test": a stable hash of the id, independent of everything else."""
    b = int.from_bytes(hashlib.sha256(item_id.encode()).digest()[:8], "big") % BUCKETS
    return "test" if b < TEST_BUCKETS else "valid" if b < TEST_BUCKETS + VALID_BUCKETS else "train"


def _jsonl(path: Path) -> Iterator[Tuple[int, Optional[dict]]]:
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except ValueError:
                yield n, None
                continue
            yield n, rec if isinstance(rec, dict) else None


def read_category(root: Path, category: str, report: ReadReport) -> None:
    """Append ``category``'s usable items to ``report`` (bad records counted, not fatal)."""
    q_path = root / f"BFCL_v4_{category}.json"
    a_path = root / "possible_answer" / f"BFCL_v4_{category}.json"
    if not q_path.is_file() or not a_path.is_file():
        report.skip(f"{category}: file missing")
        return
    answers = {}
    for _, rec in _jsonl(a_path):
        if rec is not None and isinstance(rec.get("id"), str):
            answers[rec["id"]] = rec.get("ground_truth")
    for _, rec in _jsonl(q_path):
        item = _item(rec, category, answers, report)
        if item is not None:
            report.items.append(item)


def _item(rec, category: str, answers: dict, report: ReadReport) -> Optional[BFCLItem]:
    if rec is None or not isinstance(rec.get("id"), str):
        report.skip("unparsable record")
        return None
    gt = answers.get(rec["id"])
    if not isinstance(gt, list) or not gt or not all(isinstance(c, dict) and len(c) == 1 for c in gt):
        report.skip("no usable answer")
        return None
    q = rec.get("question")
    if not (isinstance(q, list) and len(q) == 1 and isinstance(q[0], list) and q[0]):
        report.skip("not single-turn")
        return None
    msgs = q[0]
    if not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in msgs
    ):
        report.skip("bad message")
        return None
    try:
        tools = check_tools(rec.get("function"), "function")
        item = BFCLItem(rec["id"], category, [dict(role=m["role"], content=m["content"]) for m in msgs], tools, gt)
        target = item.target()
    except (ToolError, BFCLError) as e:
        report.skip(f"bad record ({str(e).split(':')[0]})")
        return None
    if not check_calls(target, gt, tools, category).valid:
        report.skip("answer contradicts its own schema")  # no reply could pass this item
        return None
    if msgs[-1]["role"] != "user":
        report.skip("does not end with a user turn")
        return None
    return item


def read_bfcl(root: Optional[Path] = None, categories=CATEGORIES) -> ReadReport:
    root = Path(root) if root is not None else data_dir()
    report = ReadReport()
    for c in categories:
        read_category(root, c, report)
    return report


def _schema_type(schema) -> str:
    return schema.get("type", "") if isinstance(schema, dict) else ""


def _first_value(values, schema):
    """The canonical value of one argument: the first acceptable one, nested answers
    (dicts of per-key acceptable lists) reduced the same way."""
    if not isinstance(values, list) or not values:
        raise BFCLError("an argument's acceptable values must be a non-empty list")
    v = next((x for x in values if x != ""), values[0])
    kind, schema = _schema_type(schema), schema or {}
    if kind in ("dict", "object") and isinstance(v, dict):
        return _canonical_args(v, schema.get("properties", {}), schema.get("required", []))
    if kind in ("array", "tuple") and isinstance(v, list) and _schema_type(schema.get("items")) in ("dict", "object"):
        props = schema["items"].get("properties", {})
        req = schema["items"].get("required", [])
        return [_canonical_args(d, props, req) if isinstance(d, dict) else d for d in v]
    return v


def _canonical_args(answer: dict, props: dict, required=()) -> dict:
    out = {}
    for k, values in answer.items():
        if isinstance(values, list) and "" in values and (k not in required or values == [""]):
            continue  # may be omitted (and the schema does not require it): the canonical form omits it
        out[k] = _first_value(values, props.get(k) if isinstance(props, dict) else None)
    return out


def canonical_calls(ground_truth: List[dict], tools: List[dict]) -> List[ToolCall]:
    by_name = {t["name"]: t for t in tools}
    calls = []
    for c in ground_truth:
        ((name, answer),) = c.items()
        if not isinstance(answer, dict):
            raise BFCLError(f"{name}: the answer's arguments must be an object")
        params = by_name.get(name, {}).get("parameters", {})
        calls.append(ToolCall(name, _canonical_args(answer, params.get("properties", {}), params.get("required", []))))
    return calls


def chat_row(item: BFCLItem, with_target: bool = True) -> dict:
    msgs = with_tools(item.messages, item.tools)
    if with_target:
        msgs = msgs + [{"role": "assistant", "content": format_calls(item.target())}]
    return {
        "id": item.id,
        "category": item.category,
        "tools": item.tools,
        "ground_truth": item.ground_truth,
        "messages": msgs,
    }


@dataclass
class PreparedSplits:
    counts: Dict[str, int]
    too_long: Dict[str, int]
    skipped: Dict[str, int]
    prompt_tokens: Dict[str, List[int]]
    target_tokens: Dict[str, List[int]]
    test_ids: List[str]


def prepare(out: Path, tokenizer, max_tokens: Optional[int], root: Optional[Path] = None, log=print) -> PreparedSplits:
    """train/valid/test.jsonl in ``out``; train and valid rows longer than ``max_tokens``
    (prompt + target, the model's chat template applied) are left out and counted; the test
    split keeps every item (the evaluation measures the whole split, long prompts included)."""
    report = read_bfcl(root)
    splits: Dict[str, List[dict]] = {"train": [], "valid": [], "test": []}
    too_long = {"train": 0, "valid": 0, "test": 0}
    p_len: Dict[str, List[int]] = {"train": [], "valid": [], "test": []}
    t_len: Dict[str, List[int]] = {"train": [], "valid": [], "test": []}
    for item in report.items:
        split = split_of(item.id)
        row = chat_row(item)
        prompt = tokenizer.apply_chat_template(row["messages"][:-1], tokenize=False, add_generation_prompt=True)
        n_prompt = len(tokenizer.encode(prompt, add_special_tokens=False))
        n_target = len(tokenizer.encode(row["messages"][-1]["content"], add_special_tokens=False)) + 1
        if split != "test" and max_tokens and n_prompt + n_target > max_tokens:
            too_long[split] += 1
            continue
        p_len[split].append(n_prompt)
        t_len[split].append(n_target)
        splits[split].append(row)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for name, rows in splits.items():
        tmp = out / f".{name}.jsonl.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            for r in rows:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")
        tmp.replace(out / f"{name}.jsonl")
    return PreparedSplits(
        {k: len(v) for k, v in splits.items()},
        too_long,
        report.skipped,
        p_len,
        t_len,
        sorted(r["id"] for r in splits["test"]),
    )
