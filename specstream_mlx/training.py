"""Training speculative streams (lossless and shared modes), in MLX.

The forward pass is the inference pass, teacher-forced over a whole sequence:

1. **Main pass**: all layers over the sequence, causally. It yields the
   stream-insertion input ``M`` (layer N-Ns), each MSA layer's main keys and
   values, and the final main hidden states.
2. **Stream pass**, per segment of stream positions (segment attention, so
   memory grows linearly with the number of positions): ``S[t, j] = M[t] +
   P[j]`` run through the MSA layers, each stream row attending to the main
   keys at positions <= t and to streams (t, 1..j) of its own position, at
   RoPE position t + j: the same rule, mask and positions as inference.

Losses (paper eq. 5): ``α0·CE(main) + Σ_j αj·CE(stream j)``; in lossless mode
α0 = 0, the base is frozen and only stream-row LoRA, the stream embeddings and
the pruning adapter train, and stream (t, j) is also pulled towards the frozen
main stream's own distribution at t + j (self-distillation, DESIGN §2.7). The
pruning adapter learns next-token prediction of its early-exit logits.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Callable, Dict, List, Optional

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from .data import Batch, DataError, Dataset, iterate_batches, load_dataset, make_batch
from .streams import (
    LoRA, StreamConfig, StreamParams, default_targets, lora_key, new_streams, save_streams, _find_linear,
    _linear_dims,
)


class TrainError(RuntimeError):
    pass


@dataclass
class TrainConfig:
    """Training settings; defaults follow the paper where it gives them.

    Args:
        mode: "lossless" (frozen base) or "shared" (LoRA shared by main and streams).
        num_streams: γ. Default 4.
        stream_layers: N_s. Default 4.
        lora_rank: LoRA rank. Default 32.
        iters / epochs: length of training (iters wins; default 1 epoch).
        batch_size: sequences per step. Default 8.
        max_seq_len: longer sequences are truncated (and counted). Default 512.
        learning_rate: peak learning rate, decayed linearly to 0. Default 5e-4.
        alpha_main / alpha_stream: α0 and αj. Defaults 1.0 and 0.1 (α0 = 0 in lossless).
        distill: lossless only: add KL to the frozen main distribution at t+j. Default True.
        stream_positions: completion positions per sequence that host streams. Default 64.
        segment: stream positions per segment of the stream pass. Default 32.
    """

    mode: str = "lossless"
    num_streams: int = 4
    stream_layers: int = 4
    lora_rank: int = 32
    lora_scale: float = 2.0
    lora_targets: Optional[List[str]] = None
    iters: Optional[int] = None
    epochs: Optional[float] = None
    batch_size: int = 8
    max_seq_len: int = 512
    learning_rate: float = 5e-4
    warmup: int = 0
    alpha_main: float = 1.0
    alpha_stream: float = 0.1
    distill: bool = True
    distill_weight: float = 1.0
    stream_positions: int = 64
    segment: int = 32
    seed: int = 0
    steps_per_report: int = 10
    steps_per_eval: int = 200
    save_every: int = 100
    val_batches: int = 8
    pruning_threshold: float = 0.0
    compile: bool = True
    # Shared mode only: train every base weight (from-scratch demo models) instead of a LoRA.
    full: bool = False
    # False: a next-token-only baseline (no streams, no stream losses, no stream files).
    streams: bool = True

    def __post_init__(self):
        if self.mode not in ("lossless", "shared"):
            raise ValueError(f"mode must be lossless or shared, got {self.mode!r}")
        if self.full and self.mode != "shared":
            raise ValueError("full training of the base is only meaningful in shared mode")
        if not self.streams and self.mode != "shared":
            raise ValueError("a no-streams baseline trains the base: use shared mode")


class AllRowsLoRA:
    """Adapter adding a layer's LoRA to every row (shared-mode base LoRA, or
    the stream LoRA in the stream pass, whose rows are all stream rows)."""

    def __init__(self, loras: Dict[str, LoRA]):
        self.loras = loras

    def __call__(self, name, x, y):
        lora = self.loras.get(name)
        return y if lora is None else y + lora(x)


class Trainable(nn.Module):
    """Everything that trains: streams (P, stream LoRA, pruning) and, in shared
    mode, a LoRA on every layer of the base that main and streams share."""

    def __init__(self, model, cfg: TrainConfig):
        super().__init__()
        targets = tuple(cfg.lora_targets) if cfg.lora_targets else default_targets(model.model_type)
        scfg = StreamConfig(
            num_streams=cfg.num_streams, stream_layers=cfg.stream_layers, mode=cfg.mode,
            lora_rank=cfg.lora_rank if cfg.mode == "lossless" else 0, lora_scale=cfg.lora_scale,
            lora_targets=targets, pruning_threshold=cfg.pruning_threshold,
        )
        self.streams = new_streams(model, scfg, seed=cfg.seed)
        self.base_lora = {}
        if cfg.full:
            model.unfreeze()
            self.base = model  # every base weight trains, shared by main and streams
        elif cfg.mode == "shared" and cfg.lora_rank > 0:
            mx.random.seed(cfg.seed + 1)
            for i, layer in enumerate(model.layers):
                mods = {}
                for name in targets:
                    lin = _find_linear(layer, name)
                    if lin is not None:
                        d_in, d_out = _linear_dims(lin)
                        mods[name] = LoRA(d_in, d_out, cfg.lora_rank, cfg.lora_scale)
                self.base_lora[lora_key(i)] = mods


def _adapter(loras: Optional[dict]):
    return AllRowsLoRA(loras) if loras else None


def main_pass(model, tokens: mx.array, base_lora: dict, s0: int):
    """All layers over (B, L) tokens causally: (M at layer s0, [(k, v)] of MSA layers, final hidden)."""
    B, L = tokens.shape
    positions = mx.broadcast_to(mx.arange(L, dtype=mx.int32)[None], (B, L))
    h = model.model.embed_tokens(tokens)
    kvs, h_s0 = [], None
    for i, layer in enumerate(model.layers):
        if i == s0:
            h_s0 = h
        ad = _adapter(base_lora.get(lora_key(i)))
        attn = layer.self_attn
        q, k, v = attn.project(layer.input_layernorm(h), positions, ad)
        if i >= s0:
            kvs.append((k, v))
        h = h + attn.attend(q, k, v, "causal", ad)
        h = h + layer.mlp(layer.post_attention_layernorm(h), ad)
    return h_s0, kvs, h


def stream_block_mask(n_pos: int, gamma: int) -> np.ndarray:
    """(R, R), R = n_pos·γ: stream (t, j) sees streams (t, 1..j) of its own position."""
    R = n_pos * gamma
    m = np.zeros((R, R), dtype=bool)
    for t in range(n_pos):
        blk = np.tril(np.ones((gamma, gamma), dtype=bool))
        m[t * gamma : (t + 1) * gamma, t * gamma : (t + 1) * gamma] = blk
    return m


def stream_pass(model, streams: StreamParams, h_s0, kvs, spos: mx.array, lora_for_layer: Callable[[int], Optional[dict]]):
    """Stream hidden states (B, S, γ, h) for stream positions ``spos`` (B, S)."""
    B, S = spos.shape
    L = h_s0.shape[1]
    gamma = streams.num_streams
    s0 = len(model.layers) - streams.config.stream_layers
    M = mx.take_along_axis(h_s0, spos[..., None], axis=1)  # (B, S, h)
    x = (M[:, :, None, :] + streams.embeddings[None, None]).reshape(B, S * gamma, -1)
    js = mx.arange(1, gamma + 1, dtype=mx.int32)
    positions = (spos[:, :, None] + js).reshape(B, S * gamma)
    host = mx.repeat(spos, gamma, axis=1)  # (B, R): the position each stream row hangs from
    main_part = mx.arange(L)[None, None, :] <= host[:, :, None]  # (B, R, L)
    own = mx.broadcast_to(mx.array(stream_block_mask(S, gamma))[None], (B, S * gamma, S * gamma))
    mask = mx.concatenate([main_part, own], axis=-1)[:, None]  # (B, 1, R, L + R)
    for idx, i in enumerate(range(s0, len(model.layers))):
        layer = model.layers[i]
        ad = _adapter(lora_for_layer(i))
        attn = layer.self_attn
        q, k, v = attn.project(layer.input_layernorm(x), positions, ad)
        mk, mv = kvs[idx]
        k = mx.concatenate([mk, k], axis=2)
        v = mx.concatenate([mv, v], axis=2)
        x = x + attn.attend(q, k, v, mask, ad)
        x = x + layer.mlp(layer.post_attention_layernorm(x), ad)
    return x.reshape(B, S, gamma, -1)


def compute_loss(model, trainable: Trainable, cfg: TrainConfig, tokens, loss_mask, spos, sweight, lengths):
    """(loss, metrics) of one batch; see the module docstring."""
    streams = trainable.streams
    gamma = streams.num_streams
    s0 = len(model.layers) - streams.config.stream_layers
    B, L = tokens.shape
    lossless = cfg.mode == "lossless"
    h_s0, kvs, h_final = main_pass(model, tokens, trainable.base_lora, s0)
    if lossless:
        h_s0, h_final = mx.stop_gradient(h_s0), mx.stop_gradient(h_final)
        kvs = [(mx.stop_gradient(k), mx.stop_gradient(v)) for k, v in kvs]
    total = mx.array(0.0)
    metrics = {}
    lm = loss_mask[:, :-1]
    n_main = mx.maximum(lm.sum(), 1.0)
    if not lossless:
        logits = model.lm_logits(h_final[:, :-1])
        ce = nn.losses.cross_entropy(logits, tokens[:, 1:]) * lm
        main_loss = ce.sum() / n_main
        total = total + cfg.alpha_main * main_loss
        metrics["main_ce"] = main_loss
        metrics["main_acc"] = ((mx.argmax(logits, axis=-1) == tokens[:, 1:]) * lm).sum() / n_main

    if not cfg.streams:
        metrics["loss"] = total
        return total, metrics
    if lossless:
        lora_for_layer = lambda i: streams.lora.get(lora_key(i)) if streams.lora else None
    else:
        lora_for_layer = lambda i: trainable.base_lora.get(lora_key(i))
    js = mx.arange(1, gamma + 1, dtype=mx.int32)
    ce_sum = mx.zeros((gamma,))
    kl_sum = mx.zeros((gamma,))
    acc_sum = mx.zeros((gamma,))
    count = mx.zeros((gamma,))
    S = spos.shape[1]
    for s in range(0, S, cfg.segment):
        sp, w = spos[:, s : s + cfg.segment], sweight[:, s : s + cfg.segment]
        hs = stream_pass(model, streams, h_s0, kvs, sp, lora_for_layer)
        logits = model.lm_logits(hs)  # (B, seg, γ, V)
        tgt_pos = sp[..., None] + 1 + js  # stream (t, j) predicts token t+1+j
        valid = (tgt_pos < lengths[:, None, None]).astype(mx.float32) * w[..., None]
        seg = sp.shape[1]
        tgt = mx.take_along_axis(tokens, mx.clip(tgt_pos, 0, L - 1).reshape(B, -1), axis=1).reshape(B, seg, gamma)
        ce = nn.losses.cross_entropy(logits, tgt) * valid
        ce_sum = ce_sum + ce.sum(axis=(0, 1))
        acc_sum = acc_sum + ((mx.argmax(logits, axis=-1) == tgt) * valid).sum(axis=(0, 1))
        count = count + valid.sum(axis=(0, 1))
        if lossless and cfg.distill:
            # The frozen main stream at t+j predicts the same token t+1+j.
            teach_pos = mx.clip(sp[..., None] + js, 0, L - 1).reshape(B, -1)
            th = mx.take_along_axis(h_final, teach_pos[..., None], axis=1).reshape(B, seg, gamma, -1)
            t_logp = mx.stop_gradient(nn.log_softmax(model.lm_logits(th).astype(mx.float32), axis=-1))
            s_logp = nn.log_softmax(logits.astype(mx.float32), axis=-1)
            kl = (mx.exp(t_logp) * (t_logp - s_logp)).sum(axis=-1) * valid
            kl_sum = kl_sum + kl.sum(axis=(0, 1))
    n = mx.maximum(count, 1.0)
    stream_ce = ce_sum / n
    stream_loss = stream_ce + (cfg.distill_weight * kl_sum / n if lossless and cfg.distill else 0.0)
    total = total + cfg.alpha_stream * stream_loss.sum()
    metrics["stream_ce"] = stream_ce
    metrics["stream_acc"] = acc_sum / n
    if lossless and cfg.distill:
        metrics["stream_kl"] = kl_sum / n

    # Pruning adapter: early-exit next-token prediction at the insertion layer.
    ee = model.lm_logits(streams.pruning(mx.stop_gradient(h_s0[:, :-1])))
    prune_ce = (nn.losses.cross_entropy(ee, tokens[:, 1:]) * lm).sum() / n_main
    total = total + cfg.alpha_stream * prune_ce
    metrics["prune_ce"] = prune_ce
    metrics["loss"] = total
    return total, metrics


# --- the loop ------------------------------------------------------------------

@dataclass
class TrainResult:
    out_dir: Path
    steps: int
    interrupted: bool = False
    history: List[dict] = field(default_factory=list)
    val: Optional[dict] = None
    tokens_per_second: float = 0.0
    peak_memory_gb: float = 0.0
    trainable_parameters: int = 0


def _batch_arrays(b: Batch):
    return (mx.array(b.tokens), mx.array(b.loss_mask), mx.array(b.stream_pos),
            mx.array(b.stream_weight), mx.array(b.lengths))


def _to_py(metrics: dict) -> dict:
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
        _, m = compute_loss(model, trainable, cfg, *_batch_arrays(b))
        m = _to_py(m)
        agg = m if agg is None else {k: (np.add(agg[k], m[k])).tolist() for k in agg}
        n += 1
    return {k: (np.array(v) / n).tolist() for k, v in agg.items()} if agg else {}


def _save_checkpoint(ckpt_dir: Path, trainable, optimizer, step: int, cfg: TrainConfig) -> None:
    """Atomic: written to a temporary directory, then renamed over the old one."""
    ckpt_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".ckpt-", dir=ckpt_dir.parent))
    mx.save_safetensors(str(tmp / "trainable.safetensors"), dict(tree_flatten(trainable.parameters())))
    opt_state = {k: v for k, v in tree_flatten(optimizer.state) if isinstance(v, mx.array)}
    mx.save_safetensors(str(tmp / "optimizer.safetensors"), opt_state)
    (tmp / "state.json").write_text(json.dumps({"step": step, "config": asdict(cfg)}, indent=2))
    old = None
    if ckpt_dir.exists():
        old = ckpt_dir.with_name(ckpt_dir.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        os.rename(ckpt_dir, old)
    os.rename(tmp, ckpt_dir)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _load_checkpoint(ckpt_dir: Path, trainable, optimizer) -> int:
    trainable.load_weights(list(mx.load(str(ckpt_dir / "trainable.safetensors")).items()), strict=True)
    opt = mx.load(str(ckpt_dir / "optimizer.safetensors"))
    optimizer.state = tree_unflatten(list(opt.items()))
    return int(json.loads((ckpt_dir / "state.json").read_text())["step"])


def fuse_base_lora(model, base_lora: dict) -> None:
    """Shared mode export: W <- W + scale·(a @ b)ᵀ in every adapted Linear."""
    for i, layer in enumerate(model.layers):
        for name, lora in (base_lora.get(lora_key(i)) or {}).items():
            lin = _find_linear(layer, name)
            if isinstance(lin, nn.QuantizedLinear):
                raise TrainError("shared-mode export into quantized weights is not supported; train on a float model")
            delta = (lora.scale * (lora.a @ lora.b)).T.astype(lin.weight.dtype)
            lin.weight = lin.weight + delta


def write_model_dir(base_dir: Path, out_dir: Path, model, trainable, cfg: TrainConfig, extra: dict) -> None:
    """A complete model directory: base files (fused weights in shared mode) + trained streams."""
    from .convert.converter import TOKENIZER_FILES

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".model-", dir=out_dir))
    for f in sorted(Path(base_dir).iterdir()):
        if f.is_file() and (f.name == "config.json" or f.name in TOKENIZER_FILES or
                            (cfg.mode == "lossless" and f.name.startswith("model") and f.suffix in (".safetensors", ".json"))):
            shutil.copy2(f, tmp / f.name)
    if cfg.mode == "shared":
        fuse_base_lora(model, trainable.base_lora)
        weights = dict(tree_flatten(model.parameters()))
        base_cfg = json.loads((Path(base_dir) / "config.json").read_text())
        dtype = {"float16": mx.float16, "bfloat16": mx.bfloat16}.get(base_cfg.get("torch_dtype"), mx.float32)
        weights = {k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v for k, v in weights.items()}
        mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
    if cfg.streams:
        streams = trainable.streams
        streams.config.trained = True
        streams.config.extra = extra
        save_streams(streams, tmp)
    for f in tmp.iterdir():
        os.replace(f, out_dir / f.name)
    shutil.rmtree(tmp, ignore_errors=True)


def train(
    model_path: str,
    data_dir: str,
    out_dir: str,
    cfg: TrainConfig,
    resume: bool = False,
    log: Callable[[str], None] = print,
    progress: bool = True,
) -> TrainResult:
    """Train streams on ``model_path`` with ``data_dir``; writes a model directory at ``out_dir``."""
    from .loading import load, resolve_model_path

    base_dir = resolve_model_path(model_path)
    model, tokenizer = load(str(base_dir), warn=False)
    if not cfg.streams:
        cfg.stream_layers = min(cfg.stream_layers, len(model.layers))  # unused by a baseline
    if cfg.stream_layers > len(model.layers):
        raise TrainError(f"--stream-layers {cfg.stream_layers} exceeds the model's {len(model.layers)} layers")
    model.freeze()
    train_ds, valid_ds, _ = load_dataset(Path(data_dir), tokenizer, cfg.max_seq_len)
    for ds in (train_ds, valid_ds):
        if ds is not None and ds.truncated:
            log(f"[train] {ds.name}: {ds.truncated} sequences longer than --max-seq-len {cfg.max_seq_len} were truncated")
    if valid_ds is None or not len(valid_ds):
        log("[train] no valid.jsonl examples: validation is skipped")
        valid_ds = None
    longest = max(len(e.tokens) for e in train_ds.examples)
    seq_len = min(cfg.max_seq_len, int(math.ceil(longest / 16) * 16))
    steps_per_epoch = math.ceil(len(train_ds) / cfg.batch_size)
    total = cfg.iters if cfg.iters else max(1, int(round((cfg.epochs or 1.0) * steps_per_epoch)))
    log(f"[train] {cfg.mode} mode, {len(train_ds)} train sequences ({train_ds.num_tokens:,} tokens), "
        f"{total} steps of {cfg.batch_size} x {seq_len}, γ={cfg.num_streams}, Ns={cfg.stream_layers}")

    trainable = Trainable(model, cfg)
    n_train = sum(v.size for _, v in tree_flatten(trainable.trainable_parameters()))
    schedule = optim.linear_schedule(cfg.learning_rate, 0.0, total)
    if cfg.warmup:
        schedule = optim.join_schedules([optim.linear_schedule(1e-8, cfg.learning_rate, cfg.warmup), schedule], [cfg.warmup])
    optimizer = optim.AdamW(learning_rate=schedule, weight_decay=0.0)
    out = Path(out_dir)
    ckpt = out / "checkpoint"
    step = 0
    if resume:
        if not (ckpt / "state.json").exists():
            raise TrainError(f"--resume: no checkpoint at {ckpt}")
        step = _load_checkpoint(ckpt, trainable, optimizer)
        log(f"[train] resumed from {ckpt} at step {step}")

    loss_and_grad = nn.value_and_grad(trainable, lambda *a: compute_loss(model, trainable, cfg, *a))

    def raw_step(*arrays):
        (loss, metrics), grads = loss_and_grad(*arrays)
        optimizer.update(trainable, grads)
        return loss, metrics

    state = [trainable.state, optimizer.state]
    step_fn = mx.compile(raw_step, inputs=state, outputs=state) if cfg.compile else raw_step

    result = TrainResult(out, step, trainable_parameters=n_train)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=total, initial=step, desc="train", unit="step", dynamic_ncols=True, file=sys.stderr)
    mx.reset_peak_memory()
    tokens_seen, t_start = 0, time.perf_counter()
    interrupted = False
    epoch = step // steps_per_epoch
    skip = step % steps_per_epoch
    try:
        while step < total:
            for bi, batch in enumerate(iterate_batches(train_ds, cfg.batch_size, seq_len, cfg.stream_positions, cfg.seed, epoch)):
                if bi < skip:
                    continue
                if step >= total:
                    break
                loss, metrics = step_fn(*_batch_arrays(batch))
                mx.eval(loss, metrics, state)
                lv = float(loss.item())
                if not math.isfinite(lv):
                    where = f"; the last good checkpoint is {ckpt}" if ckpt.exists() else ""
                    raise TrainError(f"loss became {lv} at step {step + 1}; stopping{where}. Try a lower --learning-rate.")
                step += 1
                tokens_seen += int(batch.lengths.sum())
                elapsed = time.perf_counter() - t_start
                if step % cfg.steps_per_report == 0 or step == total:
                    m = _to_py(metrics)
                    rec = {"step": step, "loss": lv, "stream_acc": m.get("stream_acc", []),
                           "stream_ce": m.get("stream_ce", []), "main_acc": m.get("main_acc"),
                           "tokens_per_second": tokens_seen / elapsed}
                    result.history.append(rec)
                    if bar:
                        bar.set_postfix_str(
                            f"loss {lv:.3f} ce " + "/".join(f"{c:.2f}" for c in m.get("stream_ce", []))
                            + " acc " + "/".join(f"{a:.2f}" for a in m.get("stream_acc", []))
                            + f" {tokens_seen / elapsed:,.0f} tok/s"
                        )
                if bar:
                    bar.update(1)
                if valid_ds is not None and step % cfg.steps_per_eval == 0 and step < total:
                    v = evaluate(model, trainable, cfg, valid_ds, seq_len, cfg.val_batches)
                    log(f"[train] step {step}: valid loss {v['loss']:.3f}, stream top-1 "
                        + " ".join(f"{a:.3f}" for a in v.get("stream_acc", [])))
                if step % cfg.save_every == 0 and step < total:
                    _save_checkpoint(ckpt, trainable, optimizer, step, cfg)
            epoch += 1
            skip = 0
    except KeyboardInterrupt:
        interrupted = True
        _save_checkpoint(ckpt, trainable, optimizer, step, cfg)
        log(f"\n[train] interrupted at step {step}; checkpoint saved to {ckpt} (continue with --resume)")
    finally:
        if bar:
            bar.close()
    result.steps = step
    result.interrupted = interrupted
    result.tokens_per_second = tokens_seen / max(time.perf_counter() - t_start, 1e-9)
    result.peak_memory_gb = mx.get_peak_memory() / 1e9
    if interrupted:
        return result
    if valid_ds is not None:
        result.val = evaluate(model, trainable, cfg, valid_ds, seq_len, cfg.val_batches)
        log(f"[train] final valid loss {result.val['loss']:.3f}, stream top-1 "
            + " ".join(f"{a:.3f}" for a in result.val.get("stream_acc", [])))
    extra = {"steps": step, "train_tokens_per_second": result.tokens_per_second,
             "valid": result.val, "data": str(data_dir)}
    write_model_dir(base_dir, out, model, trainable, cfg, extra)
    (out / "training_log.json").write_text(json.dumps(
        {"config": asdict(cfg), "history": result.history, "valid": result.val,
         "tokens_per_second": result.tokens_per_second, "peak_memory_gb": result.peak_memory_gb,
         "trainable_parameters": n_train}, indent=2))
    shutil.rmtree(ckpt, ignore_errors=True)
    log(f"[train] wrote {out} ({n_train:,} trainable parameters, {result.tokens_per_second:,.0f} tok/s, "
        f"peak {result.peak_memory_gb:.2f} GB)")
    return result
