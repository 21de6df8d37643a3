"""Where a plain step's or a tree pass's CPU time goes, thread by thread (Linux ``perf``).

    env $(.venv/bin/python -m specstream_mlx.blas_env) \
        .venv/bin/python examples/profile_threads.py [--model smollm2] [--what ar|plain|9|9@1] [--seconds 6]

(under the product environment, as the CLI runs: the allocator it preloads cannot be loaded later,
and without it the host thread's profile is glibc's malloc's).

Starts a process that loads the model, prefills a 128-token context and repeats one
workload (``ar``: plain decoding as the engine runs it, 20 tokens at a time, each step
queued before the previous token is read; ``plain``: the compiled plain step, one at a
time; ``N``: an op-by-op ``ss_forward`` over an
N-node tree with streams at every node; ``N@1``: streams at the root only), attaches
``perf record -g`` to it once warm, and prints, for the busiest threads, the share of
their samples by leaf function (kernel time is charged to the user function that
entered the kernel, marked ``K:``). MLX runs every operation on its stream thread, so
that thread's profile is the critical path; the Python thread builds the next graph
meanwhile, and the product kernel's worker helps with the matrix products.
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict


def worker(model_name: str, what: str) -> None:
    import specstream_mlx  # noqa: F401  (first: it loads the BLAS before mlx.core is imported)

    # isort: split
    import mlx.core as mx

    from specstream_mlx import load
    from specstream_mlx.method.msa import ss_forward
    from specstream_mlx.method.tree import Tree
    from specstream_mlx.runtime.cache import make_cache
    from specstream_mlx.runtime.plain_step import plain_step
    from specstream_mlx.runtime.steps import prefill

    sm, _ = load(model_name, warn=False)
    base, streams = sm.base, sm.streams
    cache = make_cache(sm)
    prefill(base, mx.array(list(range(100, 228))), cache, 512)
    offset = cache[0].offset
    if what == "ar":  # plain decoding as generate runs it: the next step queued before this one is read
        from specstream_mlx.runtime.sampling import KeyStream, SamplingParams
        from specstream_mlx.runtime.steps import pipelined_tokens

        def once():
            greedy = SamplingParams(temperature=0.0)
            for tok in pipelined_tokens(base, mx.array([5]), greedy, cache, KeyStream(0), n=20):
                tok.item()
            for c in cache:
                c.offset = offset
            return 20

    elif what == "plain":
        step = plain_step(base)

        def once():
            mx.eval(step(mx.array([5]), cache))
            for c in cache:
                c.offset -= 1

    else:
        nodes, _, hosted = what.partition("@")
        k = int(nodes)
        parents = tuple([-1] + [(i - 1) // 2 for i in range(1, k)])  # a binary tree
        tree = Tree(tuple(range(300, 300 + k)), parents)
        hosts = [0] if hosted == "1" else None

        def once():
            out = ss_forward(base, streams, tree, offset, cache, 0.0, streams.num_streams, hosts)
            mx.eval(out.main_logits, out.stream_hidden)
            for c in cache:  # roll back: every repetition sees the same prefix
                c.commit([0])
                c.offset = offset

    for _ in range(3):
        once()
    print("ready", flush=True)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < 600:
        n += once() or 1
        if n % 20 == 0:
            print(f"{(time.perf_counter() - t0) / n * 1e3:.2f} ms", flush=True)


def aggregate(script: str, top: int = 12, least: float = 0.01):
    """{tid: (samples, [(share, leaf)])} from ``perf script -F tid,ip,sym,dso`` output."""
    leaves: Dict = collections.Counter()
    totals: Dict = collections.Counter()
    tid, chain = None, []

    def flush():
        if tid is not None and chain:
            user = [f for f in chain if "kernel" not in f]
            leaf = chain[0] if "kernel" not in chain[0] else "K:" + (user[0] if user else "?")
            leaves[(tid, leaf)] += 1
            totals[tid] += 1

    for line in script.splitlines():
        if not line.strip():
            flush()
            tid, chain = None, []
        elif not line.startswith("\t"):  # a sample's thread (some perf versions indent it by a space)
            tid, chain = line.split()[0], []
        else:
            parts = line.strip().split(None, 1)
            if len(parts) == 2:
                chain.append(re.sub(r"\(/.*?([^/]+)\)$", r"(\1)", parts[1])[:100])
    flush()
    out = {}
    for t, n in totals.most_common(4):
        rows = [(c / n, leaf) for (tt, leaf), c in leaves.most_common() if tt == t and c / n >= least]
        out[t] = (n, rows[:top])
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--what", default="plain")
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.model, args.what)
        return 0
    child = subprocess.Popen(
        [sys.executable, __file__, "--worker", "--model", args.model, "--what", args.what],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        for line in child.stdout:
            if line.strip() == "ready":
                break
        data = Path(tempfile.mkdtemp()) / "perf.data"
        subprocess.run(
            ["perf", "record", "-g", "-q", "-p", str(child.pid), "-o", str(data), "--", "sleep", str(args.seconds)],
            check=True,
            stderr=subprocess.DEVNULL,
        )
        timing = child.stdout.readline().strip()
    finally:
        child.kill()
    script = subprocess.run(
        ["perf", "script", "-i", str(data), "-F", "tid,ip,sym,dso"], capture_output=True, text=True
    ).stdout
    print(f"{args.model}, {args.what}: {timing} per repetition")
    for tid, (n, rows) in aggregate(script).items():
        print(f"thread {tid}: {n} samples")
        for share, leaf in rows:
            print(f"  {share:6.1%}  {leaf}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
