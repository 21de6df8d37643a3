"""A reference predictor for lossless streams: Medusa-1 heads on the frozen final hidden state.

    python examples/medusa_reference.py --seconds S [--model smollm2] [--data runs/sharegpt-8k]
        [--eval runs/smol-replies] [--out bench/reference-predictor.json]

Head j (j = 1..4) is one residual SiLU block on the frozen model's final hidden state,
``h + SiLU(W_j h + b_j)`` (W_j zero at the start, so every head starts as the model's
own next-token head), read through the frozen final norm and LM head, and trained with
cross-entropy on the token at t + 1 + j: the token stream j predicts at t. Trained
teacher-forced on the train split's conversations for S seconds of wall time (the
frozen features come from the same feature cache as ``train --cached-features``: only
the top layers run per batch), AdamW at 1e-3, 8 sequences per step, every completion
position. Scored as ``examples/stream_accuracy.py`` scores streams: top-1 at every reply
position of EVAL's valid split (the model's own greedy replies).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from specstream_mlx.demo.build import RUNS, SMOL_EXAMPLES, SMOL_STREAMS  # noqa: E402
from specstream_mlx.io.fingerprint import base_fingerprint  # noqa: E402
from specstream_mlx.io.loading import load_model_dir, resolve_model_path  # noqa: E402
from specstream_mlx.settings import current  # noqa: E402
from specstream_mlx.train import torch_backend as tb  # noqa: E402
from specstream_mlx.train import torch_objective as tobj  # noqa: E402
from specstream_mlx.train.data import iterate_batches, load_dataset, make_batch  # noqa: E402
from specstream_mlx.train.feature_cache import CacheSpec, FeatureCache  # noqa: E402


class MedusaHeads(torch.nn.Module):
    def __init__(self, hidden: int, n: int):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(n, hidden, hidden))
        self.b = torch.nn.Parameter(torch.zeros(n, hidden))

    def forward(self, h: torch.Tensor, j: int) -> torch.Tensor:
        return h + torch.nn.functional.silu(h @ self.w[j].T + self.b[j])


def targets(tokens: torch.Tensor, mask: torch.Tensor, lengths: torch.Tensor, j: int):
    """(targets, weights) of head j at every position: token t + 1 + j, weighted where t is a
    trained position and t + 1 + j is inside the sequence."""
    L = tokens.shape[1]
    shift = 1 + j
    tgt = torch.zeros_like(tokens)
    tgt[:, : L - shift] = tokens[:, shift:]
    inside = (torch.arange(L)[None] + shift) < lengths[:, None]
    return tgt, mask * inside.float()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, required=True, help="Wall time of training.")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--data", default=str(RUNS / f"sharegpt-{SMOL_EXAMPLES // 1000}k"))
    ap.add_argument("--eval", default=str(RUNS / "smol-replies"))
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    base = resolve_model_path(args.model)
    loaded = load_model_dir(str(base), warn=False)
    seq_len = SMOL_STREAMS["max_seq_len"]
    s0 = len(loaded.model.layers) - SMOL_STREAMS["stream_layers"]
    train, _, _ = load_dataset(Path(args.data), loaded.tokenizer, seq_len)
    _, held_out, _ = load_dataset(Path(args.eval), loaded.tokenizer, 512)
    hf = tb.hf_model_from_mlx(loaded.model, loaded.config)
    precision = "bfloat16" if tb.native_bfloat16(torch.device("cpu")) else "float32"
    if precision == "bfloat16":
        hf.to(torch.bfloat16)
    spec = CacheSpec(base_fingerprint(base), s0, precision, SMOL_STREAMS["teacher_top_k"])
    cache = FeatureCache(hf, train.examples, spec, current().cache_dir / "features")  # filled on first use

    heads = MedusaHeads(hf.config.hidden_size, args.heads)
    opt = torch.optim.AdamW(heads.parameters(), lr=args.lr, weight_decay=0.0)
    weight = hf.lm_head.weight
    auto = dict(device_type="cpu", dtype=torch.bfloat16, enabled=precision == "bfloat16")
    t0, step, positions = time.perf_counter(), 0, 0
    epoch = 0
    while time.perf_counter() - t0 < args.seconds:
        for b in iterate_batches(train, 8, seq_len, 1, 0, epoch):
            if time.perf_counter() - t0 >= args.seconds:
                break
            rows = tb._batch_tensors(b, 0, 1)
            feats = cache.batch(b.index, rows["tokens"].shape[1])
            with torch.no_grad(), torch.autocast(**auto):
                h = hf.model.norm(tobj.main_from_features(hf, feats["h_s0"], s0).h_final)
            opt.zero_grad()
            lm = rows["loss_mask"]
            with torch.autocast(**auto):
                for j in range(args.heads):
                    tgt, w = targets(rows["tokens"], lm, rows["lengths"], j + 1)
                    n = w.sum().clamp(min=1.0)
                    loss, *_ = tobj.head_loss(heads(h.float(), j), weight, tgt, w / n)
                    loss.backward()
            opt.step()
            step += 1
            positions += int(lm.sum())
        epoch += 1
    wall = time.perf_counter() - t0
    print(f"trained {step} steps, {positions:,} positions in {wall:.0f} s")

    hits, counts = np.zeros(args.heads), np.zeros(args.heads)
    with torch.no_grad(), torch.autocast(**auto):
        for i in range(0, len(held_out), 8):
            b = make_batch(held_out.examples[i : i + 8], 512, 1, None)
            rows = tb._batch_tensors(b, 0, 1)
            h = hf.model.norm(tobj.main_pass(hf, tobj.TorchTrainable({}, 1.0), rows["tokens"], s0).h_final)
            for j in range(args.heads):
                tgt, w = targets(rows["tokens"], rows["loss_mask"], rows["lengths"], j + 1)
                pred = (heads(h.float(), j).to(weight.dtype) @ weight.T).argmax(-1)
                hits[j] += float(((pred == tgt).float() * w).sum())
                counts[j] += float(w.sum())
    acc = (hits / np.maximum(counts, 1)).tolist()
    print("reference top-1 on held-out greedy replies: " + " / ".join(f"{a:.3f}" for a in acc))
    if args.out:
        report = dict(
            model=args.model,
            seconds=wall,
            steps=step,
            positions=positions,
            top1=acc,
            eval_positions=counts.tolist(),
            precision=precision,
            threads=torch.get_num_threads(),
        )
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
