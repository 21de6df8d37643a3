#!/usr/bin/env bash
# Teacher-forced human replies vs the model's own replies as data for lossless streams,
# at the same number of training steps, both continuing from the same streams.
#
#   bash examples/compare_data_sources.sh MODEL HUMAN_DATA DISTILLED_DATA OUT STEPS
#
# HUMAN_DATA: a prepared data directory (prepare-sharegpt); DISTILLED_DATA: distill's
# output for prompts of the same source (greedy). Each arm trains STEPS steps of the same
# settings into OUT/human and OUT/distilled, then both are scored by
# examples/stream_accuracy.py on DISTILLED_DATA's valid split (the model's own greedy
# replies to held-out prompts: stream 1's score is a one-token draft's acceptance rate).
# Resumable: an arm with a finished model directory is not trained again.
set -euo pipefail
model=$1 human=$2 distilled=$3 out=$4 steps=$5
py=${PY:-.venv/bin/python}
unset LD_PRELOAD  # PyTorch runs slower with OpenBLAS preloaded
for arm in human distilled; do
  data=$human; [ "$arm" = distilled ] && data=$distilled
  if [ ! -f "$out/$arm/specstream.json" ]; then
    resume=(); [ -d "$out/$arm/checkpoint" ] && resume=(--resume)
    "$py" -m specstream_mlx train --model "$model" --data "$data" --out "$out/$arm" "${resume[@]}" \
      --backend torch --precision auto --batch-size 8 --max-seq-length 384 --stream-positions 128 \
      --iters "$steps" --learning-rate 3e-4 --warmup 8 --save-every 20 --steps-per-eval 1000000
  fi
done
"$py" examples/stream_accuracy.py "$model" "$distilled" | sed 's/^/before: /'
for arm in human distilled; do
  "$py" examples/stream_accuracy.py "$out/$arm" "$distilled" | sed "s/^/$arm: /"
done
