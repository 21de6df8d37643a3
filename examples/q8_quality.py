"""What integer activations (``SPECSTREAM_PRODUCTS=q8`` or ``q16``) change in a model's
next-token distributions.

    SPECSTREAM_PRODUCTS=q8 env $(.venv/bin/python -m specstream_mlx.blas_env) \\
        .venv/bin/python examples/q8_quality.py [MODEL] [PROMPTS] [TOKENS]

In one process, the kernel's integer activations (8-bit, or 16-bit as two 8-bit planes, as the
process was started) switched off and on in turn: for each of the model's first PROMPTS
held-out bench prompts (default 8), the exact products' greedy reply of TOKENS tokens (default
64); then, teacher-forced over prompt and that reply, the next-token distributions of both: the
KL divergence of the integer one from the exact one at every reply position (nats) and whether
their top tokens agree; and the integer products' own greedy reply, and where it first parts
from the exact one.
"""

from __future__ import annotations

import sys

import specstream_mlx  # noqa: F401  (first: the BLAS before mlx.core)

# isort: split
import mlx.core as mx
import numpy as np

from specstream_mlx import load
from specstream_mlx.bench import load_bench_prompts
from specstream_mlx.io.loading import resolve_model_path
from specstream_mlx.platform_info import activation_words, blas_words, q8_products, set_q8_products
from specstream_mlx.runtime.generation import encode_prompt
from specstream_mlx.runtime.sampling import SamplingParams
from specstream_mlx.runtime.steps import ar_steps


def greedy(model, prompt: mx.array, n: int, eos) -> list:
    out = []
    for step in ar_steps(model, prompt, SamplingParams()):
        out += step.tokens
        if len(out) >= n or out[-1] in eos:
            break
    return out[:n]


def main() -> int:
    name = sys.argv[1] if len(sys.argv) > 1 else "smollm2"
    count = int(sys.argv[2]) if len(sys.argv) > 2 else 8
    tokens = int(sys.argv[3]) if len(sys.argv) > 3 else 64
    planes = q8_products()
    if not planes:
        print(
            "q8_quality.py: integer activations are not on here: start with SPECSTREAM_PRODUCTS=q8 (or q16) under "
            "env $(.venv/bin/python -m specstream_mlx.blas_env), where the product kernel serves products "
            "(x86-64 Linux, AVX2)",
            file=sys.stderr,
        )
        return 2
    sm, tok = load(name, warn=False)
    model = sm.base
    eos = set(tok.eos_token_ids)
    rows = load_bench_prompts(resolve_model_path(name), count)
    prompts = [encode_prompt(tok, row["prompt"], use_chat_template=True) for row in rows]
    kls, agree, equal = [], 0, 0
    print(f"{name}; {len(prompts)} prompts x {tokens} tokens; {activation_words(planes)}; BLAS {blas_words()}")
    for ids in prompts:
        prompt = mx.array(ids)
        set_q8_products(0)
        reply = greedy(model, prompt, tokens, eos)
        full = mx.array(list(ids) + reply)[None]
        logp = {}
        for on in (0, planes):
            set_q8_products(on)
            logits = model(full)[0, len(ids) - 1 : -1].astype(mx.float32)
            logp[on] = np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
        kl = (np.exp(logp[0]) * (logp[0] - logp[planes])).sum(-1)
        kls.append(kl)
        agree += int((logp[0].argmax(-1) == logp[planes].argmax(-1)).sum())
        set_q8_products(planes)
        own = greedy(model, prompt, tokens, eos)
        first = next((i for i, (a, b) in enumerate(zip(reply, own)) if a != b), None)
        if first is None and len(own) != len(reply):
            first = min(len(own), len(reply))
        equal += first is None
        parts = "equal" if first is None else f"parts at token {first}"
        print(f"  {len(reply)} tokens: mean KL {kl.mean():.2e} nats, integer greedy reply {parts}")
    allkl = np.concatenate(kls)
    print(
        f"{allkl.size} positions: KL mean {allkl.mean():.2e}, median {np.median(allkl):.2e}, p99 "
        f"{np.quantile(allkl, 0.99):.2e}, max {allkl.max():.2e} nats; top tokens agree at {agree / allkl.size:.1%}; "
        f"greedy replies equal {equal} of {len(prompts)}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
