"""Seeded synthetic data for tests and quick experiments.

``phrase_corpus``: a fixed set of key -> phrase pairs; each example asks for
the phrase of a key. Continuations are fully predictable once learned, so a
short training run must raise stream accuracy and tokens per pass clearly.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

WORDS = ("alpha beta gamma delta omega red green blue cyan stone river cloud north south "
         "east west quick slow bright dark lemon pepper tiger eagle").split()


def phrase_table(n_keys: int, words_per_phrase: int, seed: int):
    rng = np.random.default_rng(seed)
    return {f"k{i:02d}": " ".join(rng.choice(WORDS, words_per_phrase)) for i in range(n_keys)}


def write_phrase_corpus(out_dir: Path, n_keys: int = 12, words_per_phrase: int = 6,
                        n_train: int = 400, n_valid: int = 48, seed: int = 0) -> dict:
    """train/valid/test.jsonl of {"prompt": key, "completion": phrase}; returns the table."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    table = phrase_table(n_keys, words_per_phrase, seed)
    keys = sorted(table)
    rng = np.random.default_rng(seed + 1)
    for name, n in (("train", n_train), ("valid", n_valid), ("test", n_valid)):
        with open(out_dir / f"{name}.jsonl", "w") as f:
            for k in rng.choice(keys, n):
                f.write(json.dumps({"prompt": str(k), "completion": table[str(k)]}) + "\n")
    return table
