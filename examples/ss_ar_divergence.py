"""Where greedy ``ss`` replies part from ``ar``'s on BFCL items, and why: a tie or a defect.

    env $(.venv/bin/python -m specstream_mlx.blas_env) .venv/bin/python examples/ss_ar_divergence.py \\
        [--model smollm2-fc] [--trees dynamic:8,dynamic:24] [--limit 60] [--items ID,ID]

Decodes each item (of ``--limit`` spread over BFCL's test split, or the named ``--items``)
greedily with ``ar`` and with ``ss`` under each fixed tree, as ``eval-bfcl`` does. For a reply
that differs it prints the first differing position, both tokens, the two best logits there
in a plain step after ``ar``'s own decoding and in one forward over the prompt and the shared
tokens, and whether :func:`specstream_mlx.runtime.ties.divergence` calls it a tie (both tokens
within a few float32 spacings of the best logit: which is larger is the rounding's choice).
"""

from __future__ import annotations

import argparse

import mlx.core as mx
import numpy as np

from specstream_mlx import load
from specstream_mlx.runtime.cache import make_cache
from specstream_mlx.runtime.generation import encode_prompt
from specstream_mlx.runtime.plain_step import plain_step
from specstream_mlx.runtime.ties import divergence
from specstream_mlx.tasks.evaluate import bfcl_test_rows, decode_reply, spread


def step_logits(model, ids, reply, k) -> np.ndarray:
    """The logits a plain step gives for position ``k`` of ``reply``, its cache written as
    ``ar`` writes it: the prompt in one forward, then the reply one step at a time."""
    step, cache = plain_step(model), make_cache(model)
    model(mx.array([ids[:-1]]), cache=cache)
    logits = step(mx.array([ids[-1]]), cache)
    for t in reply[:k]:
        logits = step(mx.array([t]), cache)
    return np.array(logits.astype(mx.float32)).reshape(-1)


def top2(logits: np.ndarray, tok) -> str:
    """The two best logits, and how many float32 spacings apart they are."""
    best = np.argsort(-logits, kind="stable")[:2]
    apart = (logits[best[0]] - logits[best[1]]) / np.spacing(np.abs(logits[best[0]]))
    shown = ", ".join(f"{tok.decode([int(t)])!r} {logits[t]:.9g}" for t in best)
    return f"{shown} ({apart:.0f} spacings apart)"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-fc")
    ap.add_argument("--trees", default="dynamic:8,dynamic:24")
    ap.add_argument("--limit", type=int, default=60)
    ap.add_argument("--items", default="", help="comma-separated BFCL ids (default: --limit items)")
    ap.add_argument("--max-tokens", type=int, default=192)
    args = ap.parse_args()
    model, tok = load(args.model)
    rows = spread(bfcl_test_rows(), args.limit)
    if args.items:
        want = set(args.items.split(","))
        rows = [r for r in bfcl_test_rows() if r["id"] in want]
    for row in rows:
        ids = encode_prompt(tok, row["messages"])
        _, ar, _, _ = decode_reply(model, tok, row["messages"], "ar", None, args.max_tokens)
        verdicts = []
        for tree in args.trees.split(","):
            _, ss, _, _ = decode_reply(model, tok, row["messages"], "ss", tree, args.max_tokens)
            d = divergence(model.base, ids, ar, ss)
            if d is None:
                verdicts.append(f"{tree}: equal")
                continue
            verdicts.append(f"{tree}: parts at {d.position} ({'a tie' if d.tie else 'NOT a tie'})")
            if d.gap is not None:
                print(f"  {row['id']} {tree}: ar {tok.decode([ar[d.position]])!r}, ss {tok.decode([ss[d.position]])!r}")
                print(f"    plain step: {top2(step_logits(model.base, ids, ar, d.position), tok)}")
                print(f"    one forward: gap ar - ss {d.gap:.3g}")
        print(row["id"], " | ".join(verdicts), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
