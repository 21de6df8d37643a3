"""What both training backends share around their step: batches as arrays,
validation through the MLX objective, the epoch loop, progress text."""

from __future__ import annotations

import math
import time
from typing import Callable

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


def mean_metrics(ds: Dataset, cfg, seq_len: int, max_batches: int, metrics_of: Callable) -> dict:
    """Mean of ``metrics_of(batch)`` (Python values) over up to ``max_batches`` batches of
    ``ds`` with fixed stream positions: validation, whichever backend computes it."""
    agg, n = None, 0
    for i in range(0, len(ds), cfg.batch_size):
        if n >= max_batches:
            break
        m = metrics_of(make_batch(ds.examples[i : i + cfg.batch_size], seq_len, cfg.stream_positions, None))
        agg = m if agg is None else {k: (np.add(agg[k], m[k])).tolist() for k in agg}
        n += 1
    return {k: (np.array(v) / n).tolist() for k, v in agg.items()} if agg else {}


def evaluate(model, trainable, cfg, ds: Dataset, seq_len: int, max_batches: int) -> dict:
    """Mean metrics of the MLX objective over up to ``max_batches`` batches of ``ds``."""
    return mean_metrics(
        ds, cfg, seq_len, max_batches, lambda b: to_py(compute_loss(model, trainable, cfg, *batch_arrays(b))[1])
    )


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


def after_step(run, step: int, loss: float, metrics: Callable[[], dict], n_tokens: int) -> None:
    """What follows step ``step``'s update in either backend: stop on a non-finite loss,
    history and progress, then (main process only) validation and a checkpoint.

    ``metrics`` returns the step's metrics as Python values; it is called only on
    reporting steps (in MLX it reads device arrays)."""
    from .config import TrainError

    cfg, data = run.cfg, run.data
    if not math.isfinite(loss):
        where = f"; the last good checkpoint is {run.ckpt}" if run.ckpt.exists() else ""
        raise TrainError(f"loss became {loss} at step {step}; stopping{where}. Try a lower --learning-rate.")
    run.tokens_seen += n_tokens
    tps = run.tokens_seen / (time.perf_counter() - run.t_start)
    if step % cfg.steps_per_report == 0 or step == data.total_steps:
        m = metrics()
        run.history.append(
            {
                "step": step,
                "loss": loss,
                "stream_acc": m.get("stream_acc", []),
                "stream_ce": m.get("stream_ce", []),
                "main_acc": m.get("main_acc"),
                "tokens_per_second": tps,
            }
        )
        if run.bar:
            run.bar.set_postfix_str(progress_text(loss, m, tps))
    if run.bar:
        run.bar.update(1)
    if not run.is_main:
        return
    if data.valid is not None and step % cfg.steps_per_eval == 0 and step < data.total_steps:
        v = run.evaluate()
        run.log(
            f"[train] step {step}: valid loss {v['loss']:.3f}, stream top-1 "
            + " ".join(f"{a:.3f}" for a in v.get("stream_acc", []))
        )
    if step % cfg.save_every == 0 and step < data.total_steps:
        run.save(step)
