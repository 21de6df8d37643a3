"""What the greedy stream candidates cost inside the decoding loop, old way against new.

    env $(.venv/bin/python -m specstream_mlx.blas_env) \\
        .venv/bin/python examples/candidates_ab.py [--model smollm2] [--trees dynamic:8@1,dynamic:4@1] [--rounds 2]

The next draft needs each stream's top-K tokens and their probabilities. ``new`` is the
runtime's (:func:`specstream_mlx.runtime.drafting.stream_candidates`: top-K by blocks,
probabilities from one max/exp-sum); ``old`` computes the softmax of the whole vocabulary
and partitions it, as the runtime did before. For three prompts and each tree (no
pruning), greedy ``ss`` decodes 48 tokens with each, after ``ar`` decodes 48 in the same
round: printed is the median time per pass in ``ar`` tokens, and whether both decoded the
same text.
"""

from __future__ import annotations

import argparse
import statistics
import time

PROMPTS = [
    "What is the best way to learn a new language? Answer in three sentences.",
    "Write a short poem about the sea.",
    "Explain how a refrigerator works.",
]


def softmax_candidates(logits, K, sampling, key=None, draws=0, vocab=None):
    """The previous greedy candidates: the vocabulary's softmax, then a partition of it
    (positions in a draft vocabulary mapped to its token ids)."""
    import mlx.core as mx

    from specstream_mlx.runtime.drafting import Candidates

    probs = mx.softmax(logits.astype(mx.float32), axis=-1)
    part = mx.argpartition(-probs, kth=K - 1, axis=-1)[..., :K]
    ptop = mx.take_along_axis(probs, part, axis=-1)
    order = mx.argsort(-ptop, axis=-1)
    top = mx.take_along_axis(part, order, axis=-1)
    return Candidates(top if vocab is None else vocab.tokens(top), mx.take_along_axis(ptop, order, axis=-1))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--trees", default="dynamic:8@1,dynamic:4@1")
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()

    import mlx.core as mx

    import specstream_mlx.runtime.speculative as S
    from specstream_mlx import load
    from specstream_mlx.method.tree import TreeSpec
    from specstream_mlx.platform_info import blas_in_use
    from specstream_mlx.runtime.generation import encode_prompt
    from specstream_mlx.runtime.sampling import SamplingParams
    from specstream_mlx.runtime.steps import ar_steps

    sm, tok = load(a.model, warn=False)
    arms = {"new": S.stream_candidates, "old": softmax_candidates}
    costs, texts = {}, {}
    for _ in range(a.rounds):
        for text in PROMPTS:
            prompt = mx.array(encode_prompt(tok, text))
            steps = ar_steps(sm.base, prompt, SamplingParams())
            next(steps)
            t = time.perf_counter()
            for _ in range(48):
                next(steps)
            ar = (time.perf_counter() - t) / 48
            for spec in a.trees.split(","):
                for name, fn in arms.items():
                    S.stream_candidates = fn
                    steps = S.ss_steps(sm, prompt, SamplingParams(), tree=TreeSpec.parse(spec), pruning_threshold=0.0)
                    next(steps)
                    t, n, passes, out = time.perf_counter(), 0, 0, []
                    while n < 48:
                        step = next(steps)
                        n, passes, out = n + len(step.tokens), passes + 1, out + step.tokens
                    costs.setdefault((spec, name), []).append((time.perf_counter() - t) / passes / ar)
                    texts.setdefault((spec, text), set()).add(tuple(out[:48]))
    print(f"{a.model}; BLAS {blas_in_use()}; greedy, no pruning; pass cost in ar tokens (median of rounds x prompts)")
    for (spec, name), v in costs.items():
        print(f"{spec:14s} {name:4s} {statistics.median(v):5.2f}  [{', '.join(f'{x:.2f}' for x in v)}]")
    print("same text with both:", all(len(v) == 1 for v in texts.values()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
