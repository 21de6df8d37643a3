"""JSON Lines files a user hands us (training data, prompts, prepared test splits), read so
that every bad line is one error naming ``file:line``.

Only "\\n" ends a line: ``str.splitlines`` (and universal newlines) would also split at
U+2028, U+0085 or a form feed, which JSON written with ``ensure_ascii=False`` keeps raw
inside strings (ShareGPT has them). Bytes that are not UTF-8, and JSON escapes that spell
a lone surrogate ("\\ud800"), are refused where they are: no tokenizer takes either (the
Rust one fails with a type error, mid-run).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Tuple

from .limits import not_text


def not_text_within(value: Any) -> Optional[str]:
    """:func:`~.limits.not_text` of the first string of a parsed JSON value (keys included)
    that is not text, or None."""
    if isinstance(value, str):
        return not_text(value, from_bytes=False)  # the line was UTF-8: only an escape is left
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        why = not_text_within(key) if isinstance(key, str) else None
        why = why or not_text_within(item)
        if why:
            return why
    return None


def read_jsonl(path: Path, error: Callable[[str], Exception] = ValueError) -> Iterator[Tuple[int, Any]]:
    """(line number, parsed value) of every non-blank line of ``path``, streamed; a line that
    is not UTF-8, not JSON or holds a string that is not text raises ``error("path:line:
    why")``."""
    with open(path, encoding="utf-8", errors="surrogateescape", newline="\n") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            why = not_text(line)
            if not why:
                try:
                    value = json.loads(line)
                    why = not_text_within(value)
                except ValueError as e:  # ValueError: also an integer of 4,300+ digits
                    raise error(f"{path}:{n}: invalid JSON ({getattr(e, 'msg', e)})") from None
                except RecursionError:  # "[[[[…": no record is nested that deep
                    raise error(f"{path}:{n}: invalid JSON (nested too deeply)") from None
            if why:
                raise error(f"{path}:{n}: {why}")
            yield n, value
