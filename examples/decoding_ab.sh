#!/usr/bin/env bash
# Plain decoding and speculative pass costs on SmolLM2, an older commit against this one,
# interleaved (a shared machine's drifts hit both alike). The older commit runs under
# BEFORE_BLAS (default: OpenBLAS, 2 threads, no one-row forwarder: what it shipped with),
# this one under the CLI's default BLAS. Writes bench/decoding-ab.json.
#   [BEFORE_BLAS=openblas:2] bash examples/decoding_ab.sh [BEFORE_COMMIT] [ROUNDS]
set -euo pipefail
cd "$(dirname "$0")/.."
before=${1:-b8e4de8}
rounds=${2:-3}
py=$PWD/.venv/bin/python
old=$(mktemp -d)/before
git worktree add -q --detach "$old" "$before"
trap 'git worktree remove --force "$old"' EXIT
before_env=$(SPECSTREAM_BLAS=${BEFORE_BLAS:-openblas:2} SPECSTREAM_BLAS_GEMV=0 "$py" -m specstream_mlx.blas_env)
after_env=$("$py" -m specstream_mlx.blas_env)
runs=$(mktemp -d)
for i in $(seq "$rounds"); do
  for side in before after; do
    dir=$PWD; blas_env=$after_env
    [ $side = before ] && dir=$old && blas_env=$before_env
    (cd "$dir" && env $blas_env PYTHONPATH="$dir" "$py" examples/bench_plain.py --model smollm2 --rounds 3 \
        --max-tokens 64 --json "$runs/plain-$side-$i.json" >/dev/null)
    (cd "$dir" && env $blas_env PYTHONPATH="$dir" "$py" examples/step_cost.py --model smollm2 --budgets 2,4,8,16 \
        --reps 7 --json "$runs/cost-$side-$i.json" >/dev/null)
  done
done
"$py" - "$runs" "$before" "$before_env" "$after_env" <<'PY'
import glob, json, os, statistics, sys
runs, before, before_env, after_env = sys.argv[1:5]
def load(pat):
    return [json.load(open(f)) for f in sorted(glob.glob(f"{runs}/{pat}-*.json"))]
home = os.path.expanduser("~")  # no build machine's paths in the committed record
out = {"before_commit": before, "blas_env": {"before": before_env.replace(home, "~"), "after": after_env.replace(home, "~")}, "rounds": {}}
for side in ("before", "after"):
    plain, cost = load(f"plain-{side}"), load(f"cost-{side}")
    out["rounds"][side] = {"plain": plain, "cost": cost}
    out[side] = {
        "ours_tps_median": statistics.median(p["ours_tps_median"] for p in plain),
        "mlx_lm_tps_median": statistics.median(p["mlx_lm_tps_median"] for p in plain),
        "step_cost_every_node": {b: statistics.median(c["step_cost_by_budget"][b] for c in cost) for b in cost[0]["step_cost_by_budget"]},
        "step_cost_hosting_1": {b: statistics.median(c["step_cost_by_budget_hosting_1"][b] for c in cost) for b in cost[0]["step_cost_by_budget_hosting_1"]},
        "blas": plain[0]["blas"],
    }
out["speedup_plain"] = out["after"]["ours_tps_median"] / out["before"]["ours_tps_median"]
open("bench/decoding-ab.json", "w").write(json.dumps(out, indent=1))
print(json.dumps({k: out[k] for k in ("before", "after", "speedup_plain")}, indent=1))
PY
