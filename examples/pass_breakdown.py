"""Where a speculative pass's time goes beyond a plain step, on a real model.

    env $(.venv/bin/python -m specstream_mlx.blas_env) \\
        .venv/bin/python examples/pass_breakdown.py [MODEL]

On a 128-token context, medians of 12 repetitions (the cache is rolled back after each
pass): a plain step (the compiled graph decoding uses), then ``ss_forward`` op by op with
1 and 9 tree nodes, without streams, with γ streams at every node, and with streams at
the root and one other node (as ``@1`` trees host them); every pass with streams
evaluates one host's stream logits, as greedy decoding does. The differences say what the
tree's main rows, the op-by-op pass and the stream rows each cost. Last, alternating pass
by pass: the 1-node and the 9-node pass with streams at two hosts with their evaluation
queued every ``msa.LAUNCH_EVERY`` lower layers (as decoding runs them) against built whole
and then evaluated, and the latter with its hosts' stream logits in the main rows' LM-head
product (``msa.MERGED_STREAM_ROWS``) against after it. First, how many operations the
plain step's graph and the 9-node pass's hold (what the host builds and dispatches).
"""

import io
import sys

import mlx.core as mx
import numpy as np

from specstream_mlx import load
from specstream_mlx.bench.machine import median_ms
from specstream_mlx.method import msa
from specstream_mlx.method.msa import ss_forward, stream_logits
from specstream_mlx.method.tree import Tree
from specstream_mlx.platform_info import blas_in_use
from specstream_mlx.runtime.cache import make_cache
from specstream_mlx.runtime.plain_step import plain_step
from specstream_mlx.runtime.sampling import SamplingParams
from specstream_mlx.runtime.steps import ar_steps, prefill


def graph_size(*outputs) -> int:
    """Operations in the graph that computes ``outputs`` (built, not yet evaluated), as
    ``mx.export_to_dot`` draws them: what the host builds and dispatches."""
    dot = io.StringIO()
    mx.export_to_dot(dot, *outputs)
    return dot.getvalue().count('label ="')


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

    none = np.zeros(0, dtype=np.int64)  # no node hosts streams

    def ss(tree, hosts=None):  # hosts None: every node
        def f():
            out = ss_forward(base, streams, tree, offset, cache, 0.0, None, hosts)
            # Greedy decoding evaluates one host's stream logits with the verdict (the first here).
            mx.eval(out.main_logits, *([stream_logits(base, streams, out, 0)] if len(out.hosts) else []))
            for c in cache:  # roll back: the next repetition sees the same prefix
                c.commit([0])
                c.offset = offset

        return f

    plain_steps = ar_steps(base, prompt, SamplingParams(), cache=make_cache(sm))
    print(f"{name}; BLAS {blas_in_use()}; 128-token context")
    step_cache = make_cache(sm)
    prefill(base, prompt, step_cache, 512)
    step_ops = graph_size(plain_step(base)(mx.array([5]), step_cache))
    launch, msa.LAUNCH_EVERY = msa.LAUNCH_EVERY, 0  # the whole graph built before anything runs
    out = ss_forward(base, streams, tree9, offset, cache, 0.0, None, np.array([0, 1]))
    msa.LAUNCH_EVERY = launch
    pass_ops = graph_size(out.main_logits, stream_logits(base, streams, out, 0))
    mx.eval(out.main_logits)
    for c in cache:
        c.commit([0])
        c.offset = offset
    print(f"graph operations: a plain step {step_ops}, the 9-node pass with streams at 2 hosts (op by op) {pass_ops}")
    for label, f in [
        ("plain step (compiled)", lambda: next(plain_steps)),
        ("1 node, no streams", ss(tree1, none)),
        ("9 nodes, no streams", ss(tree9, none)),
        (f"1 node, {gamma} streams", ss(tree1)),
        (f"9 nodes, {gamma} streams each", ss(tree9)),
        ("9 nodes, streams at 2 hosts", ss(tree9, np.array([0, 1]))),
    ]:
        print(f"{label:32s} {median_ms(f, 12):7.1f} ms")
    two_hosts = ss(tree9, np.array([0, 1]))
    for label, f, setting, ways in [
        ("1 node", ss(tree1, none), "LAUNCH_EVERY", "queued every {} layers|built then run"),
        ("9 nodes, streams at 2 hosts", two_hosts, "LAUNCH_EVERY", "queued every {} layers|built then run"),
        ("9 nodes, streams at 2 hosts", two_hosts, "MERGED_STREAM_ROWS", "stream logits with the main rows|after"),
    ]:
        default = getattr(msa, setting)
        times = {default: [], 0: []}
        for _ in range(12):
            for value in times:
                setattr(msa, setting, value)
                times[value].append(median_ms(f, 1))
        setattr(msa, setting, default)
        on, off = ways.format(default).split("|")
        print(f"{label}: {on} {np.median(times[default]):.1f} ms, {off} {np.median(times[0]):.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
