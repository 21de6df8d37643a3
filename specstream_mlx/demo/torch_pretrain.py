"""Pretrain a small Hugging Face Llama from scratch with PyTorch (next-token loss).

Why this exists: on a CPU-only Linux machine MLX's CPU backend trains a
3M-parameter Llama at ~1,650 tokens/s (fwd+bwd+AdamW, 16x96 batch, OpenBLAS),
while PyTorch's CPU kernels do ~8,000 tokens/s on the same shapes
(`examples/train_speed.py`, 2-core build machine, 2026-11-29). The demo models' *base* weights are therefore trained
here, saved as an ordinary Hugging Face checkpoint, and imported with
`specstream-mlx convert` — exactly the path a user with a fine-tuned HF model
takes. Everything the method adds (streams, shared/lossless objectives) is
trained afterwards by `specstream-mlx train` in MLX.

torch and transformers are development dependencies only (``pip install -e .[dev]``);
the runtime never imports this module.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from ..train.data import iterate_batches, load_dataset


def _loss_acc(model, x, m):
    """Masked next-token cross-entropy and accuracy of an HF causal LM on ids ``x``."""
    import torch

    logits = model(input_ids=x).logits[:, :-1]
    tgt = x[:, 1:]
    mm = m[:, :-1]
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1), reduction="none")
    ce = (ce * mm.reshape(-1)).sum() / mm.sum().clamp(min=1)
    acc = ((logits.argmax(-1) == tgt).float() * mm).sum() / mm.sum().clamp(min=1)
    return ce, acc


def _validate(model, valid_ds, batch_size: int, seq_len: int, seed: int, loss_acc) -> dict:
    """Completion cross-entropy and next-token accuracy on up to 16 valid batches."""
    import torch

    model.eval()
    ces, accs = [], []
    with torch.no_grad():
        for i, batch in enumerate(iterate_batches(valid_ds, batch_size, seq_len, 1, seed, 0)):
            if i >= 16:
                break
            # Validation always scores the completion only (what the task is judged on).
            x = torch.from_numpy(batch.tokens.astype(np.int64))
            ce, acc = loss_acc(x, torch.from_numpy(batch.loss_mask))
            ces.append(float(ce))
            accs.append(float(acc))
    return {"valid_completion_ce": float(np.mean(ces)), "valid_completion_acc": float(np.mean(accs))}


def _save(model, init_dir: Path, out_dir: Path, log_obj: dict) -> None:
    """An HF checkpoint with the tokenizer files of ``init_dir``, written beside and renamed into place."""
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    model.save_pretrained(tmp, safe_serialization=True)
    for f in init_dir.iterdir():
        if f.is_file() and f.name not in ("config.json",) and not f.name.endswith(".safetensors"):
            shutil.copy2(f, tmp / f.name)
    (tmp / "pretrain_log.json").write_text(json.dumps(log_obj, indent=2))
    if out_dir.exists():
        shutil.rmtree(out_dir)
    tmp.rename(out_dir)


def _make_model(init_dir: Path, from_weights: bool):
    """The Llama of ``init_dir/config.json``: random, or its checkpoint (``from_weights``)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if from_weights:  # continue from the checkpoint in init_dir (fine-tuning)
        return LlamaForCausalLM.from_pretrained(init_dir, dtype=torch.float32)
    cfg = json.loads((init_dir / "config.json").read_text())
    return LlamaForCausalLM(LlamaConfig(**{k: v for k, v in cfg.items() if k not in ("torch_dtype", "model_type")}))


