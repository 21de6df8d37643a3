"""Training data: mlx-lm's JSONL formats, tokenized with loss masks.

A data directory holds ``train.jsonl`` and ``valid.jsonl`` (``test.jsonl``
optional); each line is one of::

    {"text": "..."}                               loss on every token
    {"prompt": "...", "completion": "..."}        loss on the completion only
    {"messages": [{"role": ..., "content": ...}]} loss on the last message only

The chat template is applied to ``prompt``/``completion`` and ``messages``
when the tokenizer has one. Completions end with EOS.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, List, Optional, Sequence, Tuple

import numpy as np

from ..io.jsonl import read_jsonl
from ..io.limits import outside_vocabulary


class DataError(ValueError):
    pass


@dataclass
class Example:
    tokens: List[int]
    # Index of the first token whose prediction is trained (everything before is prompt).
    completion_start: int


@dataclass
class Dataset:
    examples: List[Example]
    truncated: int = 0
    name: str = ""

    def __len__(self) -> int:
        return len(self.examples)

    @property
    def num_tokens(self) -> int:
        return sum(len(e.tokens) for e in self.examples)


def _encode_chat(tokenizer, messages, add_generation_prompt):
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    return list(tokenizer.encode(text, add_special_tokens=False))


def encode_record(record: dict, tokenizer) -> Example:
    """Tokens and loss start of one JSON record; raises DataError on a bad record."""
    if not isinstance(record, dict):
        raise DataError("each line must be a JSON object")
    eos = tokenizer.eos_token_id
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if "messages" in record:
        msgs = record["messages"]
        if (
            not isinstance(msgs, list)
            or not msgs
            or not all(
                isinstance(m, dict) and isinstance(m.get("content"), str) and isinstance(m.get("role"), str)
                for m in msgs
            )
        ):
            raise DataError('"messages" must be a non-empty list of {"role", "content"} objects')
        if has_template:
            prefix = _encode_chat(tokenizer, msgs[:-1], True) if len(msgs) > 1 else []
            full = _encode_chat(tokenizer, msgs, False)
            if full[: len(prefix)] != prefix:
                prefix = []
        else:
            prefix = list(tokenizer.encode("\n".join(m["content"] for m in msgs[:-1])))
            full = prefix + list(tokenizer.encode(msgs[-1]["content"], add_special_tokens=False))
        if eos is not None and (not full or full[-1] != eos):
            full.append(eos)
        return Example(full, max(len(prefix), 1))
    if "prompt" in record or "completion" in record:
        p, c = record.get("prompt"), record.get("completion")
        if not isinstance(p, str) or not isinstance(c, str):
            raise DataError('"prompt" and "completion" must both be strings')
        if has_template:
            prompt = _encode_chat(tokenizer, [{"role": "user", "content": p}], True)
        else:
            prompt = list(tokenizer.encode(p))
        comp = list(tokenizer.encode(c, add_special_tokens=False))
        if eos is not None:
            comp.append(eos)
        return Example(prompt + comp, max(len(prompt), 1))
    if "text" in record:
        if not isinstance(record["text"], str):
            raise DataError('"text" must be a string')
        toks = list(tokenizer.encode(record["text"]))
        if eos is not None:
            toks.append(eos)
        return Example(toks, 1)
    raise DataError('unknown record format: expected "text", "prompt"/"completion" or "messages"')


def truncate(ex: Example, max_len: int) -> Example:
    """``ex`` cut to ``max_len`` tokens, keeping what is trained: the oldest prompt
    tokens go first (a long conversation keeps its end and the whole reply); a reply
    longer than ``max_len`` keeps its beginning, after one token of prompt."""
    n = len(ex.tokens)
    if n <= max_len:
        return ex
    if n - ex.completion_start + 1 <= max_len:
        cut = n - max_len
        return Example(ex.tokens[cut:], max(ex.completion_start - cut, 1))
    s = max(ex.completion_start - 1, 0)
    return Example(ex.tokens[s : s + max_len], 1)


def read_records(path: Path, tokenizer, vocab_size: Optional[int] = None) -> Iterator[Tuple[int, Example]]:
    """(line number, example) of every record of a JSONL split; a malformed line stops
    with ``file:line: reason``, and so does a token id outside ``vocab_size`` (the
    embedding lookup does not check its indices: a tokenizer that is not the model's would
    train on whatever memory follows the table)."""
    for lineno, record in read_jsonl(path, DataError):
        try:
            ex = encode_record(record, tokenizer)
            why = None if vocab_size is None else outside_vocabulary(ex.tokens, vocab_size)
            if why:
                raise DataError(why)
        except DataError as e:
            raise DataError(f"{path}:{lineno}: {e}") from None
        yield lineno, ex


def load_split(path: Path, tokenizer, max_seq_len: int, vocab_size: Optional[int] = None) -> Dataset:
    """Read one JSONL split; a malformed line stops with ``file:line: reason``."""
    examples, truncated = [], 0
    for _, ex in read_records(path, tokenizer, vocab_size):
        if len(ex.tokens) < 2:
            continue
        if len(ex.tokens) > max_seq_len:
            truncated += 1
            ex = truncate(ex, max_seq_len)
        examples.append(ex)
    return Dataset(examples, truncated, path.name)


def load_dataset(data_dir: Path, tokenizer, max_seq_len: int, vocab_size: Optional[int] = None):
    """(train, valid or None, test or None) from a data directory; ``vocab_size``: the model's,
    which every token id must be inside."""
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise DataError(f"{data_dir}: no such data directory")
    train_path = data_dir / "train.jsonl"
    if not train_path.exists():
        raise DataError(f"{train_path}: missing (a data directory needs train.jsonl and valid.jsonl)")
    train = load_split(train_path, tokenizer, max_seq_len, vocab_size)
    if not len(train):
        raise DataError(f"{train_path}: no usable examples")
    splits = []
    for name in ("valid", "test"):
        p = data_dir / f"{name}.jsonl"
        splits.append(load_split(p, tokenizer, max_seq_len, vocab_size) if p.exists() else None)
    return train, splits[0], splits[1]


@dataclass
class Batch:
    """Padded token ids and, per sequence, the positions that host streams.

    Attributes:
        tokens: (B, L) int32, right-padded.
        lengths: (B,) true lengths.
        loss_mask: (B, L) 1.0 where predicting the next token is trained
            (position t predicts token t+1).
        stream_pos: (B, S) positions hosting streams (completion positions only).
        stream_weight: (B, S) 1.0 for real stream positions, 0.0 for padding.
        index: (B,) each sequence's index in its dataset (what a feature cache is keyed
            by), or None for a batch built from loose examples.
    """

    tokens: np.ndarray
    lengths: np.ndarray
    loss_mask: np.ndarray
    stream_pos: np.ndarray
    stream_weight: np.ndarray
    index: Optional[np.ndarray] = None


def make_batch(
    examples: Sequence[Example],
    seq_len: int,
    stream_positions: int,
    rng: Optional[np.random.Generator],
    index: Optional[np.ndarray] = None,
) -> Batch:
    B = len(examples)
    toks = np.zeros((B, seq_len), dtype=np.int32)
    lengths = np.zeros(B, dtype=np.int32)
    mask = np.zeros((B, seq_len), dtype=np.float32)
    spos = np.zeros((B, stream_positions), dtype=np.int32)
    sw = np.zeros((B, stream_positions), dtype=np.float32)
    for b, ex in enumerate(examples):
        n = min(len(ex.tokens), seq_len)
        toks[b, :n] = ex.tokens[:n]
        lengths[b] = n
        start = max(ex.completion_start - 1, 0)  # position start-1 predicts the first completion token
        mask[b, start : n - 1] = 1.0
        # Prompt positions get no streams: candidates are completion positions only.
        cands = np.arange(start, n - 1)
        if len(cands) > stream_positions:
            if rng is not None:
                cands = np.sort(rng.choice(cands, stream_positions, replace=False))
            else:
                # Deterministic (validation): evenly spread over the whole completion, so
                # late positions count as much as early ones.
                cands = cands[np.linspace(0, len(cands) - 1, stream_positions).round().astype(int)]
        spos[b, : len(cands)] = cands
        sw[b, : len(cands)] = 1.0
    return Batch(toks, lengths, mask, spos, sw, None if index is None else np.asarray(index))


BUCKET_CHUNK = 64  # batches per length-sorted chunk


def _width(examples: Sequence[Example], cap: int, multiple: int = 16) -> int:
    """Padded length of a batch: its longest sequence rounded up (few distinct shapes), at most ``cap``."""
    longest = max(len(e.tokens) for e in examples)
    return min(cap, -(-longest // multiple) * multiple)


def iterate_batches(
    ds: Dataset, batch_size: int, seq_len: int, stream_positions: int, seed: int, epoch: int, bucket: bool = True
) -> Iterator[Batch]:
    """One shuffled pass; the last partial batch is filled with repeats.

    With ``bucket`` (default), batches are formed from length-sorted chunks of the
    shuffled order and padded to their own longest sequence (``seq_len`` caps it),
    instead of every batch padded to the dataset's longest: far less padding on
    real data. Batch order stays shuffled and deterministic for (seed, epoch)."""
    rng = np.random.default_rng((seed, epoch))
    order = rng.permutation(len(ds))
    batches = []
    for i in range(0, len(order), batch_size):
        idx = order[i : i + batch_size]
        if len(idx) < batch_size:
            idx = np.concatenate([idx, order[: batch_size - len(idx)]])
        batches.append(idx)
    if bucket:
        flat = np.concatenate(batches) if batches else order
        chunk = batch_size * BUCKET_CHUNK
        parts = []
        for c in range(0, len(flat), chunk):
            part = flat[c : c + chunk]
            # Sort by padded width only (a stable sort of the shuffled order): examples of
            # the same width stay shuffled, so a batch is not a run of near-duplicates.
            width_class = [-(-len(ds.examples[j].tokens) // 16) for j in part]
            parts.append(part[np.argsort(width_class, kind="stable")])
        flat = np.concatenate(parts) if parts else flat
        batches = [flat[i : i + batch_size] for i in range(0, len(flat), batch_size)]
        batches = [batches[k] for k in rng.permutation(len(batches))]
    for idx in batches:
        exs = [ds.examples[j] for j in idx]
        width = _width(exs, seq_len) if bucket else seq_len
        yield make_batch(exs, width, stream_positions, rng, idx)
