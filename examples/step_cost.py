"""Step-cost ratio of Speculative Streaming vs plain decoding, and peak memory.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \
        .venv/bin/python examples/step_cost.py [--size qwen0.5b] [--json out.json]

Builds a random model of the given shape (random weights are fine for cost),
attaches γ=4 streams in the top 4 layers, and reports for several dynamic-tree
budgets the time of one ss pass divided by one plain step (median of reps, at
a 128-token context), then the peak memory of `ss` and `ar` generation on the
same prompt.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="qwen0.5b")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    import mlx.core as mx

    from bench_plain import build_dir
    from specstream_mlx.autotune import measure_step_costs
    from specstream_mlx.generation import generate
    from specstream_mlx.loading import load
    from specstream_mlx.platform_info import runtime_info
    from specstream_mlx.sampling import SamplingParams
    from specstream_mlx.streams import StreamConfig, new_streams
    from specstream_mlx.tree import TreeSpec

    with tempfile.TemporaryDirectory() as d:
        path = build_dir(args.size, Path(d) / "m")
        model, tok = load(str(path))
    streams = new_streams(model, StreamConfig(num_streams=4, stream_layers=4))
    costs = measure_step_costs(model, streams, reps=args.reps, budgets=(4, 8, 12, 16, 24))
    print("step cost (ss pass / plain step) by draft budget:", json.dumps({k: round(v, 3) for k, v in costs.items()}))

    prompt = list(range(3, 3 + 200))
    mem = {}
    for mode in ("ar", "ss"):
        kw = dict(streams=streams, tree=TreeSpec("dynamic", budget=12)) if mode == "ss" else {}
        mx.clear_cache()
        r = generate(model, tok, prompt, max_tokens=48, sampling=SamplingParams(), mode=mode, **kw)
        mem[mode] = r.stats.peak_memory_gb
    print(f"peak memory: ar {mem['ar']:.3f} GB, ss {mem['ss']:.3f} GB, ratio {mem['ss'] / mem['ar']:.3f}")
    res = {"size": args.size, "step_cost_by_budget": costs, "peak_memory_gb": mem,
           "default_tree": "dynamic:12", "runtime": runtime_info()}
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
