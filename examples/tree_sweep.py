"""Greedy ``ss`` tokens/s and τ per draft tree on a bundled model, against ``ar``.

    env $(.venv/bin/python -m specstream_mlx.blas_env) \\
        .venv/bin/python examples/tree_sweep.py demo-sql dynamic:2,dynamic:4,dynamic:8@1,dynamic:12/prune=0.25,auto [16]

Each item is a tree (``--tree`` syntax), optionally ``/prune=T`` for an early-exit
pruning threshold (default: the model's own) and ``/merge=R`` for the hosted stream rows
up to which a pass computes their logits in the main rows' LM-head product
(``msa.MERGED_STREAM_ROWS``; 0: after the verdict, for the accepted host only; op-by-op
passes, as fixed trees run by default: a compiled pass keeps the setting it was traced
with). Rounds alternate ``ar`` and every item, ``ar`` decoding right before each (3 rounds by
default, ``ROUNDS=N``), and report the median ratio to that ``ar`` run (and the pass's cost in
plain steps, τ ÷ that ratio), so drifts of a shared machine hit every item alike.

Decodes the model's first N held-out bench prompts (default 16, up to 64 tokens,
stopping at EOS) once to warm up and once timed, per tree. tokens/s excludes the
first token (prompt processing); τ = generated tokens / passes after the first.
Run it with ``OPENBLAS_NUM_THREADS=1`` and without to compare BLAS threading, and with
``LAUNCH_EVERY=0`` to build each op-by-op pass whole before it runs (default: its
evaluation is queued every ``msa.LAUNCH_EVERY`` lower layers, docs/DESIGN.md decision 38).
"""

import os
import re
import statistics
import sys

from specstream_mlx import load
from specstream_mlx.bench import decode_prompts, load_bench_prompts
from specstream_mlx.io.loading import resolve_model_path
from specstream_mlx.method import msa
from specstream_mlx.method.tree import TreeSpec
from specstream_mlx.platform_info import blas_in_use
from specstream_mlx.runtime.generation import encode_prompt


def split_items(text: str) -> "list[str]":
    """The items of a comma-separated sweep, split only at the commas that start a tree's
    kind: a tree's own text may hold commas too (``topk:K,DEPTH``, ``dynamic:BUDGET,DEPTH``)."""
    return re.split(r",(?=(?:cartesian|topk|dynamic|chain|auto)\b)", text)


def sweep_rounds(run, items, rounds: int):
    """``rounds`` rounds of ``ar`` and every item, ``ar`` decoding right before each: on a shared
    host the speed drifts within a round, and an item measured minutes after a round's only
    ``ar`` run carried that drift. ``run(mode, tree=None, options=None)`` -> (tokens/s, τ,
    pruned share). Returns (each item's ratios to its ``ar`` run, its τ, its pruned share,
    every ``ar`` rate)."""
    ratios = {s: [] for s, _, _ in items}
    taus, pruned_share, ar_rates = {}, {}, []
    for _ in range(rounds):
        for s, tree, options in items:
            ar, _, _ = run("ar")
            ar_rates.append(ar)
            tps, taus[s], pruned_share[s] = run("ss", tree, options)
            ratios[s].append(tps / ar)
    return ratios, taus, pruned_share, ar_rates


def main() -> int:
    name, specs = sys.argv[1], split_items(sys.argv[2])
    n = int(sys.argv[3]) if len(sys.argv) > 3 else 16
    model, tok = load(name, warn=False)
    rows = load_bench_prompts(resolve_model_path(name), n)
    ids = [encode_prompt(tok, r["prompt"]) for r in rows]

    merged = msa.MERGED_STREAM_ROWS

    def run(mode, tree=None, options=None):
        options = options or {}
        msa.MERGED_STREAM_ROWS = int(options.get("merge", merged))
        prune = options.get("prune")
        t = decode_prompts(model, tok, ids, mode, tree, None if prune is None else float(prune))
        return t.tokens_per_second, t.tokens_per_step, t.pruned_share

    items = []
    for s in specs:
        tree_text, *settings = s.split("/")
        tree = tree_text if tree_text == "auto" else TreeSpec.parse(tree_text)
        options = dict(o.partition("=")[::2] for o in settings)
        unknown = set(options) - {"prune", "merge"}
        if unknown:
            sys.exit(f"tree_sweep: unknown setting {sorted(unknown)[0]!r} in {s!r} (known: prune, merge)")
        items.append((s, tree, options))
    rounds = int(os.environ.get("ROUNDS", "3"))
    msa.LAUNCH_EVERY = int(os.environ.get("LAUNCH_EVERY", msa.LAUNCH_EVERY))
    launch = f"queued every {msa.LAUNCH_EVERY} layers" if msa.LAUNCH_EVERY else "built whole"
    print(
        f"{name}; BLAS {blas_in_use()}; OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS', 'unset')}; "
        f"{len(ids)} prompts x {rounds} rounds; op-by-op passes {launch}"
    )
    run("ar")
    for _, tree, options in items:  # warm-up (and --tree auto's cost measurement)
        run("ss", tree, options)
    ratios, taus, pruned_share, ar_rates = sweep_rounds(run, items, rounds)
    print(f"ar           {statistics.median(ar_rates):7.1f} tok/s (median)")
    for s, _, _ in items:
        ratio = statistics.median(ratios[s])
        print(
            f"{s:24s} {ratio:.2f}x  tau {taus[s]:.2f}  pass {taus[s] / ratio:.2f} plain steps  "
            f"pruned {pruned_share[s]:.0%} of draft nodes"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
