"""The draft vocabulary: the token ids speculative streams draft from.

A stream row's logits only rank draft candidates; verification decides. The head
over the whole vocabulary (SmolLM2: 49,152 rows, 113 MB in float32) is the largest
product a pass's stream rows make, while the replies the streams learn from use a
fraction of it: the 8,192 most frequent reply tokens of SmolLM2's ShareGPT training
data cover 91% of its held-out reply tokens. Streams that draft from those entries
only keep every output exact (a token outside is still what verification emits when
the target chooses it) and read a sixth of the head (docs/DESIGN.md decision 41).

The ids are counted from the reply tokens of a data directory's ``train.jsonl`` (the
tokens a ``train`` run's loss covers, in any of its record formats), most frequent
first, and stored with the streams (``draft_vocab`` in ``streams.safetensors``, its
size in ``specstream.json``; docs/FORMAT.md).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from ..method.streams import CONFIG_FILE, DRAFT_VOCAB_KEY, WEIGHTS_FILE
from .data import read_records

# The size `specstream-mlx draft-vocab` takes by default: on SmolLM2's ShareGPT streams a
# greedy dynamic:8@1 decoding of 16 bench prompts accepted the same tokens with 8,192 and
# 16,384 entries as with all 49,152 (τ 1.618 each; 4,096: 1.615), and a 9-node pass with
# streams at 2 hosts took 0.964x the time of one over the whole vocabulary.
DEFAULT_SIZE = 8192


@dataclass
class DraftVocabReport:
    """What ``draft-vocab`` chose and how much of the data it covers."""

    size: int
    counted_tokens: int
    distinct_tokens: int
    train_coverage: float
    valid_coverage: Optional[float] = None

    def to_json(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if v is not None}


def count_reply_tokens(
    path: Path, tokenizer, vocab_size: int, progress: Optional[Callable[[int], None]] = None
) -> np.ndarray:
    """(vocab_size,) counts of the reply tokens (from each record's completion start) of a
    JSONL split; a malformed line stops with ``file:line: reason``."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for lineno, ex in read_records(path, tokenizer, vocab_size):
        reply = np.asarray(ex.tokens[ex.completion_start :], dtype=np.int64)
        counts += np.bincount(reply, minlength=vocab_size)
        if progress and lineno % 500 == 0:
            progress(lineno)
    return counts


def most_frequent(counts: np.ndarray, size: int) -> np.ndarray:
    """The ``size`` most frequent token ids (ties by id), only tokens that occur at all."""
    order = np.argsort(-counts, kind="stable")
    return order[: min(size, int((counts > 0).sum()))].astype(np.int32)


def coverage(counts: np.ndarray, ids: np.ndarray) -> float:
    """Share of the counted tokens that are among ``ids``."""
    total = counts.sum()
    return float(counts[ids].sum() / total) if total else 0.0


def write_draft_vocab(streams_dir: Path, ids: Optional[np.ndarray]) -> None:
    """Store ``ids`` in ``streams_dir``'s streams files (None: remove them, drafting from
    the whole vocabulary): the weights file gets the ``draft_vocab`` tensor (every other
    tensor kept as stored), ``specstream.json`` its size. Both are written beside the old
    ones first and then replace them."""
    import mlx.core as mx

    weights_path, cfg_path = streams_dir / WEIGHTS_FILE, streams_dir / CONFIG_FILE
    weights, metadata = mx.load(str(weights_path), return_metadata=True)
    weights.pop(DRAFT_VOCAB_KEY, None)
    if ids is not None:
        weights[DRAFT_VOCAB_KEY] = mx.array(np.asarray(ids, dtype=np.int32))
    cfg = json.loads(cfg_path.read_text())
    cfg["draft_vocab"] = 0 if ids is None else int(len(ids))
    tmp_weights = weights_path.with_name(f".{WEIGHTS_FILE}.tmp-{os.getpid()}.safetensors")
    tmp_cfg = cfg_path.with_name(f".{CONFIG_FILE}.tmp-{os.getpid()}")
    try:
        mx.save_safetensors(str(tmp_weights), weights, metadata=metadata)
        tmp_cfg.write_text(json.dumps(cfg, indent=2) + "\n")
        os.replace(tmp_weights, weights_path)
        os.replace(tmp_cfg, cfg_path)
    finally:
        for t in (tmp_weights, tmp_cfg):
            t.unlink(missing_ok=True)
