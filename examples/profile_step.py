"""Where a plain decoding step's time goes, on a real model.

    env $(.venv/bin/python -m specstream_mlx.blas_env) \
        .venv/bin/python examples/profile_step.py [--model smollm2] [--rounds 3]

Times, on the same loaded weights (float32 on the CPU backend): one plain decoding
step at a 128-token context; the same step's matrix products alone (every projection
and the LM head at one row, one graph); and the LM head by itself at 1, 2, 4 and 8
rows (what verifying more rows costs). Medians of 15 repetitions per round.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def _median_ms(f, n: int = 15) -> float:
    f()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()

    import mlx.core as mx
    import mlx.nn as nn

    from specstream_mlx import load
    from specstream_mlx.runtime.cache import make_cache

    model, _ = load(args.model, warn=False)
    base = model.base
    cache = make_cache(base)
    base(mx.array([[1] * 128]), cache=cache)
    mx.eval([c.keys for c in cache])
    weights = [m.weight for _, m in base.named_modules() if isinstance(m, nn.Linear)]
    head = base.lm_head.weight if getattr(base, "lm_head", None) is not None else base.model.embed_tokens.weight

    def step():
        mx.eval(base(mx.array([[5]]), cache=cache))
        for c in cache:  # stay at the same position
            c.offset -= 1

    def products():
        outs = [mx.random.normal((1, w.shape[1])) @ w.T for w in weights]
        outs.append(mx.random.normal((1, head.shape[1])) @ head.T)
        mx.eval(outs)

    def head_rows(r):
        x = mx.random.normal((r, head.shape[1]))
        mx.eval(x)
        return lambda: mx.eval(x @ head.T)

    rounds = []
    for _ in range(args.rounds):
        r = {"step_ms": _median_ms(step), "products_ms": _median_ms(products)}
        r["lm_head_ms_by_rows"] = {rows: _median_ms(head_rows(rows)) for rows in (1, 2, 4, 8)}
        rounds.append(r)
        heads = " / ".join(f"{v:.1f}" for v in r["lm_head_ms_by_rows"].values())
        print(
            f"plain step {r['step_ms']:.1f} ms; its matrix products alone {r['products_ms']:.1f} ms "
            f"({r['products_ms'] / r['step_ms']:.0%}); LM head at 1/2/4/8 rows {heads} ms"
        )
    print(json.dumps({"model": args.model, "rounds": rounds}))


if __name__ == "__main__":
    main()
