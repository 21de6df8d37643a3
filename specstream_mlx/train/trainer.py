"""Training speculative streams (lossless and shared modes).

The objective lives in :mod:`.objective` (segment by segment: :mod:`.segmented`),
checkpoints and the output directory in :mod:`.checkpoint`; this module sets a
run up (model, checks, data, streams, resumption) and runs the MLX loop:
optimizer, compiled steps, validation, progress, interruption. With
``backend="torch"`` the same set-up drives :class:`.torch_backend.TorchRun`.
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_flatten

from ..io.files import atomic_directory, check_writable, clean_stale_temporaries, replaceable
from ..io.loading import load_model_dir, resolve_model_path
from .calibrate import calibrate_pruning
from .checkpoint import (
    find_checkpoint,
    load_checkpoint,
    mlx_optimizer_arrays,
    restore_mlx_optimizer,
    save_checkpoint,
    write_model_dir,
)
from .config import TrainConfig, TrainError, TrainResult
from .data import Batch, Dataset, load_dataset
from .loop import after_step, batch_arrays, evaluate, run_epochs, to_py
from .objective import Trainable, compute_loss
from .segmented import SegmentedStep


@dataclass
class TrainData:
    """The datasets of a run and the shape of its batches."""

    train: Dataset
    valid: Optional[Dataset]
    seq_len: int
    steps_per_epoch: int
    total_steps: int


def _load_data(data_dir: str, tokenizer, vocab_size: int, cfg: TrainConfig, log) -> TrainData:
    train_ds, valid_ds, _ = load_dataset(Path(data_dir), tokenizer, cfg.max_seq_len, vocab_size)
    for ds in (train_ds, valid_ds):
        if ds is not None and ds.truncated:
            log(
                f"[train] {ds.name}: {ds.truncated} sequences longer than --max-seq-len {cfg.max_seq_len} "
                "were truncated"
            )
    if valid_ds is None or not len(valid_ds):
        log("[train] no valid.jsonl examples: validation is skipped")
        valid_ds = None
    longest = max(len(e.tokens) for e in train_ds.examples)
    seq_len = min(cfg.max_seq_len, int(math.ceil(longest / 16) * 16))
    steps_per_epoch = math.ceil(len(train_ds) / cfg.batch_size)
    total = cfg.iters if cfg.iters else max(1, int(round((cfg.epochs or 1.0) * steps_per_epoch)))
    return TrainData(train_ds, valid_ds, seq_len, steps_per_epoch, total)


EMBEDDINGS = "streams.embeddings"
# Fresh shared-mode stream embeddings are drawn at this x the hidden state's RMS unless
# --stream-embedding-rms says otherwise: at the fixed 0.02 draw a stream row is its main
# row and the shared LoRA cannot tell them apart (bench/stream-embedding-scale.md).
SHARED_EMBEDDING_RMS = 1.0  # the stream embeddings' name in the trainable's flattened tree


def _schedule(peak: float, cfg: TrainConfig, total: int):
    schedule = optim.linear_schedule(peak, 0.0, total)
    if cfg.warmup:
        warm = optim.linear_schedule(1e-8, peak, cfg.warmup)
        schedule = optim.join_schedules([warm, schedule], [cfg.warmup])
    return schedule


def _optimizer(cfg: TrainConfig, total: int) -> optim.Optimizer:
    adam = optim.AdamW(learning_rate=_schedule(cfg.learning_rate, cfg, total), weight_decay=0.0)
    if not cfg.streams or (cfg.embedding_lr or 1.0) == 1.0:
        return adam
    # The stream embeddings at their own rate (TrainConfig.embedding_lr), everything else at the base rate.
    emb = optim.AdamW(learning_rate=_schedule(cfg.learning_rate * cfg.embedding_lr, cfg, total), weight_decay=0.0)
    return optim.MultiOptimizer([emb, adam], [lambda path, _: path == EMBEDDINGS])


def _step_function(model, trainable: Trainable, optimizer, cfg: TrainConfig):
    """One optimizer step on a batch's arrays, compiled over the trainable and optimizer state."""
    loss_and_grad = nn.value_and_grad(trainable, lambda *a: compute_loss(model, trainable, cfg, *a))

    def raw_step(*arrays):
        (loss, metrics), grads = loss_and_grad(*arrays)
        optimizer.update(trainable, grads)
        return loss, metrics

    state = [trainable.state, optimizer.state]
    fn = mx.compile(raw_step, inputs=state, outputs=state) if cfg.compile else raw_step
    return fn, state


