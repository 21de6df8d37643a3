"""Tree-pass and plain-step costs inside real generations, against `--tree auto`'s table.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        .venv/bin/python examples/loop_costs.py demo-chat [--threads 2] [--budgets 4,8] [--rounds 3]

`--tree auto` starts from an offline table: one bare pass of a b-node tree over one bare
pipelined plain step. A real generation adds work per yielded step (sampling, syncs,
detokenizing, the consumer), which plain decoding pays per token and a tree pass once per
τ tokens. This script measures both ways, interleaved per round:

* in the loop: `stream_generate` over the model's 16 bench prompts (64 tokens), wall
  seconds per plain token (`ar`) and per pass of a fixed `dynamic:b` tree (no pruning);
* the table: what `--tree auto` times (`_plain_step_seconds`, `_pass_fn`).

It prints, per round, milliseconds and the cost ratio (pass ÷ plain) both ways, and the
speedup τ·plain/pass the loop figures imply.
"""

import argparse

import mlx.core as mx

from specstream_mlx import load
from specstream_mlx.bench import decode_prompts, load_bench_prompts
from specstream_mlx.io.loading import resolve_model_path
from specstream_mlx.platform_info import blas_in_use, set_blas_threads
from specstream_mlx.runtime import autotune
from specstream_mlx.runtime.cache import make_cache
from specstream_mlx.runtime.compiled_pass import SSPass
from specstream_mlx.runtime.generation import encode_prompt


def in_loop(model, tok, ids, mode, tree=None):
    """(wall seconds per step after the first, tokens per step) over all prompts, no pruning."""
    t = decode_prompts(model, tok, ids, mode, tree, pruning_threshold=0.0)
    return t.seconds_per_step, t.tokens_per_step


def table(model, budgets, context=128, reps=7):
    """Seconds of a bare plain step and of bare passes, as --tree auto times them."""
    base, streams = model.base, model.streams
    cache = make_cache(base)
    base(mx.array([[1] * context]), cache=cache)
    mx.eval([c.keys for c in cache])
    out = {0: autotune._plain_step_seconds(base, cache, context, reps)}
    forward = SSPass(base, streams, False)
    for b in budgets:
        out[b] = autotune._timed(autotune._pass_fn(forward, cache, context, b, False, 0), reps)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--threads", type=int, default=None, help="BLAS threads (default: the BLAS's own)")
    ap.add_argument("--budgets", default="4,8")
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    if a.threads:
        set_blas_threads(a.threads)
    budgets = [int(b) for b in a.budgets.split(",")]
    model, tok = load(a.model, warn=False)
    ids = [encode_prompt(tok, r["prompt"]) for r in load_bench_prompts(resolve_model_path(a.model), 16)]
    print(f"{a.model}; BLAS {blas_in_use()}, threads {a.threads or 'default'}")
    in_loop(model, tok, ids, "ar")  # warm-up
    for b in budgets:
        in_loop(model, tok, ids, "ss", f"dynamic:{b}")
    for rnd in range(a.rounds):
        plain, _ = in_loop(model, tok, ids, "ar")
        parts = [f"round {rnd}: loop plain {plain * 1e3:.2f} ms/token"]
        for b in budgets:
            sec, tau = in_loop(model, tok, ids, "ss", f"dynamic:{b}")
            parts.append(f"b{b} {sec * 1e3:.2f} ms/pass = {sec / plain:.2f} (τ {tau:.2f}, {tau * plain / sec:.2f}×)")
        t = table(model, budgets)
        parts.append(
            f"table plain {t[0] * 1e3:.2f} ms, "
            + ", ".join(f"b{b} {t[b] * 1e3:.2f} ms = {t[b] / t[0]:.2f}" for b in budgets)
        )
        print(" | ".join(parts), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
