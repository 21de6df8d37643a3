#!/usr/bin/env bash
# Greedy tree speeds with MLX's compiled CPU kernels built with inline FMA instructions
# (the default, specstream_mlx/cpu_jit.py) against MLX's own build flags
# (SPECSTREAM_JIT_AVX2=0), interleaved: a 650-token prefill (median of 3 after one
# warm-up) and examples/tree_sweep.py on each side, ROUNDS times, speeds as ratios to
# `ar` of the same run. Prints a Markdown table.
#   bash examples/jit_ab.sh [MODEL] [TREES] [PROMPTS] [ROUNDS]
set -euo pipefail
cd "$(dirname "$0")/.."
model=${1:-smollm2-fc}
trees=${2:-"dynamic:8@1,dynamic:4+lookup@1,dynamic:8"}
prompts=${3:-6}
rounds=${4:-2}
py=$PWD/.venv/bin/python
blas=$("$py" -m specstream_mlx.blas_env)
runs=$(mktemp -d)
trap 'rm -rf "$runs"' EXIT
for i in $(seq "$rounds"); do
  for side in off on; do
    flag=1; [ $side = off ] && flag=0
    env $blas SPECSTREAM_JIT_AVX2=$flag "$py" - "$model" >> "$runs/$side-$i.txt" <<'PY'
import statistics, sys, time
import specstream_mlx
import mlx.core as mx
from specstream_mlx import load
from specstream_mlx.runtime.cache import make_cache
base = load(sys.argv[1], warn=False)[0].base
ts = []
for _ in range(4):
    cache = make_cache(base)
    t0 = time.perf_counter()
    mx.eval(base(mx.array([list(range(100, 750))]), cache=cache)[:, -1])
    ts.append(time.perf_counter() - t0)
print(f"prefill-650 {statistics.median(ts[1:]) * 1e3:.0f} ms")
PY
    env $blas SPECSTREAM_JIT_AVX2=$flag ROUNDS=1 "$py" examples/tree_sweep.py "$model" "$trees" "$prompts" \
      2>/dev/null >> "$runs/$side-$i.txt"
  done
done
"$py" - "$runs" "$model" "$prompts" "$rounds" <<'PY'
import glob, re, statistics, sys
runs, model, prompts, rounds = sys.argv[1:5]
rows = {}
for side in ("off", "on"):
    for f in sorted(glob.glob(f"{runs}/{side}-*.txt")):
        for line in open(f):
            m = re.match(r"prefill-650 ([\d.]+) ms", line)
            if m:
                rows.setdefault(("650-token prefill, ms", side), []).append(float(m.group(1)))
            m = re.match(r"(\S+)\s+([\d.]+) tok/s", line)
            if m:
                rows.setdefault(("ar tok/s", side), []).append(float(m.group(2)))
            m = re.match(r"(\S+)\s+([\d.]+)x\s+tau ([\d.]+)", line)
            if m:
                rows.setdefault((m.group(1), side), []).append(float(m.group(2)))
                rows.setdefault((m.group(1) + " τ", side), []).append(float(m.group(3)))
print(f"`{model}`, {prompts} prompts, {rounds} interleaved rounds; cells: each round's figure (speed as a ratio to `ar`)\n")
print("| | MLX's own flags (`SPECSTREAM_JIT_AVX2=0`) | inline FMA (default) |")
print("| --- | --- | --- |")
for name in dict.fromkeys(k for k, _ in rows):
    cell = lambda s: " / ".join(f"{v:.2f}" if v < 100 else f"{v:.0f}" for v in rows.get((name, s), []))
    print(f"| {name} | {cell('off')} | {cell('on')} |")
PY
