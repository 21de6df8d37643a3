#!/usr/bin/env bash
# This checkout's plain step and tree pass against another commit's, on the same weights,
# BLAS and allocator: each round starts a fresh process in each tree (alternating which goes
# first) that times 96 pipelined greedy plain steps after a 100-token prompt and 48 9-node
# passes with streams at two hosts on a 128-token context (CONTEXT=N: both after N tokens;
# the cache rolled back after each; medians), then prints every round and the median of the
# per-round ratios (this checkout ÷ REF). REF's code must offer the calls the probe makes
# (load, plain_step, prefill, ss_forward, stream_logits).
#   [CONTEXT=N] bash examples/code_ab.sh REF [MODEL] [ROUNDS]
set -euo pipefail
cd "$(dirname "$0")/.."
ref=${1:?usage: [CONTEXT=N] bash examples/code_ab.sh REF [MODEL] [ROUNDS]}
context=${CONTEXT:-}
model=${2:-smollm2}
rounds=${3:-6}
py=$PWD/.venv/bin/python
here=$PWD
other=$(mktemp -d)
probe=$(mktemp --suffix=.py)
trap 'git -C "$here" worktree remove --force "$other" >/dev/null 2>&1 || rm -rf "$other"; rm -f "$probe" "$probe.err"' EXIT
git worktree add --detach -q "$other" "$ref"
cat >"$probe" <<'PY'
import statistics
import sys
import time

import mlx.core as mx
import numpy as np

from specstream_mlx import load
from specstream_mlx.method.msa import ss_forward, stream_logits
from specstream_mlx.method.tree import Tree
from specstream_mlx.runtime.cache import make_cache
from specstream_mlx.runtime.plain_step import plain_step
from specstream_mlx.runtime.steps import prefill

sm, _ = load(sys.argv[1], warn=False)
base, streams = sm.base, sm.streams
step = plain_step(base)
context = int(sys.argv[2]) if len(sys.argv) > 2 and sys.argv[2] else None


def steps_ms(n=100, warm=4):
    cache = make_cache(base)
    prefill(base, mx.array([1] * (context or 100)), cache, 512)
    y, toks = mx.array([5]), []
    for i in range(n):
        if i == warm:
            t0 = time.perf_counter()
        y = mx.argmax(step(y, cache), axis=-1)
        mx.async_eval(y)
        toks.append(y)
    mx.eval(toks)
    return (time.perf_counter() - t0) / (n - warm) * 1e3


def pass_ms(reps=48):
    cache = make_cache(base)
    prefill(base, mx.array(list(range(100, 100 + (context or 128)))), cache, 512)
    offset = cache[0].offset
    tree = Tree(tuple(range(300, 309)), (-1, 0, 0, 1, 1, 2, 3, 4, 5))
    times = []
    for _ in range(reps + 2):
        t0 = time.perf_counter()
        out = ss_forward(base, streams, tree, offset, cache, 0.0, None, np.array([0, 1]))
        mx.eval(out.main_logits, stream_logits(base, streams, out, 0))
        times.append(time.perf_counter() - t0)
        for c in cache:
            c.commit([0])
            c.offset = offset
    return statistics.median(times[2:]) * 1e3


steps_ms()
step_t = statistics.median(steps_ms() for _ in range(5))
print(f"{step_t:.3f} {pass_ms() if streams is not None else float('nan'):.3f}")
PY
echo "$model; this checkout ($(git rev-parse --short HEAD)$(git diff --quiet || echo ', modified')) against $ref; $rounds rounds${context:+; $context-token context}"
for r in $(seq "$rounds"); do
  order="$here $other"
  [ $((r % 2)) = 0 ] && order="$other $here"
  for tree in $order; do
    # Each tree's own environment: its product kernel is built from its own source.
    if ! result=$(cd "$tree" && env $("$py" -m specstream_mlx.blas_env) PYTHONPATH="$tree" "$py" "$probe" "$model" "$context" 2>"$probe.err"); then
      echo "code_ab: the probe failed in $tree:" >&2
      tail -3 "$probe.err" >&2
      exit 1
    fi
    [ "$tree" = "$here" ] && echo "$r this $result" || echo "$r ref $result"
  done
done | "$py" -c '
import collections, statistics, sys
rounds = collections.defaultdict(dict)
for line in sys.stdin:
    r, who, step, pas = line.split()
    rounds[r][who] = (float(step), float(pas))
for r, d in sorted(rounds.items(), key=lambda kv: int(kv[0])):
    this, ref = d["this"], d["ref"]
    print(f"round {r}: plain step {this[0]:.2f} against {ref[0]:.2f} ms, 9-node pass {this[1]:.2f} against {ref[1]:.2f} ms")
for i, what in enumerate(("plain step", "9-node pass with streams at 2 hosts")):
    ratio = statistics.median(d["this"][i] / d["ref"][i] for d in rounds.values())
    print(f"{what}: median ratio {ratio:.3f} (this checkout / REF)")
'