class _Run:
    """The state of one training run while its loop executes."""

    def __init__(self, model, trainable, optimizer, cfg: TrainConfig, data: TrainData, ckpt: Path, log, bar):
        self.model, self.trainable, self.optimizer = model, trainable, optimizer
        self.cfg, self.data, self.ckpt, self.log, self.bar = cfg, data, ckpt, log, bar
        self.step_fn, self.state = _step_function(model, trainable, optimizer, cfg)
        self.segmented = SegmentedStep(model, trainable, optimizer, cfg)
        self.history = []
        self.step = 0  # last completed step
        self.tokens_seen = 0
        self.t_start = time.perf_counter()

    def one_step(self, step: int, batch: Batch) -> None:
        """Run ``batch`` as step ``step`` (1-based): update, report, validate, checkpoint."""
        cfg = self.cfg
        if cfg.streams and batch.stream_pos.shape[1] > cfg.segment:
            loss, metrics = self.segmented(*batch_arrays(batch))  # memory bounded by one segment
        else:
            loss, metrics = self.step_fn(*batch_arrays(batch))  # one segment: one compiled graph
        mx.eval(loss, metrics, self.state)
        after_step(self, step, float(loss.item()), lambda: to_py(metrics), int(batch.lengths.sum()))

    is_main = True  # one process

    def save(self, step: int) -> None:
        save_checkpoint(self.ckpt, self.trainable, mlx_optimizer_arrays(self.optimizer), step, self.cfg)

    def loop(self, step: int) -> None:
        run_epochs(self, step)

    def evaluate(self) -> dict:
        """Mean validation metrics over up to ``val_batches`` batches."""
        d = self.data
        return evaluate(self.model, self.trainable, self.cfg, d.valid, d.seq_len, self.cfg.val_batches)

    def calibrate(self):
        return calibrate_pruning(self.model, self.trainable.streams, self.data.valid, keep=self.cfg.pruning_keep)

    def peak_memory_gb(self) -> float:
        return mx.get_peak_memory() / 1e9


def _finish(run: _Run, result: TrainResult, base_dir: Path, out: Path, data_dir: str, n_train: int) -> None:
    """Final validation, the model directory and the training log."""
    cfg, data = run.cfg, run.data
    if data.valid is not None:
        result.val = run.evaluate()
        run.log(
            f"[train] final valid loss {result.val['loss']:.3f}, stream top-1 "
            + " ".join(f"{a:.3f}" for a in result.val.get("stream_acc", []))
        )
    calibration = None
    if cfg.streams and cfg.pruning_keep > 0 and data.valid is not None:
        calibration = run.calibrate()
        run.trainable.streams.config.pruning_threshold = calibration.threshold
        run.log(
            f"[train] pruning threshold {calibration.threshold:.4g}: keeps {calibration.kept_accepted:.1%} of "
            f"would-be-accepted children, prunes {calibration.pruned_runners_up:.1%} of runners-up"
        )
    # The data directory is recorded by name only: model directories carry no machine paths.
    extra = {
        "pruning_calibration": calibration.to_json() if calibration else None,
        "steps": result.steps,
        "train_tokens_per_second": result.tokens_per_second,
        "valid": result.val,
        "data": Path(data_dir).name,
    }
    # The finished directory replaces OUT (and its checkpoint) in one rename.
    with atomic_directory(out, True, TrainError) as tmp:
        write_model_dir(base_dir, tmp, run.model, run.trainable, cfg, extra)
        _write_log(tmp, cfg, result, n_train)
    run.log(
        f"[train] wrote {out} ({n_train:,} trainable parameters, {result.tokens_per_second:,.0f} tok/s, "
        f"peak {result.peak_memory_gb:.2f} GB)"
    )


def _write_log(out: Path, cfg: TrainConfig, result: TrainResult, n_train: int) -> None:
    (out / "training_log.json").write_text(
        json.dumps(
            {
                "config": asdict(cfg),
                "history": result.history,
                "valid": result.val,
                "tokens_per_second": result.tokens_per_second,
                "peak_memory_gb": result.peak_memory_gb,
                "trainable_parameters": n_train,
            },
            indent=2,
        )
    )


def _check_destination(base_dir: Path, out: Path, cfg: TrainConfig, resume: bool) -> None:
    if out.resolve() == Path(base_dir).resolve() and not cfg.force:
        raise TrainError(f"--out {out} is the model's own directory; pass --force to train it in place")
    if out.exists() and not out.is_dir():
        raise TrainError(f"--out {out}: exists and is not a directory")
    # The finished model replaces OUT as a whole: never a directory of something else,
    # --force or not (it would be deleted).
    if out.is_dir() and not replaceable(out):
        raise TrainError(f"--out {out}: exists and is not a model directory; refusing to replace it")
    check_writable(out, TrainError)  # before the run: a result nowhere to go would be lost


