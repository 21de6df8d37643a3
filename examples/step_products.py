"""One decoding step's matrix products on a real model, by weight shape and row count.

    env $(.venv/bin/python -m specstream_mlx.blas_env) \\
        .venv/bin/python examples/step_products.py [MODEL] [ROWS ...]

Loads MODEL (default ``smollm2``) as decoding does and, at each row count (default 1, 2, 3,
5 and 9: a plain step and tree passes' main rows), times every product one step runs with
the model's own weights (read as stored where the product kernel reads them so), grouped by
weight shape, medians of 9 repetitions, and against the time their multiply-adds take at this
machine's float32 product rate (a large square product's: their compute floor, which for one
row usually lies below its bytes'). ``SPECSTREAM_SKINNY_FUSED_ROWS=1`` in the environment
expands the stored values of products of two rows or more into a buffer for the float32
tiles instead of in registers; ``SPECSTREAM_STORED=0`` reads the float32 weights.
"""

from __future__ import annotations

import collections
import sys

import mlx.core as mx

from specstream_mlx import load
from specstream_mlx.bench.machine import gemm_rate, median_ms, product_weights, step_multiply_adds
from specstream_mlx.platform_info import blas_words


def main() -> int:
    args = sys.argv[1:]
    name = args.pop(0) if args and not args[0].isdigit() else "smollm2"
    try:
        rows = [int(r) for r in args] or [1, 2, 3, 5, 9]
    except ValueError:
        rows = []
    if not rows or not all(1 <= r <= 48 for r in rows):
        print(f"rows: whole numbers from 1 to 48, got {' '.join(args)!r}", file=sys.stderr)
        return 2
    sm, _ = load(name, warn=False)
    groups = collections.defaultdict(list)
    for w in product_weights(sm.base):
        groups[tuple(w.shape)].append(w)
    macs, rate = step_multiply_adds(sm.base), gemm_rate()
    print(f"{name}; {blas_words()}")
    print(f"{macs / 1e6:.0f} M multiply-adds a row; this machine's float32 product rate {rate / 1e9:.0f} G/s")
    for m in rows:
        parts, total = [], 0.0
        for (n, k), ws in groups.items():
            x = mx.random.normal((m, k))
            mx.eval(x)
            ms = median_ms(lambda x=x, ws=ws: mx.eval([x @ w.T for w in ws]), 9)
            total += ms
            parts.append(f"{n}x{k} x{len(ws)} {ms:.2f}")
        times_rate = total / (m * macs / rate * 1e3)
        print(f"{m} row(s): {total:.2f} ms = {times_rate:.2f}x their multiply-adds at that rate ({', '.join(parts)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
