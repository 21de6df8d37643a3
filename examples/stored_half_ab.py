"""What reading a quantized model's scales and biases as float16 is worth, in one process.

    env $(.venv/bin/python -m specstream_mlx.blas_env) \\
        .venv/bin/python examples/stored_half_ab.py [--model smollm2] [--rounds 8] [--context 128] [--half-first]

The product kernel keeps a registered weight's scales and biases as float16 where every one of
them is exactly a float16 (a GGUF file's are), and reads those: the same values, for a four-bit
weight with groups of 32 a sixth fewer bytes (``native/gemv_forward.c``, ``stored_scale``). This
script loads the model twice, one copy registered with the float16 copies and one with the
registrant's float32 scales and biases (``specstream_stored_half_set``), checks that both give
the same logits, bit for bit, and times both in turn, round by round (each round starts with the
other copy and runs them there and back): plain decoding as ``ar`` runs it (ms a token after a
``--context``-token prompt) and a 9-node speculative pass with streams at two hosts. Prints the
bytes a step reads with each, the medians and the median per-round ratio (float16 / float32).
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys

import numpy as np


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--context", type=int, default=128, help="prompt tokens before the timed steps and passes")
    ap.add_argument("--half-first", action="store_true", help="load the float16 copy first (default: the float32 one)")
    args = ap.parse_args()
    if args.rounds < 1 or args.context < 1:
        print("stored_half_ab.py: --rounds and --context must be at least 1", file=sys.stderr)
        return 2

    import specstream_mlx  # noqa: F401  (first: the BLAS before mlx.core)

    # isort: split
    import mlx.core as mx

    from specstream_mlx import load
    from specstream_mlx.bench.machine import median_ms, plain_step_ms, timing_prompt, weight_bytes
    from specstream_mlx.io.loading import ModelLoadError
    from specstream_mlx.method.msa import ss_forward, stream_logits
    from specstream_mlx.method.tree import Tree
    from specstream_mlx.platform_info import _symbol, blas_words, skinny_kernel
    from specstream_mlx.runtime.cache import make_cache
    from specstream_mlx.runtime.steps import prefill

    half_set = _symbol("specstream_stored_half_set")
    if skinny_kernel() is None or half_set is None:
        print(
            "stored_half_ab.py: the product kernel does not serve this process; start under "
            "env $(.venv/bin/python -m specstream_mlx.blas_env)",
            file=sys.stderr,
        )
        return 2
    half_set.argtypes, half_set.restype = [ctypes.c_int], ctypes.c_int
    models = {}
    order = (1, 0) if args.half_first else (0, 1)
    for on in order:  # where each copy lands in memory can move it a few percent (an A/A run: 1.03)
        before = half_set(on)
        try:
            models[on], _ = load(args.model, warn=False)
        except (ModelLoadError, ValueError) as e:
            print(f"stored_half_ab.py: {e}", file=sys.stderr)
            return 2
        finally:
            half_set(before)
    sizes = {on: weight_bytes(m.base) for on, m in models.items()}
    if sizes[0] == sizes[1]:
        print(f"stored_half_ab.py: {args.model} has no scales read as float16 here", file=sys.stderr)
        return 2
    prompt = timing_prompt(models[1].base, args.context)
    logits = {on: np.array(m.base(prompt[None])[0, -1]) for on, m in models.items()}
    if not np.array_equal(logits[0], logits[1]):
        print("stored_half_ab.py: the two copies' logits differ", file=sys.stderr)
        return 1

    tree = Tree(tuple(range(300, 309)), (-1, 0, 0, 1, 1, 2, 3, 4, 5))
    hosts = np.array([0, 1])

    def pass_fn(model):
        cache = make_cache(model.base)
        prefill(model.base, prompt, cache, 512)
        offset = cache[0].offset

        def run():
            out = ss_forward(model.base, model.streams, tree, offset, cache, 0.0, None, hosts)
            mx.eval(out.main_logits, stream_logits(model.base, model.streams, out, 0))
            for c in cache:  # roll back: every repetition sees the same prefix
                c.commit([0])
                c.offset = offset

        return run

    passes = {on: pass_fn(m) for on, m in models.items()}
    step = {0: [], 1: []}
    tree_pass = {0: [], 1: []}
    print(f"{args.model}; {args.context}-token context; {args.rounds} rounds; BLAS {blas_words()}")
    print(f"weights a step reads: {sizes[1] / 1e6:.1f} MB with float16 scales, {sizes[0] / 1e6:.1f} MB with float32")
    for r in range(args.rounds):
        order = [1, 0] if r % 2 == 0 else [0, 1]
        for on in order + order[::-1]:
            step[on].append(statistics.median(plain_step_ms(models[on].base, 40, args.context)))
            tree_pass[on].append(median_ms(passes[on], 3))
    print("| scales and biases | plain step, ms | × float32 | 9-node pass, 2 hosts, ms | × float32 |")
    print("| --- | --- | --- | --- | --- |")
    for on, name in ((0, "float32"), (1, "float16")):
        cells = []
        for times in (step, tree_pass):
            ratio = statistics.median(a / b for a, b in zip(times[on], times[0]))
            cells.append(f"{statistics.median(times[on]):.2f} | {ratio:.3f}")
        print(f"| {name} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