def pretrain(
    init_dir: Path,
    data_dir: Path,
    out_dir: Path,
    *,
    steps: int,
    batch_size: int = 16,
    max_seq_len: int = 256,
    learning_rate: float = 1e-3,
    warmup: int = 100,
    all_tokens: bool = True,
    seed: int = 0,
    threads: Optional[int] = None,
    from_weights: bool = False,
    log: Callable[[str], None] = print,
) -> dict:
    """Train the Llama described by ``init_dir/config.json`` from random weights
    (``from_weights``: from the checkpoint in ``init_dir``).

    ``init_dir`` also holds the tokenizer files, which are copied to ``out_dir``.
    With ``all_tokens`` the loss covers every real token (prompt included: more
    signal per sequence for a from-scratch base); otherwise only the completion.
    Returns a summary (steps, tokens/s, final train and valid loss/accuracy).
    """
    import torch
    from tqdm import tqdm

    from ..io.loading import load_tokenizer

    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(seed)
    model = _make_model(init_dir, from_weights)
    tokenizer = load_tokenizer(init_dir)
    train_ds, valid_ds, _ = load_dataset(data_dir, tokenizer, max_seq_len)
    longest = max(len(e.tokens) for e in train_ds.examples)
    seq_len = min(max_seq_len, int(math.ceil(longest / 16) * 16))
    n_params = sum(p.numel() for p in model.parameters())
    log(f"[pretrain] {n_params:,} parameters, {len(train_ds)} sequences, {steps} steps of {batch_size} x {seq_len}")

    opt = torch.optim.AdamW(model.parameters(), lr=learning_rate, betas=(0.9, 0.98), weight_decay=0.01)
    # Linear warm-up, then linear decay to zero.
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / max(warmup, 1) if s < warmup else max(0.0, 1.0 - (s - warmup) / max(steps - warmup, 1))
    )

    def masks(batch):
        x = torch.from_numpy(batch.tokens.astype(np.int64))
        if all_tokens:
            ar = np.arange(batch.tokens.shape[1])[None, :]
            m = (ar < (batch.lengths[:, None] - 1)).astype(np.float32)
        else:
            m = batch.loss_mask
        return x, torch.from_numpy(m)

    def loss_acc(x, m):
        return _loss_acc(model, x, m)

    step, tokens, t0 = 0, 0, time.perf_counter()
    bar = tqdm(total=steps, desc="pretrain", unit="step", dynamic_ncols=True, file=sys.stderr)
    history = []
    epoch = 0
    model.train()
    while step < steps:
        for batch in iterate_batches(train_ds, batch_size, seq_len, 1, seed, epoch):
            if step >= steps:
                break
            x, m = masks(batch)
            loss, acc = loss_acc(x, m)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1
            tokens += int(batch.lengths.sum())
            if step % 20 == 0 or step == steps:
                rate = tokens / (time.perf_counter() - t0)
                history.append({"step": step, "loss": loss.item(), "acc": acc.item(), "tokens_per_second": rate})
                bar.set_postfix_str(f"loss {loss.item():.3f} acc {acc.item():.3f} {rate:,.0f} tok/s")
            bar.update(1)
        epoch += 1
    bar.close()
    elapsed = time.perf_counter() - t0
    summary = {
        "steps": step,
        "epochs": round(step * batch_size / len(train_ds), 2),
        "tokens_per_second": tokens / elapsed,
        "seconds": elapsed,
        "parameters": n_params,
        "train_loss": history[-1]["loss"] if history else None,
    }
    if valid_ds is not None and len(valid_ds):
        summary.update(_validate(model, valid_ds, batch_size, seq_len, seed, loss_acc))
    log(f"[pretrain] done in {elapsed:.0f} s: {json.dumps(summary)}")

    _save(model, init_dir, out_dir, {"summary": summary, "history": history})
    return summary


def main(argv: Optional[list] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--init", required=True, type=Path, help="directory with config.json and tokenizer files")
    ap.add_argument("--data", required=True, type=Path, help="data directory (train.jsonl, valid.jsonl)")
    ap.add_argument("--out", required=True, type=Path, help="output Hugging Face checkpoint directory")
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--max-seq-len", type=int, default=256)
    ap.add_argument("--learning-rate", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--completion-only", action="store_true", help="loss on completions only")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--from-weights", action="store_true", help="start from the checkpoint in --init")
    a = ap.parse_args(argv)
    pretrain(
        a.init,
        a.data,
        a.out,
        steps=a.steps,
        batch_size=a.batch_size,
        max_seq_len=a.max_seq_len,
        learning_rate=a.learning_rate,
        warmup=a.warmup,
        all_tokens=not a.completion_only,
        seed=a.seed,
        threads=a.threads,
        from_weights=a.from_weights,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
