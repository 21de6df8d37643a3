#!/usr/bin/env bash
# The skinny kernel's settings (its prefetches, its split threshold, its worker's spin),
# the allocator's huge pages and the mutexes' spin
# against the default, interleaved: `specstream-mlx floor` (a plain step as `ar` runs
# it, against the floor measured in the same process) under each setting, ROUNDS times,
# then the median step of each setting and its ratio to the default's step in the same
# round. SETTINGS picks some of them (default among them), in that order in every round.
#   [SETTINGS="default no-yield"] bash examples/skinny_ab.sh [MODEL] [ROUNDS]
#   default:      products from 256K weights split once the weights outgrow the last-level
#                 cache (512K while they fit); T1 prefetches at every row count; 50 µs spin
#   split-512K:   SPECSTREAM_SKINNY_PARALLEL_MIN=524288 (512K whatever the weights)
#   no-yield:     SPECSTREAM_SKINNY_YIELD=0 (a waiting worker pauses instead of yielding its core)
#   prefetch-t0:  SPECSTREAM_SKINNY_PREFETCH=t0 (every tile prefetches the next one's weight
#                 rows into L1, one-row products too)
#   prefetch-nta: SPECSTREAM_SKINNY_PREFETCH=nta (non-temporal from two rows on, none at one)
#   prefetch-t1:  SPECSTREAM_SKINNY_PREFETCH=t1 (into L2 at every row count)
#   prefetch-off: SPECSTREAM_SKINNY_PREFETCH=off
#   spin-N:       SPECSTREAM_SKINNY_SPIN_US=N for N in 0, 200, 1000, 5000 (a waiting worker
#                 spins N µs before it sleeps; default 50)
#   no-huge-pages: MALLOC_CONF=thp:default (jemalloc's memory without transparent huge pages)
#   no-lock-spin: SPECSTREAM_LOCK_SPIN=0 (MLX's mutexes sleep at once when contended; default:
#                 100 tries first)
#   no-kblock:    SPECSTREAM_SKINNY_KBLOCK=0 (long weights multiplied over their whole depth at
#                 once instead of in blocks of 512)
#   no-ahead:     SPECSTREAM_SKINNY_AHEAD_KB=0 (a waiting worker reads no weight ahead; within
#                 one process, examples/lock_spin_ab.py --setting ahead measures it better)
set -euo pipefail
cd "$(dirname "$0")/.."
model=${1:-smollm2}
rounds=${2:-3}
cli=$PWD/.venv/bin/specstream-mlx
runs=$(mktemp -d)
trap 'rm -rf "$runs"' EXIT
declare -A settings=(
  [default]=""
  [split-512K]="SPECSTREAM_SKINNY_PARALLEL_MIN=524288"
  [no-yield]="SPECSTREAM_SKINNY_YIELD=0"
  [prefetch-t0]="SPECSTREAM_SKINNY_PREFETCH=t0"
  [prefetch-nta]="SPECSTREAM_SKINNY_PREFETCH=nta"
  [prefetch-t1]="SPECSTREAM_SKINNY_PREFETCH=t1"
  [prefetch-off]="SPECSTREAM_SKINNY_PREFETCH=off"
  [spin-0]="SPECSTREAM_SKINNY_SPIN_US=0"
  [spin-200]="SPECSTREAM_SKINNY_SPIN_US=200"
  [spin-1000]="SPECSTREAM_SKINNY_SPIN_US=1000"
  [spin-5000]="SPECSTREAM_SKINNY_SPIN_US=5000"
  [no-huge-pages]="MALLOC_CONF=thp:default"
  [no-lock-spin]="SPECSTREAM_LOCK_SPIN=0"
  [no-kblock]="SPECSTREAM_SKINNY_KBLOCK=0"
  [no-ahead]="SPECSTREAM_SKINNY_AHEAD_KB=0"
)
read -r -a order <<< "${SETTINGS:-default prefetch-t0 split-512K no-yield}"
for name in "${order[@]}"; do
  [ -n "${settings[$name]+set}" ] || { echo "skinny_ab.sh: unknown setting '$name' (known: ${!settings[*]})" >&2; exit 2; }
done
[[ " ${order[*]} " == *" default "* ]] || { echo "skinny_ab.sh: SETTINGS must include default (the ratios are to it)" >&2; exit 2; }
echo "$model, $rounds rounds; 1-min load at start: $(cut -d' ' -f1 /proc/loadavg)"
for i in $(seq "$rounds"); do
  for name in "${order[@]}"; do
    # shellcheck disable=SC2086  # the setting is words for env
    env ${settings[$name]} "$cli" floor --model "$model" --rounds 1 2>/dev/null |
      sed -n 's/^plain step \([0-9.]*\) ms.*products alone \([0-9.]*\) ms.*/\1 \2/p' >> "$runs/$name"
  done
  echo "round $i: $(for n in "${order[@]}"; do printf '%s %s ms  ' "$n" "$(sed -n "${i}p" "$runs/$n" | cut -d' ' -f1)"; done)"
done
echo "1-min load at end: $(cut -d' ' -f1 /proc/loadavg)"
"$PWD/.venv/bin/python" - "$runs" "${order[@]}" <<'PY'
import statistics, sys
from pathlib import Path
runs, names = Path(sys.argv[1]), sys.argv[2:]
rows = {n: [[float(x) for x in line.split()] for line in (runs / n).read_text().split("\n") if line] for n in names}
steps = {n: [r[0] for r in rows[n]] for n in names}
products = {n: [r[1] for r in rows[n]] for n in names}
print("| setting | plain step, median ms | × default (median of per-round ratios) | products alone, median ms |")
print("| --- | --- | --- | --- |")
for n in names:
    ratios = [a / b for a, b in zip(steps[n], steps["default"])]
    print(f"| {n} | {statistics.median(steps[n]):.2f} | {statistics.median(ratios):.3f} | {statistics.median(products[n]):.2f} |")
PY
