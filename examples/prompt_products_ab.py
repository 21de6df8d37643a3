"""What the product kernel's activation settings cost a prompt, in one process.

    env $(.venv/bin/python -m specstream_mlx.blas_env) \\
        .venv/bin/python examples/prompt_products_ab.py [--model smollm2] [--tokens 16,64,256,512] [--rounds 4]

A prompt's forward pass multiplies every weight by as many rows as the prompt has tokens: past
the kernel's tiles (48 rows) the float32 products go to the BLAS, while with integer activations
(``SPECSTREAM_PRODUCTS=q16``, the default, or ``q8``) every product of a weight read as stored
runs in the kernel's integer tiles. This script times the model's forward pass over prompts of
each ``--tokens`` length with the float32 activations (0), 16-bit ones (2) and 8-bit ones (1),
switched in turn within each round (``specstream_q8_set``), and prints the medians in ms.
Needs integer activations on at load (the weights' layout for them is built at registration):
the default, or ``SPECSTREAM_PRODUCTS=q8``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--tokens", default="16,64,256,512", help="prompt lengths, comma-separated")
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    try:
        lengths = [int(t) for t in args.tokens.split(",")]
    except ValueError:
        lengths = []
    if not lengths or min(lengths) < 1:
        print(
            f"prompt_products_ab.py: --tokens {args.tokens!r}: positive prompt lengths, comma-separated",
            file=sys.stderr,
        )
        return 2
    if args.rounds < 1:
        print(f"prompt_products_ab.py: --rounds {args.rounds}: at least 1", file=sys.stderr)
        return 2

    import specstream_mlx  # noqa: F401  (first: the BLAS before mlx.core)

    # isort: split
    import mlx.core as mx

    from specstream_mlx import load
    from specstream_mlx.platform_info import blas_words, q8_products, set_q8_products

    planes = q8_products()
    if not planes:
        print(
            "prompt_products_ab.py: integer activations are not on here: run without SPECSTREAM_PRODUCTS (or with q8) "
            "under env $(.venv/bin/python -m specstream_mlx.blas_env), where the product kernel serves products "
            "(x86-64 Linux, AVX2)",
            file=sys.stderr,
        )
        return 2
    sm, tok = load(args.model, warn=False)
    vocab = sm.base.args.vocab_size
    settings = (0, 2, 1)
    print(f"{args.model}; {args.rounds} rounds; BLAS {blas_words()}")
    print("| prompt tokens | float32, ms | 16-bit, ms | × float32 | 8-bit, ms | × float32 |")
    print("| --- | --- | --- | --- | --- | --- |")
    for n in lengths:
        ids = mx.array([(i * 7919) % (vocab - 200) + 100 for i in range(n)])[None]
        times = {s: [] for s in settings}
        for r in range(args.rounds):
            order = settings[r % 3 :] + settings[: r % 3]
            for s in order:
                set_q8_products(s)
                start = time.perf_counter()
                mx.eval(sm.base(ids))
                times[s].append(1e3 * (time.perf_counter() - start))
        med = {s: statistics.median(v) for s, v in times.items()}
        print(f"| {n} | {med[0]:.1f} | {med[2]:.1f} | {med[2] / med[0]:.3f} | {med[1]:.1f} | {med[1] / med[0]:.3f} |")
    set_q8_products(planes)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
