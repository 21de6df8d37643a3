"""The skinny kernel's settings at several row counts, in alternating fresh processes.

    .venv/bin/python examples/skinny_rows_ab.py [--model smollm2] [--rows 1,2,4,9,13,24]
        [--settings "default;SPECSTREAM_SKINNY_PREFETCH=nta;SPECSTREAM_SKINNY_PREFETCH=t0"] [--rounds 5]

A plain step is one row; a tree pass's layers take its nodes' rows (9 for ``dynamic:8``)
and more where streams are hosted. The kernel reads its settings once, at its start, so
each setting runs in a process of its own: the CLI's preloads (``blas_env``) plus the
setting's ``VAR=value`` words (``default``: none), timing every matrix product of one step
of ``--model`` (its shapes, distinct random weights, out of cache) at each row count,
median of 15 repetitions. Settings alternate round by round; printed are the median ms per
setting and row count and the median per-round ratio to the first setting.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CHILD = r"""
import json, sys
import specstream_mlx  # noqa: F401  (first: the BLAS before mlx.core)
from specstream_mlx import load
from specstream_mlx.bench.machine import product_shapes, time_products
from specstream_mlx.platform_info import blas_words
m, _ = load(sys.argv[1], warn=False)
rows = [int(r) for r in sys.argv[2].split(",")]
shapes = product_shapes(m.base)
del m
print(json.dumps({"ms": time_products(shapes, rows, 15), "blas": blas_words()}))
"""


def run_child(env_words: list, model: str, rows: str, setting: str) -> dict:
    words = [] if setting == "default" else setting.split()
    out = subprocess.run(
        ["env", *env_words, *words, sys.executable, "-c", CHILD, model, rows],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    if out.returncode != 0:
        raise SystemExit(f"skinny_rows_ab.py: setting {setting!r} failed: {out.stderr.strip().splitlines()[-1:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--rows", default="1,2,4,9,13,24")
    ap.add_argument(
        "--settings",
        default="default;SPECSTREAM_SKINNY_PREFETCH=nta;SPECSTREAM_SKINNY_PREFETCH=t0;SPECSTREAM_SKINNY_PREFETCH=t1",
        help="';'-separated settings, each 'default' or VAR=value words; the first is the reference",
    )
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    settings = [s.strip() for s in args.settings.split(";") if s.strip()]
    for s in settings:
        if s != "default" and not all("=" in w for w in s.split()):
            raise SystemExit(f"skinny_rows_ab.py: setting {s!r}: expected 'default' or VAR=value words")
    rows = [r.strip() for r in args.rows.split(",")]
    if not all(r.isdigit() and 1 <= int(r) <= 192 for r in rows):
        raise SystemExit(f"skinny_rows_ab.py: --rows {args.rows!r}: expected row counts from 1 to 192")
    # The CLI's preloads, once: each child adds its setting's words after them.
    env_words = subprocess.run(
        [sys.executable, "-m", "specstream_mlx.blas_env"], capture_output=True, text=True, check=True
    ).stdout.split()
    ms = {s: {r: [] for r in rows} for s in settings}
    header = ""
    for i in range(args.rounds):
        for s in settings:
            res = run_child(env_words, args.model, ",".join(rows), s)
            header = header or res["blas"]
            for r in rows:
                ms[s][r].append(res["ms"][r])
        last = (f"{s}: " + " ".join(f"{ms[s][r][-1]:.1f}" for r in rows) for s in settings)
        print(f"round {i + 1}: " + "  ".join(last))
    ref = settings[0]
    print(f"\n{args.model}, every product of one step, ms (median of {args.rounds} rounds); BLAS {header}")
    print("| setting | " + " | ".join(f"{r} rows" for r in rows) + " |")
    print("| --- |" + " --- |" * len(rows))
    for s in settings:
        cells = []
        for r in rows:
            ratio = statistics.median(a / b for a, b in zip(ms[s][r], ms[ref][r]))
            cells.append(f"{statistics.median(ms[s][r]):.1f} ({ratio:.2f}x)")
        print(f"| {s} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
