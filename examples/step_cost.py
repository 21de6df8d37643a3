"""Step-cost ratio of Speculative Streaming vs plain decoding, and peak memory.

    env $(.venv/bin/python -m specstream_mlx.blas_env) \
        .venv/bin/python examples/step_cost.py [--size qwen0.5b | --model smollm2] [--json out.json]

Builds a random model of the given shape (random weights are fine for cost), or
loads a real one (``--model``: directory or bundled name; its own streams, or
untrained γ=4 streams in the top 4 layers when it has none), and reports for several dynamic-tree
budgets the time of one ss pass divided by one plain step (median of reps, at
a 128-token context), then the peak memory of `ss` and `ar` generation on the
same prompt.

Next to each cost it prints the *matrix-product floor*: the time of the same
pass's matrix products alone (every projection and the LM head at the pass's row
counts, one graph, no attention, norms or RoPE) over that of a plain step's.

With ``--compiled`` it also times compiled passes (one ``mx.compile``d graph per
tree shape) between two op-by-op measurements.

With ``--tau-model demo-sql`` (repeatable) it also measures, on that model's
held-out bench prompts, the tokens per pass τ of greedy ``ss`` with each
budget, and prints the speedup that τ would give at this shape's step costs:
τ(b) / cost(b): small models are overhead-bound, larger ones compute- or memory-bound.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path


def tau_by_budget(name: str, budgets, n_prompts: int = 16, max_tokens: int = 64) -> dict:
    """Greedy ss tokens per pass (EOS included) of a bundled model, per dynamic-tree budget."""
    from specstream_mlx import load
    from specstream_mlx.bench import load_bench_prompts
    from specstream_mlx.io.loading import resolve_model_path
    from specstream_mlx.method.tree import TreeSpec
    from specstream_mlx.runtime.generation import encode_prompt, stream_generate
    from specstream_mlx.runtime.sampling import SamplingParams

    model, tok = load(name, warn=False)
    path = resolve_model_path(name)
    rows = load_bench_prompts(path, n_prompts)
    out = {}
    for b in budgets:
        decided = passes = 0
        for r in rows:
            ids = encode_prompt(tok, r["prompt"])
            for resp in stream_generate(
                model,
                tok,
                ids,
                max_tokens=max_tokens,
                sampling=SamplingParams(),
                mode="ss",
                tree=TreeSpec("dynamic", budget=b, depth=model.streams.num_streams),
                use_chat_template=False,
            ):
                last = resp
            decided += last.stats.tokens_per_pass * last.stats.forward_passes
            passes += last.stats.forward_passes
        out[b] = decided / passes
    return out


def matmul_floor(model, streams, budgets, reps: int = 5) -> dict:
    """Cost of a pass's matrix products alone relative to a plain step's, per budget b:
    b rows through the lower layers' projections, b·(1+γ) through the stream layers'
    (streams at every node), b + γ through the LM head (every node's main row and the
    accepted node's streams)."""
    import statistics
    import time

    import mlx.core as mx
    import mlx.nn as nn

    layers = model.layers
    n_low = len(layers) - streams.config.stream_layers
    gamma = streams.num_streams

    def weights(layer):
        return [m.weight for _, m in layer.named_modules() if isinstance(m, nn.Linear)]

    head = model.lm_head.weight if getattr(model, "lm_head", None) is not None else model.model.embed_tokens.weight
    per_layer = [weights(layer) for layer in layers]
    h = head.shape[1]

    def run(rows_low, rows_top, rows_head):
        outs = []
        for i, ws in enumerate(per_layer):
            rows = rows_low if i < n_low else rows_top
            for w in ws:
                outs.append(mx.random.normal((rows, w.shape[1])) @ w.T)
        outs.append(mx.random.normal((rows_head, h)) @ head.T)
        mx.eval(outs)

    def timed(*rows):
        run(*rows)
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            run(*rows)
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts)

    base = timed(1, 1, 1)
    return {b: timed(b, b * (1 + gamma), b + gamma) / base for b in budgets}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="qwen0.5b")
    ap.add_argument("--model", default=None, help="a real model directory or bundled name instead of --size")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", default=None)
    ap.add_argument("--tau-model", action="append", default=[], help="bundled model whose τ per budget to project")
    ap.add_argument("--budgets", default="2,4,8,12,16,24")
    ap.add_argument(
        "--compiled", action="store_true", help="also time compiled passes (SSPass, compiled=True), interleaved"
    )
    args = ap.parse_args()
    budgets = tuple(int(b) for b in args.budgets.split(","))

    import mlx.core as mx
    from bench_plain import build_dir

    from specstream_mlx import load
    from specstream_mlx.method.streams import StreamConfig, new_streams
    from specstream_mlx.method.tree import TreeSpec
    from specstream_mlx.platform_info import runtime_info
    from specstream_mlx.runtime.generation import generate
    from specstream_mlx.runtime.loaded_model import SpeculativeModel
    from specstream_mlx.runtime.offline_costs import measure_step_costs
    from specstream_mlx.runtime.sampling import SamplingParams

    if args.model:
        model, tok = load(args.model, warn=False)
    else:
        with tempfile.TemporaryDirectory() as d:
            path = build_dir(args.size, Path(d) / "m")
            model, tok = load(str(path))
    streams = model.streams or new_streams(model.base, StreamConfig(num_streams=4, stream_layers=4))
    floor = matmul_floor(model.base, streams, budgets, reps=args.reps)
    print(
        "matrix-product floor (same rows, products only) by budget:",
        json.dumps({k: round(v, 3) for k, v in floor.items()}),
    )
    costs = measure_step_costs(model.base, streams, reps=args.reps, budgets=budgets)
    print("step cost (ss pass / plain step) by draft budget:", json.dumps({k: round(v, 3) for k, v in costs.items()}))
    host_costs = measure_step_costs(model.base, streams, reps=args.reps, budgets=budgets, hosting=1)
    print(
        "step cost with streams at the root and 1 likely endpoint (@1):",
        json.dumps({k: round(v, 3) for k, v in host_costs.items()}),
    )
    compiled_costs = {}
    if args.compiled:
        # Interleaved with a second op-by-op measurement, so both see the same machine load.
        for kind in ("eager", "compiled", "eager-again"):
            c = measure_step_costs(model.base, streams, reps=args.reps, budgets=budgets, compiled=kind == "compiled")
            compiled_costs[kind] = c
            print(f"step cost, {kind}:", json.dumps({k: round(v, 3) for k, v in c.items()}))
    sm = SpeculativeModel(model.base, streams)

    prompt = list(range(3, 3 + 200))
    mem = {}
    for mode in ("ar", "ss"):
        tree = TreeSpec("dynamic", budget=12) if mode == "ss" else None
        mx.clear_cache()
        r = generate(sm, tok, prompt, max_tokens=48, sampling=SamplingParams(), mode=mode, tree=tree)
        mem[mode] = r.stats.peak_memory_gb
    print(f"peak memory: ar {mem['ar']:.3f} GB, ss {mem['ss']:.3f} GB, ratio {mem['ss'] / mem['ar']:.3f}")
    res = {
        "size": args.model or args.size,
        "matmul_floor_by_budget": floor,
        "step_cost_by_budget": costs,
        "step_cost_by_budget_hosting_1": host_costs,
        "step_cost_compiled_vs_eager": compiled_costs,
        "peak_memory_gb": mem,
        "default_tree": "dynamic:12",
        "runtime": runtime_info(),
        "projection": {},
    }
    del model, streams, sm
    for name in args.tau_model:
        taus = tau_by_budget(name, budgets)
        proj = {b: taus[b] / costs[b] for b in budgets}
        res["projection"][name] = {"tau": taus, "speedup": proj}
        best = max(proj, key=proj.get)
        print(
            f"{name}: τ by budget "
            + json.dumps({b: round(t, 2) for b, t in taus.items()})
            + f"; projected speedup at {args.size} step costs "
            + json.dumps({b: round(v, 2) for b, v in proj.items()})
            + f"; best b={best}: {proj[best]:.2f}x"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
