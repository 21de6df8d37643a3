"""What both training backends share around their step: batches as arrays,
validation through the MLX objective, the epoch loop, progress text."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from .data import Batch, Dataset, iterate_batches, make_batch
from .objective import compute_loss


def batch_arrays(b: Batch):
    return (
        mx.array(b.tokens),
        mx.array(b.loss_mask),
        mx.array(b.stream_pos),
        mx.array(b.stream_weight),
        mx.array(b.lengths),
    )


def to_py(metrics: dict) -> dict:
    out = {}
    for k, v in metrics.items():
        a = np.array(v)
        out[k] = a.tolist() if a.ndim else float(a)
    return out


def evaluate(model, trainable, cfg, ds: Dataset, seq_len: int, max_batches: int) -> dict:
    """Mean metrics over up to ``max_batches`` batches of ``ds`` (fixed stream positions)."""
    agg, n = None, 0
    for i in range(0, len(ds), cfg.batch_size):
        if n >= max_batches:
            break
        exs = ds.examples[i : i + cfg.batch_size]
        b = make_batch(exs, seq_len, cfg.stream_positions, None)
        _, m = compute_loss(model, trainable, cfg, *batch_arrays(b))
        m = to_py(m)
        agg = m if agg is None else {k: (np.add(agg[k], m[k])).tolist() for k in agg}
        n += 1
    return {k: (np.array(v) / n).tolist() for k, v in agg.items()} if agg else {}


def progress_text(loss: float, m: dict, tok_per_s: float) -> str:
    return (
        f"loss {loss:.3f} ce "
        + "/".join(f"{c:.2f}" for c in m.get("stream_ce", []))
        + " acc "
        + "/".join(f"{a:.2f}" for a in m.get("stream_acc", []))
        + f" {tok_per_s:,.0f} tok/s"
    )


def run_epochs(run, step: int) -> None:
    """Train ``run`` from ``step`` to the end; ``run.step`` is the last completed step.

    Either backend's run: it provides ``one_step(step, batch)``."""
    cfg, data = run.cfg, run.data
    run.step = step
    epoch, skip = divmod(step, data.steps_per_epoch)
    while step < data.total_steps:
        batches = iterate_batches(data.train, cfg.batch_size, data.seq_len, cfg.stream_positions, cfg.seed, epoch)
        for bi, batch in enumerate(batches):
            if bi < skip:
                continue
            if step >= data.total_steps:
                break
            run.one_step(step + 1, batch)
            step = run.step = step + 1
        epoch += 1
        skip = 0
