#!/usr/bin/env bash
# Lossless streams against a reference predictor (Medusa-1 heads), same data, same wall time.
#
#   bash examples/reference_comparison.sh [ITERS] [OUT_DIR]
#
# 1. Fresh SmolLM2 streams trained ITERS steps (default 80) at the build's settings with
#    cached features (their own cache directory, filled as the run goes), timed.
# 2. Medusa-1 heads (examples/medusa_reference.py) trained for the same wall time on the
#    same train split, from their own empty feature cache.
# 3. Both scored on the model's greedy replies to the 52 held-out prompts
#    (runs/smol-replies, written by `distill` as docs/RECIPE.md shows), streams by
#    examples/stream_accuracy.py. Results in OUT_DIR/report.json.
set -euo pipefail
ITERS=${1:-80}
OUT=${2:-runs/reference}
PY=${PY:-.venv/bin/python}
DATA=runs/sharegpt-8k
EVAL=runs/smol-replies
mkdir -p "$OUT"
[ -f "$EVAL/train.jsonl" ] || cp "$EVAL/valid.jsonl" "$EVAL/train.jsonl"  # scoring reads valid only
start=$(date +%s.%N)
$PY -m specstream_mlx train --backend torch --model smollm2 --data "$DATA" --out "$OUT/streams" \
    --force --new-streams --num-streams 4 --stream-layers 4 --lora-rank 16 --batch-size 8 \
    --max-seq-length 384 --stream-positions 128 --iters "$ITERS" --learning-rate 1e-3 --warmup 10 \
    --save-every 1000 --steps-per-eval 100000 --pruning-keep 0 \
    --cached-features --feature-cache "$OUT/features-streams"
end=$(date +%s.%N)
SECONDS_USED=$(python3 -c "print($end - $start)")
$PY examples/medusa_reference.py --seconds "$SECONDS_USED" --data "$DATA" --eval "$EVAL" --out "$OUT/medusa.json"
$PY examples/stream_accuracy.py "$OUT/streams" "$EVAL" | tee "$OUT/streams.txt"
python3 - "$OUT" "$SECONDS_USED" <<'PY'
import json, re, sys
out, secs = sys.argv[1], float(sys.argv[2])
m = json.load(open(f"{out}/medusa.json"))
line = open(f"{out}/streams.txt").read()
streams = [float(x) for x in re.findall(r"[0-9]\.[0-9]+", line.split("top-1")[1])]
json.dump({"seconds": secs, "streams_top1": streams, "medusa": m}, open(f"{out}/report.json", "w"), indent=2)
print(f"same wall time {secs:.0f} s: streams {streams}, medusa {[round(a, 3) for a in m['top1']]}")
PY