def _adopt_existing_streams(streams, cfg: TrainConfig, log):
    """The model's own streams when training should continue from them, else None."""
    if streams is None or not cfg.streams or cfg.new_streams:
        return None
    sc = streams.config
    if sc.mode != cfg.mode:
        log(f"[train] the model's streams were trained in {sc.mode} mode; starting fresh {cfg.mode} streams")
        return None
    changed = [
        f"{name} {old} -> {new}"
        for name, old, new in (
            ("num_streams", cfg.num_streams, sc.num_streams),
            ("stream_layers", cfg.stream_layers, sc.stream_layers),
            ("lora_rank", cfg.lora_rank if cfg.mode == "lossless" else 0, sc.lora_rank),
        )
        if old != new
    ]
    cfg.num_streams, cfg.stream_layers = sc.num_streams, sc.stream_layers
    if cfg.mode == "lossless":
        cfg.lora_rank = sc.lora_rank
    cfg.lora_targets = list(sc.lora_targets)
    cfg.lora_scale = sc.lora_scale
    log(
        f"[train] continuing from the model's streams (γ={sc.num_streams}, Ns={sc.stream_layers}"
        + (f"; settings taken from them: {', '.join(changed)}" if changed else "")
        + "); --new-streams starts fresh ones"
    )
    return streams


def _hidden_rms(model, streams, data) -> float:
    """RMS of the hidden state the stream embeddings are added to (train split, 8 sequences)."""
    from .objective import stream_layer_rms

    try:
        return stream_layer_rms(model, data.train.examples[:8], streams.first_layer)
    except ValueError as e:
        raise TrainError(f"stream embeddings: {e}") from None


def _draw_stream_embeddings(model, streams, h_rms: float, cfg: TrainConfig, log) -> None:
    """Fresh stream embeddings at ``cfg.stream_embedding_rms`` of the stream layer's hidden RMS."""
    target = cfg.stream_embedding_rms * h_rms
    streams.scale_embeddings(target, seed=cfg.seed)
    log(
        f"[train] stream embeddings drawn at RMS {target:.3g} "
        f"({cfg.stream_embedding_rms:g} x the hidden state's {h_rms:.3g} entering layer {streams.first_layer})"
    )


def _embedding_settings(model, streams, adopted: bool, data, cfg: TrainConfig, resume: bool, log) -> None:
    """Fresh stream embeddings' draw and learning rate (``cfg.stream_embedding_rms`` and
    ``cfg.embedding_lr``, their defaults resolved here); ``adopted``: the model's own
    streams are trained further, so nothing is drawn."""
    if cfg.mode == "shared" and cfg.stream_embedding_rms is None and not adopted:
        cfg.stream_embedding_rms = SHARED_EMBEDDING_RMS
    h_rms = None
    if not adopted and cfg.stream_embedding_rms is not None and not resume:
        h_rms = _hidden_rms(model, streams, data)
        _draw_stream_embeddings(model, streams, h_rms, cfg, log)
    auto_lr = cfg.embedding_lr is None
    if auto_lr:
        # Embeddings drawn at the hidden state's scale learn at it too: Adam moves every
        # parameter by about the learning rate per step, whatever its scale, so this is the
        # rate of P = RMS * P' with P' at unit scale (docs/DESIGN.md decision 27). The fixed
        # small draw keeps the base rate.
        drawn = cfg.stream_embedding_rms is not None
        cfg.embedding_lr = round(h_rms or _hidden_rms(model, streams, data), 3) if drawn else 1.0
    if cfg.embedding_lr != 1.0:
        why = " (the RMS of the hidden state they are added to)" if auto_lr else ""
        log(f"[train] stream embeddings learn at {cfg.embedding_lr:g} x the learning rate{why}")


def _torch_accelerator():
    from .torch_backend import make_accelerator

    return make_accelerator()


def _make_run(model, trainable, cfg, data, ckpt, log, bar, config, acc, opt_arrays):
    """The backend's run, its optimizer state restored when resuming."""
    if cfg.backend == "torch":
        from .torch_backend import TorchRun

        run = TorchRun(model, trainable, cfg, data, ckpt, log, bar, config, acc)
        if opt_arrays is not None:
            run.load_optimizer_arrays(opt_arrays)
        return run
    optimizer = _optimizer(cfg, data.total_steps)
    if opt_arrays is not None:
        restore_mlx_optimizer(optimizer, opt_arrays)
    return _Run(model, trainable, optimizer, cfg, data, ckpt, log, bar)


