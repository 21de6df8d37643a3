"""Greedy ``ss`` tokens/s and τ per draft tree on a bundled model, against ``ar``.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        .venv/bin/python examples/tree_sweep.py demo-sql dynamic:2,dynamic:4,dynamic:8,dynamic:12,auto [16]

Decodes the model's first N held-out bench prompts (default 16, up to 64 tokens,
stopping at EOS) once to warm up and once timed, per tree. tokens/s excludes the
first token (prompt processing); τ = generated tokens / passes after the first.
Run it with ``OPENBLAS_NUM_THREADS=1`` and without to compare BLAS threading.
"""

import os
import sys
import time

from specstream_mlx import load
from specstream_mlx.bench import load_bench_prompts
from specstream_mlx.io.loading import resolve_model_path
from specstream_mlx.method.tree import TreeSpec
from specstream_mlx.platform_info import blas_in_use
from specstream_mlx.runtime.generation import encode_prompt, stream_generate
from specstream_mlx.runtime.sampling import SamplingParams


def main() -> int:
    name, specs = sys.argv[1], sys.argv[2].split(",")
    n = int(sys.argv[3]) if len(sys.argv) > 3 else 16
    model, tok = load(name, warn=False)
    rows = load_bench_prompts(resolve_model_path(name), n)
    ids = [encode_prompt(tok, r["prompt"]) for r in rows]

    def run(mode, tree=None):
        toks = passes = 0
        seconds = 0.0
        for i in ids:
            kw = {} if tree is None else {"tree": tree}
            first = None
            for r in stream_generate(
                model, tok, i, max_tokens=64, sampling=SamplingParams(), mode=mode, use_chat_template=False, **kw
            ):
                if first is None:
                    first = time.perf_counter()
                    continue
                toks += len(r.tokens)
                passes += 1
            seconds += time.perf_counter() - first
        return toks / seconds, toks / max(passes, 1)

    print(f"{name}; BLAS {blas_in_use()}; OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS', 'unset')}")
    run("ar")
    ar, _ = run("ar")
    print(f"ar           {ar:7.1f} tok/s")
    for s in specs:
        tree = s if s == "auto" else TreeSpec.parse(s)
        run("ss", tree)
        tps, tau = run("ss", tree)
        print(f"{s:12s} {tps:7.1f} tok/s  {tps / ar:.2f}x  tau {tau:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
