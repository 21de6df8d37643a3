"""Seeded synthetic data for tests and quick experiments.

``phrase_corpus``: a fixed set of key -> phrase pairs; each example asks for
the phrase of a key. Continuations are fully predictable once learned, so a
short training run must raise stream accuracy and tokens per pass clearly.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

WORDS = (
    "alpha beta gamma delta omega red green blue cyan stone river cloud north south "
    "east west quick slow bright dark lemon pepper tiger eagle"
).split()


def phrase_table(n_keys: int, words_per_phrase: int, seed: int):
    rng = np.random.default_rng(seed)
    return {f"k{i:02d}": " ".join(rng.choice(WORDS, words_per_phrase)) for i in range(n_keys)}


def write_phrase_corpus(
    out_dir: Path, n_keys: int = 12, words_per_phrase: int = 6, n_train: int = 400, n_valid: int = 48, seed: int = 0
) -> dict:
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


# --- structured queries in the style of sql-create-context --------------------

_TABLES = {
    "employees": [
        ("name", "TEXT"),
        ("department", "TEXT"),
        ("salary", "INTEGER"),
        ("age", "INTEGER"),
        ("city", "TEXT"),
    ],
    "products": [
        ("product_name", "TEXT"),
        ("category", "TEXT"),
        ("price", "INTEGER"),
        ("stock", "INTEGER"),
        ("supplier", "TEXT"),
    ],
    "students": [
        ("student_name", "TEXT"),
        ("major", "TEXT"),
        ("gpa", "REAL"),
        ("year", "INTEGER"),
        ("hometown", "TEXT"),
    ],
    "flights": [
        ("flight_number", "TEXT"),
        ("origin", "TEXT"),
        ("destination", "TEXT"),
        ("distance", "INTEGER"),
        ("price", "INTEGER"),
    ],
    "matches": [
        ("home_team", "TEXT"),
        ("away_team", "TEXT"),
        ("venue", "TEXT"),
        ("attendance", "INTEGER"),
        ("score", "INTEGER"),
    ],
    "books": [
        ("title", "TEXT"),
        ("author", "TEXT"),
        ("genre", "TEXT"),
        ("pages", "INTEGER"),
        ("published_year", "INTEGER"),
    ],
    "stations": [
        ("station_name", "TEXT"),
        ("line", "TEXT"),
        ("district", "TEXT"),
        ("passengers", "INTEGER"),
        ("platforms", "INTEGER"),
    ],
    "elections": [
        ("candidate", "TEXT"),
        ("party", "TEXT"),
        ("district", "TEXT"),
        ("votes", "INTEGER"),
        ("year", "INTEGER"),
    ],
}
_VALUES = {
    "name": ["Alice", "Bob", "Carmen", "Deepak", "Elena", "Farid"],
    "department": ["Sales", "Research", "Finance", "Legal"],
    "city": ["Paris", "Lagos", "Osaka", "Lima", "Oslo"],
    "product_name": ["Lamp", "Chair", "Kettle", "Drill"],
    "category": ["Kitchen", "Garden", "Office", "Tools"],
    "supplier": ["Acme", "Globex", "Initech"],
    "student_name": ["Ana", "Ben", "Chen", "Dara"],
    "major": ["Physics", "History", "Biology", "Music"],
    "hometown": ["Austin", "Boston", "Denver"],
    "flight_number": ["BA117", "LH400", "AF22", "QF1"],
    "origin": ["London", "Frankfurt", "Sydney", "Tokyo"],
    "destination": ["New York", "Paris", "Rome", "Dubai"],
    "home_team": ["Lions", "Tigers", "Bears", "Wolves"],
    "away_team": ["Eagles", "Sharks", "Hawks"],
    "venue": ["Central Park", "Riverside", "Old Stadium"],
    "title": ["Dune", "Emma", "Ulysses", "Beloved"],
    "author": ["Austen", "Herbert", "Joyce", "Morrison"],
    "genre": ["Fiction", "Poetry", "Drama", "Science"],
    "station_name": ["Kings Cross", "Alexanderplatz", "Shibuya"],
    "line": ["Red", "Blue", "Green", "Circle"],
    "district": ["North", "South", "East", "West"],
    "candidate": ["Smith", "Garcia", "Nguyen", "Okafor"],
    "party": ["Labour", "Green", "Liberal", "Unity"],
}
_AGG = [("average", "AVG"), ("maximum", "MAX"), ("minimum", "MIN"), ("total", "SUM")]


def _words(col: str) -> str:
    return col.replace("_", " ")


def sql_example(rng: np.random.Generator) -> dict:
    """One {"question", "context", "answer"} record: a CREATE TABLE, a question, its SQL."""
    table = str(rng.choice(sorted(_TABLES)))
    cols = _TABLES[table]
    k = int(rng.integers(3, len(cols) + 1))
    picked = [cols[i] for i in sorted(rng.choice(len(cols), k, replace=False))]
    text_cols = [c for c, t in picked if t == "TEXT"]
    num_cols = [c for c, t in picked if t != "TEXT"]
    if not text_cols or not num_cols:
        return sql_example(rng)
    context = f"CREATE TABLE {table} (" + ", ".join(f"{c} {t}" for c, t in picked) + ")"
    tc = str(rng.choice(text_cols))
    nc = str(rng.choice(num_cols))
    other = [c for c in text_cols if c != tc]
    val = str(rng.choice(_VALUES[tc]))
    n = int(rng.integers(1, 500))
    kind = int(rng.integers(0, 8))
    tbl = _words(table)
    if kind == 0 and other:
        o = str(rng.choice(other))
        q = f"What is the {_words(o)} of the {tbl} whose {_words(tc)} is {val}?"
        a = f"SELECT {o} FROM {table} WHERE {tc} = '{val}'"
    elif kind == 1:
        q = f"How many {tbl} have a {_words(nc)} greater than {n}?"
        a = f"SELECT COUNT(*) FROM {table} WHERE {nc} > {n}"
    elif kind == 2:
        word, fn = _AGG[int(rng.integers(0, len(_AGG)))]
        q = f"What is the {word} {_words(nc)} of {tbl} with {_words(tc)} {val}?"
        a = f"SELECT {fn}({nc}) FROM {table} WHERE {tc} = '{val}'"
    elif kind == 3:
        q = f"List the {_words(tc)} of all {tbl} ordered by {_words(nc)} in descending order."
        a = f"SELECT {tc} FROM {table} ORDER BY {nc} DESC"
    elif kind == 4:
        lim = int(rng.integers(2, 10))
        q = f"Show the {lim} {tbl} with the lowest {_words(nc)}, giving their {_words(tc)}."
        a = f"SELECT {tc} FROM {table} ORDER BY {nc} ASC LIMIT {lim}"
    elif kind == 5:
        q = f"Which {_words(tc)} has the highest {_words(nc)}?"
        a = f"SELECT {tc} FROM {table} ORDER BY {nc} DESC LIMIT 1"
    elif kind == 6:
        q = f"How many {tbl} are there for each {_words(tc)}?"
        a = f"SELECT {tc}, COUNT(*) FROM {table} GROUP BY {tc}"
    else:
        q = f"List the {_words(tc)} of {tbl} whose {_words(nc)} is less than {n} and {_words(tc)} is not {val}."
        a = f"SELECT {tc} FROM {table} WHERE {nc} < {n} AND {tc} != '{val}'"
    return {"question": q, "context": context, "answer": a}


def sql_prompt(ex: dict) -> str:
    return f"{ex['context']}\n-- {ex['question']}"


def write_sql_corpus(out_dir: Path, n_train: int = 20000, n_valid: int = 200, n_test: int = 200, seed: int = 0) -> dict:
    """train/valid/test.jsonl of {"prompt": schema + question, "completion": SQL}.

    Test examples whose prompt also occurs in train are re-drawn, so the test split
    is held out."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    seen = set()
    counts = {}
    for name, n in (("train", n_train), ("valid", n_valid), ("test", n_test)):
        rows = []
        while len(rows) < n:
            ex = sql_example(rng)
            p = sql_prompt(ex)
            if name != "train" and p in seen:
                continue
            if name == "train":
                seen.add(p)
            rows.append({"prompt": p, "completion": ex["answer"]})
        with open(out_dir / f"{name}.jsonl", "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
        counts[name] = len(rows)
    return counts