def train(
    model_path: str,
    data_dir: str,
    out_dir: str,
    cfg: TrainConfig,
    resume: bool = False,
    log: Callable[[str], None] = print,
    progress: bool = True,
) -> TrainResult:
    """Train streams on ``model_path`` with ``data_dir``; writes a model directory at ``out_dir``.

    Streams already in the model are trained further (same shape) unless
    ``cfg.new_streams``; ``out_dir`` may be the model's own directory only with
    ``cfg.force``. Everything that would make the end of a run fail is checked
    before the first step."""
    acc = _torch_accelerator() if cfg.backend == "torch" else None
    main = acc is None or acc.is_main_process
    if not main:  # other processes of a multi-process run: silent, they never write
        log, progress = (lambda *_: None), False
    base_dir = resolve_model_path(model_path)
    out = Path(out_dir)
    _check_destination(base_dir, out, cfg, resume)
    loaded = load_model_dir(str(base_dir), warn=False)
    model = loaded.model
    if cfg.mode == "shared" and loaded.config.get("quantization"):
        raise TrainError(
            f"{base_dir}: shared mode fuses a LoRA into the base weights, which needs a float model; "
            "convert it without -q (a GGUF file with --dequantize), or train in lossless mode"
        )
    existing = _adopt_existing_streams(loaded.streams, cfg, log)
    if not cfg.streams:
        cfg.stream_layers = min(cfg.stream_layers, len(model.layers))  # unused by a baseline
    if cfg.stream_layers > len(model.layers):
        raise TrainError(f"--stream-layers {cfg.stream_layers} exceeds the model's {len(model.layers)} layers")
    if cfg.lora_rank > model.args.hidden_size:  # adds no direction, only memory (100,000 had run out of it)
        raise TrainError(f"--lora-rank {cfg.lora_rank} exceeds the model's hidden size {model.args.hidden_size}")
    model.freeze()
    data = _load_data(data_dir, loaded.tokenizer, model.args.vocab_size, cfg, log)
    log(
        f"[train] {cfg.mode} mode, {cfg.backend} backend"
        + (f" ({acc.num_processes} processes)" if acc is not None and acc.num_processes > 1 else "")
        + f", {len(data.train)} train sequences ({data.train.num_tokens:,} tokens), "
        f"{data.total_steps} steps of {cfg.batch_size} x {data.seq_len}, γ={cfg.num_streams}, Ns={cfg.stream_layers}"
    )
    trainable = Trainable(model, cfg)
    if existing is not None:
        trainable.streams.update(existing.parameters())
    if cfg.streams:
        _embedding_settings(model, trainable.streams, existing is not None, data, cfg, resume, log)
    # Lossless streams are tied to the frozen base they learned: record its fingerprint, so
    # they are never attached to another base. (Shared mode writes a new base of its own.)
    from ..io.fingerprint import base_fingerprint

    trainable.streams.config.base_fingerprint = base_fingerprint(base_dir) if cfg.mode == "lossless" else None
    n_train = sum(v.size for _, v in tree_flatten(trainable.trainable_parameters()))
    ckpt = out / "checkpoint"
    if main:  # leftovers of a run that was killed: half-written checkpoints and model directories
        clean_stale_temporaries(out, (".ckpt-", ".model-"))
    step, opt_arrays = 0, None
    if resume:
        found = find_checkpoint(ckpt)
        if found is None:
            raise TrainError(f"--resume: no checkpoint at {ckpt}")
        step, opt_arrays = load_checkpoint(found, trainable, cfg)
        log(f"[train] resumed from {found} at step {step}")
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=data.total_steps, initial=step, desc="train", unit="step", dynamic_ncols=True, file=sys.stderr)
    run = _make_run(model, trainable, cfg, data, ckpt, log, bar, loaded.config, acc, opt_arrays)
    result = TrainResult(out, step, trainable_parameters=n_train)
    mx.reset_peak_memory()
    try:
        run.loop(step)
    except KeyboardInterrupt:
        result.interrupted = True
        if main:
            run.save(run.step)
            log(f"\n[train] interrupted at step {run.step}; checkpoint saved to {ckpt} (continue with --resume)")
    finally:
        if bar:
            bar.close()
    result.steps = run.step
    result.history = run.history
    result.tokens_per_second = run.tokens_seen / max(time.perf_counter() - run.t_start, 1e-9)
    result.peak_memory_gb = run.peak_memory_gb()
    if not result.interrupted and main:
        _finish(run, result, base_dir, out, data_dir, n_train)
        result.written = True
    return result
