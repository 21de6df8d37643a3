#!/usr/bin/env bash
# Step costs on the Qwen2.5-0.5B shape, before (an older commit) and now, interleaved so
# that drifts of a shared machine hit both alike; writes bench/step-cost-ab.json.
#   bash examples/step_cost_ab.sh [BEFORE_COMMIT] [ROUNDS]
set -euo pipefail
cd "$(dirname "$0")/.."
before=${1:-76f29e8}
rounds=${2:-2}
old=$(mktemp -d)/before
git worktree add -q --detach "$old" "$before"
trap 'git worktree remove --force "$old"' EXIT
export LD_PRELOAD=$(ls /usr/lib/*-linux-gnu/openblas-pthread/libopenblas.so.0 2>/dev/null | head -1)
py=$PWD/.venv/bin/python
runs=$(mktemp -d)
for i in $(seq "$rounds"); do
  (cd "$old" && PYTHONPATH="$old" "$py" examples/step_cost.py --size qwen0.5b --budgets 2,4,8 --json "$runs/before-$i.json")
  "$py" examples/step_cost.py --size qwen0.5b --budgets 2,4,8 --json "$runs/after-$i.json"
done
"$py" - "$runs" "$before" <<'PY'
import glob, json, statistics, sys
runs, before = sys.argv[1], sys.argv[2]
def load(pat, key):
    return [json.load(open(f))[key] for f in sorted(glob.glob(f"{runs}/{pat}-*.json"))]
out = {"before_commit": before, "budgets": [2, 4, 8], "runs": {
    "before": load("before", "step_cost_by_budget"),
    "after": load("after", "step_cost_by_budget"),
    "after_hosting_1": load("after", "step_cost_by_budget_hosting_1")}}
out["mean"] = {k: {b: round(statistics.mean(r[str(b)] for r in v), 3) for b in (2, 4, 8)} for k, v in out["runs"].items()}
out["runtime"] = json.load(open(sorted(glob.glob(f"{runs}/after-*.json"))[0]))["runtime"]
open("bench/step-cost-ab.json", "w").write(json.dumps(out, indent=2))
print(json.dumps(out["mean"]))
PY
