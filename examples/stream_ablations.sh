#!/usr/bin/env bash
# Ablations of SmolLM2's lossless streams at equal steps (why a Medusa-1 reference learns
# faster at the same wall time). Every variant trains ITERS steps from fresh streams
# on the same batches (seed 0) at the build's settings but one, from one shared feature
# cache (the first variant fills it; later ones reuse the rows, so their times are not
# comparable with the first's), and is scored on the model's greedy replies to the 52
# held-out prompts (runs/smol-replies, as docs/RECIPE.md writes it) by
# examples/stream_accuracy.py.
#
#   bash examples/stream_ablations.sh [ITERS] [OUT_DIR] [VARIANT ...]
#
# Resumable: a variant with OUT_DIR/<name>.json is skipped. OUT_DIR/report.json gathers
# them all. Variants: base (the build's settings), ce (data tokens only, no teacher KL:
# what the reference trains on), positions (every completion position hosts streams, as
# the reference trains every position), lr / lr6 / lr10 (peak learning rate 3e-3 / 6e-3 / 1e-2),
# rank (LoRA rank 64), embrms (stream embeddings drawn at the hidden state's RMS, learning at
# that many times the rate: what made the shared-mode streams learn, docs/DESIGN.md decision 27).
set -euo pipefail
ITERS=${1:-80}
OUT=${2:-runs/ablations}
shift $(( $# > 2 ? 2 : $# ))
VARIANTS=${*:-base ce positions lr rank}
PY=${PY:-.venv/bin/python}
DATA=runs/sharegpt-8k
EVAL=runs/smol-replies
mkdir -p "$OUT"
[ -f "$EVAL/train.jsonl" ] || cp "$EVAL/valid.jsonl" "$EVAL/train.jsonl"  # scoring reads valid only
extra_args() {
  case "$1" in
    base) echo "" ;;
    ce) echo "--no-distill" ;;
    positions) echo "--stream-positions 384" ;;
    lr) echo "--learning-rate 3e-3" ;;
    lr6) echo "--learning-rate 6e-3" ;;
    lr10) echo "--learning-rate 1e-2" ;;
    rank) echo "--lora-rank 64" ;;
    embrms) echo "--stream-embedding-rms 1.0" ;;
    *) echo "unknown variant: $1 (base ce positions lr lr6 lr10 rank embrms)" >&2; exit 2 ;;
  esac
}
for v in $VARIANTS; do
  [ -f "$OUT/$v.json" ] && { echo "[$v] done already: $OUT/$v.json"; continue; }
  args=$(extra_args "$v")
  base_args="--num-streams 4 --stream-layers 4 --lora-rank 16 --batch-size 8 --max-seq-length 384 \
    --stream-positions 128 --iters $ITERS --learning-rate 1e-3 --warmup 10 --save-every 1000 \
    --steps-per-eval 100000 --pruning-keep 0"
  start=$(date +%s.%N)
  # shellcheck disable=SC2086  # later options override the base ones
  $PY -m specstream_mlx train --backend torch --model smollm2 --data "$DATA" --out "$OUT/$v-streams" \
      --force --new-streams $base_args $args --cached-features --feature-cache "$OUT/features"
  end=$(date +%s.%N)
  line=$($PY examples/stream_accuracy.py "$OUT/$v-streams" "$EVAL")
  echo "$line"
  python3 - "$OUT/$v.json" "$v" "$args" "$start" "$end" "$line" <<'PY'
import json, re, sys
path, name, args, start, end, line = sys.argv[1:]
top1 = [float(x) for x in re.findall(r"[0-9]\.[0-9]+", line.split("top-1")[1])]
json.dump({"variant": name, "args": args, "train_seconds": float(end) - float(start), "top1": top1},
          open(path, "w"), indent=2)
PY
done
python3 - "$OUT" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
rows = [json.loads(p.read_text()) for p in sorted(out.glob("*.json")) if p.name != "report.json"]
json.dump(rows, open(out / "report.json", "w"), indent=2)
for r in rows:
    print(f"{r['variant']:>10}  {r['args'] or '(build settings)':<24} {r['train_seconds']:7.0f} s  top-1 {r['top1']}")
PY
