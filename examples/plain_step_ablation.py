"""What compiling the plain step is worth, in one process (same BLAS).

    env $(.venv/bin/python -m specstream_mlx.blas_env) .venv/bin/python examples/plain_step_ablation.py

SmolLM2 (float32 on the CPU backend) decodes greedy tokens after a 128-token context
(``--context``), op by op, as the compiled step (:mod:`specstream_mlx.runtime.plain_step`),
and as the compiled step attending over the KV buffer's whole capacity instead of the
written span rounded up to 64 rows, in interleaved rounds; the median ms per token of
each (pipelined as ``ar_steps`` runs, after a warm-up) is printed and written as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def per_token_ms(model, step, tokens: int, context: int) -> float:
    import mlx.core as mx

    from specstream_mlx.runtime.cache import make_cache
    from specstream_mlx.runtime.steps import prefill

    cache = make_cache(model)
    prefill(model, mx.array([1] + list(range(100, 99 + context))), cache)

    def forward(tok):
        return mx.argmax(step(tok, cache), axis=-1)

    y = forward(mx.array([5]))
    mx.async_eval(y)
    times, t = [], None
    for _ in range(tokens):
        nxt = forward(y)
        mx.async_eval(nxt)
        y.item()
        now = time.perf_counter()
        if t is not None:
            times.append(now - t)
        t, y = now, nxt
    return statistics.median(times) * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()

    from specstream_mlx.io.loading import load_model_dir
    from specstream_mlx.platform_info import runtime_info
    from specstream_mlx.runtime import plain_step
    from specstream_mlx.runtime.plain_step import PlainStep

    model = load_model_dir(a.model, warn=False).model

    def eager(tok, cache):
        return model(tok.reshape(1, 1), cache=cache)[:, -1, :]

    whole = PlainStep(model)

    def whole_capacity(tok, cache):
        span, plain_step.attention_span = plain_step.attention_span, lambda end, capacity: capacity
        try:
            return whole(tok, cache)
        finally:
            plain_step.attention_span = span

    variants = {
        "op by op": (model, eager),
        "compiled step": (model, PlainStep(model)),
        "compiled step, whole capacity": (model, whole_capacity),
    }
    runs = {k: [] for k in variants}
    for r in range(a.rounds):
        order = list(variants.items())
        order = order[r % len(order) :] + order[: r % len(order)]
        for name, (m, step) in order:
            runs[name].append(per_token_ms(m, step, a.tokens, a.context))
    info = runtime_info()
    out = {
        "model": a.model,
        "context": a.context,
        "blas": f"{info['blas']} {info['blas_version']}, {info['blas_threads']} threads"
        + (f", {info['blas_forwarder']}" if info["blas_forwarder"] else ""),
        "ms_per_token_median": {k: round(statistics.median(v), 2) for k, v in runs.items()},
        "rounds": runs,
    }
    for k, v in out["ms_per_token_median"].items():
        print(f"{k}: {v:.1f} ms per token")
    if a.json:
        open(a.json, "w").write(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
