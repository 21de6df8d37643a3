"""Decoding with each attention form (MLX's fused kernel, or composed of products), same process.

    env $(.venv/bin/python -m specstream_mlx.blas_env) .venv/bin/python examples/attention_ab.py \\
        [--model smollm2] [--trees dynamic:8@1,dynamic:2] [--rounds 3] [--context N]

One model switches between the forms (:mod:`specstream_mlx.models.attention`), for its tree
passes' several query rows and its plain steps' one row alike. Each round, for three prompts (``--context N``:
each after a passage, about N tokens in all) and each form in turn, which goes first
alternating: ``ar`` decodes 48 tokens, then greedy ``ss`` 48 tokens with each tree (no
pruning). Printed: each form's ``ar`` ms per token and each tree's pass cost in that form's
``ar`` tokens (medians over rounds x prompts), the seconds ratios composed / fused (below 1:
composed is faster), whether both forms decoded the same text, and the seconds each form
takes to process a 650-token prompt.
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
TOKENS = 48
BACKGROUND = (
    "The river starts high in the mountains, where snow melts every spring. It runs through forests and "
    "small villages, turns the wheels of an old mill, and slowly widens as other streams join it. "
)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--trees", default="dynamic:8@1,dynamic:2")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--context", type=int, default=0, help="pad each prompt to about this many tokens")
    a = ap.parse_args()

    import mlx.core as mx

    from specstream_mlx import load
    from specstream_mlx.method.tree import TreeSpec
    from specstream_mlx.platform_info import blas_in_use
    from specstream_mlx.runtime.attention_choice import set_attention_form
    from specstream_mlx.runtime.cache import make_cache
    from specstream_mlx.runtime.generation import encode_prompt
    from specstream_mlx.runtime.sampling import SamplingParams
    from specstream_mlx.runtime.speculative import ss_steps
    from specstream_mlx.runtime.steps import ar_steps, prefill

    forms = ("fused", "composed")
    sm, tok = load(a.model, warn=False, attention="fused")
    trees = a.trees.split(",")
    step_ms = {f: [] for f in forms}
    costs = {(t, f): [] for t in trees for f in forms}
    texts = {}
    for r in range(a.rounds):
        for i, text in enumerate(PROMPTS):
            ids = encode_prompt(tok, text)
            if a.context > len(ids):  # an earlier passage before the question: a longer context
                passage = encode_prompt(tok, BACKGROUND, use_chat_template=False) * a.context
                ids = passage[: a.context - len(ids)] + ids
            prompt = mx.array(ids)
            for form in forms if (r * len(PROMPTS) + i) % 2 == 0 else forms[::-1]:  # ABBA: no order bias
                set_attention_form(sm.base, form)
                sm._passes.clear()  # compiled passes (SPECSTREAM_COMPILE=1) keep the form they were traced with
                steps = ar_steps(sm.base, prompt, SamplingParams())
                next(steps)
                t, out = time.perf_counter(), []
                for _ in range(TOKENS):
                    out += next(steps).tokens
                ar = (time.perf_counter() - t) / TOKENS
                step_ms[form].append(ar * 1e3)
                texts.setdefault(("ar", text), set()).add(tuple(out))
                for spec in trees:
                    steps = ss_steps(sm, prompt, SamplingParams(), tree=TreeSpec.parse(spec), pruning_threshold=0.0)
                    next(steps)
                    t, out, passes = time.perf_counter(), [], 0
                    while len(out) < TOKENS:
                        out, passes = out + next(steps).tokens, passes + 1
                    costs[(spec, form)].append((time.perf_counter() - t) / passes / ar)
                    texts.setdefault((spec, text), set()).add(tuple(out[:TOKENS]))
    med = statistics.median
    print(f"{a.model}; BLAS {blas_in_use()}; greedy, no pruning; {a.rounds} rounds x {len(PROMPTS)} prompts")
    print(
        f"ar ms/token      fused {med(step_ms['fused']):6.2f}  composed {med(step_ms['composed']):6.2f}  "
        f"ratio {med([c / f for c, f in zip(step_ms['composed'], step_ms['fused'])]):.3f}"
    )
    for spec in trees:
        f, c = costs[(spec, "fused")], costs[(spec, "composed")]
        # A pass in its own form's ar tokens; the ratio of seconds per pass, pair by pair.
        secs = [cc * sc / (ff * sf) for cc, ff, sc, sf in zip(c, f, step_ms["composed"], step_ms["fused"])]
        print(f"{spec:14s}   fused {med(f):6.2f}  composed {med(c):6.2f}  (ar tokens; seconds ratio {med(secs):.3f})")
    print("same text with both forms:", all(len(v) == 1 for v in texts.values()))
    # Prompt processing: a 650-token prompt, each form in turn, alternating which goes first.
    prefill_s = {f: [] for f in forms}
    ids = mx.array(list(range(1000, 1650)))
    for r in range(a.rounds):
        for form in forms if r % 2 == 0 else forms[::-1]:
            set_attention_form(sm.base, form)
            cache = make_cache(sm)
            t = time.perf_counter()
            prefill(sm.base, ids, cache)
            prefill_s[form].append(time.perf_counter() - t)
    f, c = med(prefill_s["fused"]), med(prefill_s["composed"])
    print(f"650-token prompt fused {f:.2f} s  composed {c:.2f} s  ratio {c / f:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
