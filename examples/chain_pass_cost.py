"""A verifying pass of b chained rows against a plain step, on a real model: what a peer's
batch of b tokens does (``examples/llama_cpp_peer.sh`` runs this beside llama.cpp's).

    env $(.venv/bin/python -m specstream_mlx.blas_env) \\
        .venv/bin/python examples/chain_pass_cost.py [--model smollm2] [--rows 2,5,9,17] [--json OUT]

After a ``--context``-token prompt: the plain step (the compiled graph ``ar`` decodes with,
pipelined as ``ar`` runs it: ms per token), and ``ss_forward`` over a chain of b tokens
without streams (every row cached and through the LM head, as a verifying pass computes
it), rolled back after each pass. Medians of ``--reps`` per round, the kinds alternating
round by round in one process; prints ms and plain steps a pass.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import mlx.core as mx
import numpy as np


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--rows", default="2,5,9,17", help="comma-separated row counts of the chains")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--json", default=None, help="also write the figures here")
    args = ap.parse_args()
    rows = [r.strip() for r in args.rows.split(",")]
    if not all(r.isdigit() and 1 <= int(r) <= 192 for r in rows):
        raise SystemExit(f"chain_pass_cost.py: --rows {args.rows!r}: expected row counts from 1 to 192")
    rows = [int(r) for r in rows]
    for name in ("context", "rounds", "reps"):
        if getattr(args, name) < 1:
            raise SystemExit(f"chain_pass_cost.py: --{name} {getattr(args, name)}: expected a positive count")

    from specstream_mlx import load
    from specstream_mlx.bench.machine import median_ms
    from specstream_mlx.method.msa import ss_forward
    from specstream_mlx.method.tree import Tree
    from specstream_mlx.platform_info import blas_in_use
    from specstream_mlx.runtime.cache import make_cache
    from specstream_mlx.runtime.sampling import SamplingParams
    from specstream_mlx.runtime.steps import ar_steps, prefill

    sm, _ = load(args.model, warn=False)
    if sm.streams is None:
        raise SystemExit(f"chain_pass_cost.py: {args.model}: no streams to run a verifying pass with")
    base, streams = sm.base, sm.streams
    prompt = mx.array([100 + i % 1000 for i in range(args.context)])
    cache = make_cache(sm)
    prefill(base, prompt, cache, 512)
    offset = cache[0].offset
    no_hosts = np.zeros(0, dtype=np.int64)

    def chain_pass(b: int):
        tree = Tree.chain(list(range(300, 300 + b)))

        def run():
            out = ss_forward(base, streams, tree, offset, cache, 0.0, None, no_hosts)
            mx.eval(out.main_logits)
            for c in cache:  # roll back: every repetition sees the same prefix
                c.commit([0])
                c.offset = offset

        return run

    steps = ar_steps(base, prompt, SamplingParams(), cache=make_cache(sm))
    kinds = {"step": lambda: next(steps), **{f"{b} rows": chain_pass(b) for b in rows}}
    times = {k: [] for k in kinds}
    for r in range(args.rounds):
        order = list(kinds) if r % 2 == 0 else list(reversed(kinds))
        for k in order:
            times[k].append(median_ms(kinds[k], args.reps))
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"{args.model}; {args.context}-token context; BLAS {blas_in_use()}")
    print(f"plain step {med['step']:.2f} ms")
    for b in rows:
        k = f"{b} rows"
        print(f"pass of {b:2d} chained rows {med[k]:6.2f} ms = {med[k] / med['step']:.2f} plain steps")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "model": args.model,
                    "context": args.context,
                    "blas": blas_in_use(),
                    "step_ms": med["step"],
                    "pass_ms": {b: med[f"{b} rows"] for b in rows},
                    "rounds": times,
                },
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
