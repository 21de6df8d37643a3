#!/usr/bin/env bash
# The first speculative request a user ever sees, against plain decoding: for each of the
# first N bench prompts of MODEL, a fresh process with an empty step-cost store decodes it
# with `--mode ss --tree auto` and with `--mode ar` (alternating which goes first), greedy,
# MAX_TOKENS tokens. Prints the tokens/s ratio per prompt and the median, and what ss did.
#   bash examples/first_request.sh [MODEL] [N] [MAX_TOKENS]
set -euo pipefail
cd "$(dirname "$0")/.."
model=${1:-smollm2}
n=${2:-8}
max=${3:-64}
cli=$PWD/.venv/bin/specstream-mlx
prompts=$("$PWD/.venv/bin/python" -c "
import json, sys
from specstream_mlx.bench import load_bench_prompts
from specstream_mlx.io.loading import resolve_model_path
rows = load_bench_prompts(resolve_model_path('$model'), $n)
print(json.dumps([r['prompt'] if isinstance(r['prompt'], str) else r['prompt'][-1]['content'] for r in rows]))")
out=$(mktemp -d)
cache=$("$PWD/.venv/bin/python" -c "from specstream_mlx.settings import current; print(current().cache_dir)")
for i in $(seq 0 $((n - 1))); do
  prompt=$(echo "$prompts" | "$PWD/.venv/bin/python" -c "import json,sys; print(json.load(sys.stdin)[$i])")
  order="ss ar"; [ $((i % 2)) = 1 ] && order="ar ss"
  for mode in $order; do
    # The user cache without its learned step costs: what a first process has (the
    # converted models and the compiled forwarder are linked in, not rebuilt).
    store=$(mktemp -d)
    for entry in "$cache"/*; do
      [ "$(basename "$entry")" = step_costs.json ] || ln -s "$entry" "$store/"
    done
    SPECSTREAM_MLX_CACHE=$store "$cli" generate --model "$model" --mode "$mode" --tree auto --temp 0 \
      -m "$max" --prompt "$prompt" --json > "$out/$mode-$i.json" 2>/dev/null
    rm -rf "$store"
  done
done
"$PWD/.venv/bin/python" - "$out" "$n" <<'PY'
import json, statistics, sys
out, n = sys.argv[1], int(sys.argv[2])
ratios = []
for i in range(n):
    ss, ar = (json.load(open(f"{out}/{m}-{i}.json")) for m in ("ss", "ar"))
    assert ss["tokens"] == ar["tokens"], f"prompt {i}: ss output differs from ar"
    r = ss["stats"]["tokens_per_second"] / ar["stats"]["tokens_per_second"]
    ratios.append(r)
    print(f"prompt {i}: ss {ss['stats']['tokens_per_second']:.1f} tok/s, ar {ar['stats']['tokens_per_second']:.1f} "
          f"({r:.2f}x), tau {ss['stats']['tokens_per_pass']:.2f}, fallback: {ss['stats']['fallback']}")
print(f"median ss/ar {statistics.median(ratios):.2f}x (min {min(ratios):.2f}, max {max(ratios):.2f}) over {n} prompts")
PY
