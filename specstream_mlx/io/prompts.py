"""Prompt files: JSONL rows in any format ``train`` reads, as prompts to answer.

Shared by ``bench --prompts-file`` and ``distill``. A row is ``{"prompt": ...}``
(with an optional reference ``completion``), ``{"messages": [...]}`` (answered up
to its last user message; the assistant message after it, if any, is the
reference), or ``{"text": ...}``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

from .jsonl import read_jsonl


class PromptFileError(ValueError):
    """A prompt file or row that cannot be read; the message names file and line."""


@dataclass
class PromptRow:
    """One prompt: the conversation to answer, whether it came as a plain prompt
    (prompt/completion or text), and the reference reply if the row has one."""

    messages: List[Dict[str, str]]
    as_prompt: bool
    reference: Optional[str] = None


def parse_prompt_row(record, where: str) -> PromptRow:
    if not isinstance(record, dict):
        raise PromptFileError(f"{where}: each line must be a JSON object")
    for key in ("prompt", "text"):
        if isinstance(record.get(key), str):
            ref = record.get("completion") if key == "prompt" else None
            return PromptRow([{"role": "user", "content": record[key]}], True, ref if isinstance(ref, str) else None)
    msgs = record.get("messages")
    if isinstance(msgs, list) and msgs:
        if not all(isinstance(m, dict) and isinstance(m.get("content"), str) for m in msgs):
            raise PromptFileError(f'{where}: "messages" must be a list of {{"role", "content"}} objects')
        last_user = max((i for i, m in enumerate(msgs) if m.get("role") == "user"), default=-1)
        if last_user < 0:
            raise PromptFileError(f"{where}: no user message to answer")
        after = msgs[last_user + 1 : last_user + 2]
        ref = after[0]["content"] if after and after[0].get("role") == "assistant" else None
        return PromptRow([dict(m) for m in msgs[: last_user + 1]], False, ref)
    raise PromptFileError(f'{where}: expected "prompt", "messages" or "text"')


def read_prompt_rows(path: Path, limit: Optional[int] = None) -> List[PromptRow]:
    """The rows of a JSONL prompt file (the first ``limit`` when given)."""
    path = Path(path)
    if not path.is_file():
        raise PromptFileError(f"{path}: no such prompts file")
    rows: List[PromptRow] = []
    for i, value in read_jsonl(path, PromptFileError):
        rows.append(parse_prompt_row(value, f"{path}:{i}"))
        if limit is not None and len(rows) >= limit:
            break
    return rows
