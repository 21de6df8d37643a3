"""Cost of one `train --backend torch` step of the lossless objective, on real batches.

    .venv/bin/python examples/torch_step_cost.py [--model smollm2 --data runs/sharegpt-8k]
        [--stream-positions 64,128] [--precision float32,bfloat16] [--steps 4]

For each (stream positions, precision) it runs ``--steps`` forward-and-backward
passes of the lossless objective (main pass, stream pass, chunked vocabulary
losses, pruning adapter) on the same ShareGPT batches (8 × ≤384 tokens), and
prints the training tokens/s (first step excluded: warm-up) and the process's
peak resident memory so far. Run without the OpenBLAS preload (PyTorch brings
its own BLAS). The loss of each step is printed so that runs of the same batches
can be compared across code versions and precisions.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from specstream_mlx.io.loading import load_model_dir, resolve_model_path
from specstream_mlx.train import TrainConfig
from specstream_mlx.train import torch_backend as tb
from specstream_mlx.train import torch_objective as tobj
from specstream_mlx.train.data import iterate_batches, load_split
from specstream_mlx.train.objective import Trainable


def run(loaded, ds, positions: int, precision: str, steps: int, seq_len: int) -> None:
    cfg = TrainConfig(
        num_streams=4,
        stream_layers=4,
        lora_rank=16,
        batch_size=8,
        max_seq_len=seq_len,
        stream_positions=positions,
        backend="torch",
        precision=precision,
    )
    trainable = Trainable(loaded.model, cfg)
    hf = tb.hf_model_from_mlx(loaded.model, loaded.config)
    if precision == "bfloat16":
        hf.to(torch.bfloat16)
    params = tb.torch_trainable(trainable, cfg.lora_scale)
    s0 = len(loaded.model.layers) - cfg.stream_layers
    batches = iterate_batches(ds, cfg.batch_size, seq_len, positions, seed=0, epoch=0)
    seconds = tokens = 0.0
    for i in range(steps):
        b = next(batches)
        t = time.perf_counter()
        m = tobj.backward_segments(hf, params, cfg, tb._batch_tensors(b, 0, 1), s0)
        dt = time.perf_counter() - t
        if i:
            seconds, tokens = seconds + dt, tokens + int(b.lengths.sum())
        print(f"  step {i}: {dt:.2f} s, {int(b.lengths.sum())} tokens, loss {m['loss']:.4f}", flush=True)
    rate = tokens / seconds if seconds else float("nan")
    print(f"positions {positions}, {precision}: {rate:.0f} tokens/s, peak RSS {tb.peak_rss_gb():.2f} GB", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--data", default="runs/sharegpt-8k", help="a prepare-sharegpt directory (train.jsonl)")
    ap.add_argument("--stream-positions", default="64,128")
    ap.add_argument("--precision", default="float32,bfloat16")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--max-seq-length", type=int, default=384)
    a = ap.parse_args()
    loaded = load_model_dir(resolve_model_path(a.model))
    loaded.model.freeze()
    ds = load_split(Path(a.data) / "train.jsonl", loaded.tokenizer, a.max_seq_length)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {a.model}, {a.data}", flush=True)
    for precision in a.precision.split(","):
        for positions in (int(x) for x in a.stream_positions.split(",")):
            run(loaded, ds, positions, precision, a.steps, a.max_seq_length)


if __name__ == "__main__":
    main()
