"""Where a speculative pass's time goes beyond a plain step, on a real model.

    env $(.venv/bin/python -m specstream_mlx.blas_env) \\
        .venv/bin/python examples/pass_breakdown.py [MODEL]

On a 128-token context, medians of 12 repetitions (the cache is rolled back after each
pass): a plain step (the compiled graph decoding uses), then ``ss_forward`` op by op with
1 and 9 tree nodes, without streams, with γ streams at every node, and with streams at
the root only. The differences say what the tree's main rows, the op-by-op pass and the
stream rows each cost. Last, the 1-node and the 9-node pass with streams at the root with
their evaluation queued every ``msa.LAUNCH_EVERY`` lower layers (as decoding runs them)
against built whole and then evaluated, alternating pass by pass.
"""

import sys

import mlx.core as mx
import numpy as np

from specstream_mlx import load
from specstream_mlx.bench.machine import median_ms
from specstream_mlx.method import msa
from specstream_mlx.method.msa import ss_forward
from specstream_mlx.method.tree import Tree
from specstream_mlx.platform_info import blas_in_use
from specstream_mlx.runtime.cache import make_cache
from specstream_mlx.runtime.sampling import SamplingParams
from specstream_mlx.runtime.steps import ar_steps, prefill


def main() -> int:
    name = sys.argv[1] if len(sys.argv) > 1 else "smollm2"
    sm, _ = load(name, warn=False)
    base, streams = sm.base, sm.streams
    gamma = streams.num_streams
    prompt = mx.array(list(range(100, 228)))
    cache = make_cache(sm)
    prefill(base, prompt, cache, 512)
    offset = cache[0].offset
    tree9 = Tree(tuple(range(300, 309)), (-1, 0, 0, 1, 1, 2, 3, 4, 5))
    tree1 = Tree((300,), (-1,))

    def ss(tree, g, hosts=None):
        def f():
            out = ss_forward(base, streams, tree, offset, cache, 0.0, g, hosts)
            mx.eval(out.main_logits, out.stream_hidden)
            for c in cache:  # roll back: the next repetition sees the same prefix
                c.commit([0])
                c.offset = offset

        return f

    plain_steps = ar_steps(base, prompt, SamplingParams(), cache=make_cache(sm))
    print(f"{name}; BLAS {blas_in_use()}; 128-token context")
    for label, f in [
        ("plain step (compiled)", lambda: next(plain_steps)),
        ("1 node, no streams", ss(tree1, 0)),
        ("9 nodes, no streams", ss(tree9, 0)),
        (f"1 node, {gamma} streams", ss(tree1, gamma)),
        (f"9 nodes, {gamma} streams each", ss(tree9, gamma)),
        ("9 nodes, streams at the root", ss(tree9, gamma, np.array([0]))),
    ]:
        print(f"{label:32s} {median_ms(f, 12):7.1f} ms")
    every = msa.LAUNCH_EVERY
    for label, f in [("1 node", ss(tree1, 0)), ("9 nodes, streams at the root", ss(tree9, gamma, np.array([0])))]:
        times = {every: [], 0: []}
        for _ in range(12):
            for launch in times:
                msa.LAUNCH_EVERY = launch
                times[launch].append(median_ms(f, 1))
        msa.LAUNCH_EVERY = every
        print(
            f"{label}: queued every {every} layers {np.median(times[every]):.1f} ms, "
            f"built then run {np.median(times[0]):.1f} ms"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
