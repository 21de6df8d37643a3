"""The training objective: the inference pass, teacher-forced.

1. **Main pass**: every layer over the whole sequence, causally, through the
   one decoder block. It yields the stream-insertion input ``M`` (layer
   N-Ns), each MSA layer's main keys and values (recorded on a
   :class:`KVTape`), and the final main hidden states.
2. **Stream pass**, per segment of stream positions (segment attention, so
   memory grows linearly with the number of positions): ``S[t, j] = M[t] +
   P[j]`` through the MSA layers, again the one decoder block, with the tape
   as the cached prefix: each stream row attends to the main keys at
   positions <= t and to streams (t, 1..j) of its own position, at RoPE
   position t + j: the same rule, mask and positions as inference.

Losses (paper eq. 5): ``α0·CE(main) + Σ_j αj·CE(stream j)``; in lossless mode
α0 = 0, the base is frozen and only stream-row LoRA, the stream embeddings and
the pruning adapter train, and stream (t, j) is also pulled towards the frozen
main stream's own distribution at t + j (self-distillation). The pruning
adapter learns next-token prediction of its early-exit logits.
"""

from __future__ import annotations

from typing import Callable, List, Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..method.streams import (
    LoRAAdapter,
    StreamConfig,
    StreamParams,
    default_targets,
    lora_key,
    make_layer_loras,
    new_streams,
    own_streams_block,
)
from .config import TrainConfig


class Trainable(nn.Module):
    """Everything that trains: streams (P, stream LoRA, pruning) and, in shared
    mode, a LoRA on every layer of the base that main and streams share."""

    def __init__(self, model, cfg: TrainConfig):
        super().__init__()
        targets = tuple(cfg.lora_targets) if cfg.lora_targets else default_targets(model.model_type)
        scfg = StreamConfig(
            num_streams=cfg.num_streams,
            stream_layers=cfg.stream_layers,
            mode=cfg.mode,
            lora_rank=cfg.lora_rank if cfg.mode == "lossless" else 0,
            lora_scale=cfg.lora_scale,
            lora_targets=targets,
            pruning_threshold=cfg.pruning_threshold,
        )
        self.streams = new_streams(model, scfg, seed=cfg.seed)
        self.base_lora = {}
        if cfg.full:
            model.unfreeze()
            self.base = model  # every base weight trains, shared by main and streams
        elif cfg.mode == "shared" and cfg.lora_rank > 0:
            mx.random.seed(cfg.seed + 1)
            self.base_lora = make_layer_loras(model, range(len(model.layers)), targets, cfg.lora_rank, cfg.lora_scale)


class KVTape:
    """The cache the one decoder block writes to during training.

    Empty, it records the keys and values of the main pass; filled, it is the
    cached prefix of the stream pass (which writes no rows to it)."""

    def __init__(self, keys: Optional[mx.array] = None, values: Optional[mx.array] = None):
        self.keys, self.values = keys, values

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        if self.keys is None:
            self.keys, self.values = keys, values
        elif keys.shape[2]:
            raise ValueError("a KV tape is written once")
        return self.keys, self.values

    def frozen(self) -> "KVTape":
        return KVTape(mx.stop_gradient(self.keys), mx.stop_gradient(self.values))


def _adapter(loras: Optional[dict]):
    return LoRAAdapter(loras) if loras else None


def main_pass(model, tokens: mx.array, base_lora: dict, s0: int):
    """All layers over (B, L) tokens causally: (M at layer s0, the MSA layers' KV tapes, final hidden)."""
    B, L = tokens.shape
    positions = model.rotation(mx.broadcast_to(mx.arange(L, dtype=mx.int32)[None], (B, L)))
    h = model.embed(tokens)
    tapes = [KVTape() for _ in range(s0, len(model.layers))]
    h_s0 = None
    for i, layer in enumerate(model.layers):
        if i == s0:
            h_s0 = h
        tape = tapes[i - s0] if i >= s0 else None
        h = layer(h, "causal", tape, positions, _adapter(base_lora.get(lora_key(i))))
    return h_s0, tapes, h


def frozen_head_logits(model, h: mx.array) -> mx.array:
    """The model's final norm and LM head applied to ``h`` with their weights held
    fixed: the pruning adapter learns to read the head, and its loss must not move
    the head or the norm (which it would when the base trains in full-weight mode)."""
    norm = model.model.norm
    head = model.model.embed_tokens if model.args.tie_word_embeddings else model.lm_head
    if isinstance(head, (nn.QuantizedEmbedding, nn.QuantizedLinear)):
        return model.lm_logits(h)  # quantized weights never train
    # Gemma's norm scales by 1 + weight (``offset``); the others by the weight.
    h = mx.fast.rms_norm(h, getattr(norm, "offset", 0.0) + mx.stop_gradient(norm.weight), norm.eps)
    return h @ mx.stop_gradient(head.weight).T


def stream_layer_rms(model, examples, s0: int, max_rows: int = 2048) -> float:
    """Median RMS of the hidden state entering layer ``s0`` over completion positions
    (where streams are hosted) of ``examples``: the scale stream embeddings are drawn at.
    Position 0 is left out: its state is the attention sink, ~50x larger in SmolLM2."""
    rms = []
    for ex in examples:
        n = len(ex.tokens)
        start = max(ex.completion_start - 1, 1)
        if start >= n - 1:
            continue
        h_s0, _, _ = main_pass(model, mx.array(np.asarray(ex.tokens, dtype=np.int32)[None]), {}, s0)
        h = h_s0[0, start : n - 1].astype(mx.float32)
        rms.append(np.array(mx.sqrt(mx.mean(h * h, axis=-1))))
        if sum(len(r) for r in rms) >= max_rows:
            break
    if not rms:
        raise ValueError("no completion positions to measure the hidden-state scale on")
    return float(np.median(np.concatenate(rms)))


def stream_pass(
    model,
    streams: StreamParams,
    h_s0,
    tapes: List[KVTape],
    spos: mx.array,
    lora_for_layer: Callable[[int], Optional[dict]],
):
    """Stream hidden states (B, S, γ, h) for stream positions ``spos`` (B, S)."""
    B, S = spos.shape
    L = h_s0.shape[1]
    gamma = streams.num_streams
    s0 = streams.first_layer
    M = mx.take_along_axis(h_s0, spos[..., None], axis=1)  # (B, S, h)
    x = streams.insert(M).reshape(B, S * gamma, -1)
    js = mx.arange(1, gamma + 1, dtype=mx.int32)
    positions = model.rotation((spos[:, :, None] + js).reshape(B, S * gamma))
    host = mx.repeat(spos, gamma, axis=1)  # (B, R): the position each stream row hangs from
    main_part = mx.arange(L)[None, None, :] <= host[:, :, None]  # (B, R, L)
    own = mx.broadcast_to(mx.array(own_streams_block(S, gamma))[None], (B, S * gamma, S * gamma))
    mask = mx.concatenate([main_part, own], axis=-1)[:, None]  # (B, 1, R, L + R)
    for i in range(s0, len(model.layers)):
        # Every row here is a stream row: the LoRA applies to all of them.
        x = model.layers[i](x, mask, tapes[i - s0], positions, _adapter(lora_for_layer(i)), cached_rows=0)
    return x.reshape(B, S, gamma, -1)


def main_loss(model, cfg: TrainConfig, h_final, tokens, loss_mask):
    """(α0·CE of the main stream, metrics); zero in lossless mode (the base is frozen)."""
    if cfg.mode == "lossless":
        return mx.array(0.0), {}
    lm = loss_mask[:, :-1]
    n_main = mx.maximum(lm.sum(), 1.0)
    logits = model.lm_logits(h_final[:, :-1])
    ce = nn.losses.cross_entropy(logits, tokens[:, 1:]) * lm
    main_ce = ce.sum() / n_main
    acc = ((mx.argmax(logits, axis=-1) == tokens[:, 1:]) * lm).sum() / n_main
    return cfg.alpha_main * main_ce, {"main_ce": main_ce, "main_acc": acc}


def stream_counts(spos, sweight, lengths, gamma: int) -> mx.array:
    """(γ,) valid (position, stream) targets of a batch: every segment's loss normaliser."""
    js = mx.arange(1, gamma + 1, dtype=mx.int32)
    valid = (spos[..., None] + 1 + js < lengths[:, None, None]).astype(mx.float32) * sweight[..., None]
    return mx.maximum(valid.sum(axis=(0, 1)), 1.0)


def segment_loss(model, trainable: Trainable, cfg: TrainConfig, h_s0, tapes, h_final, tokens, sp, w, lengths, n):
    """One segment's share of the stream loss, normalised by the batch's counts ``n``,
    and its (ce, acc, kl) sums per stream."""
    streams = trainable.streams
    gamma = streams.num_streams
    lossless = cfg.mode == "lossless"
    if lossless:
        lora_for_layer = streams.layer_lora
    else:
        lora_for_layer = lambda i: trainable.base_lora.get(lora_key(i))  # noqa: E731
    B, L = tokens.shape
    js = mx.arange(1, gamma + 1, dtype=mx.int32)
    hs = stream_pass(model, streams, h_s0, tapes, sp, lora_for_layer)
    logits = model.lm_logits(hs)  # (B, seg, γ, V)
    tgt_pos = sp[..., None] + 1 + js  # stream (t, j) predicts token t+1+j
    valid = (tgt_pos < lengths[:, None, None]).astype(mx.float32) * w[..., None]
    seg = sp.shape[1]
    tgt = mx.take_along_axis(tokens, mx.clip(tgt_pos, 0, L - 1).reshape(B, -1), axis=1).reshape(B, seg, gamma)
    ce = (nn.losses.cross_entropy(logits, tgt) * valid).sum(axis=(0, 1))
    acc = ((mx.argmax(logits, axis=-1) == tgt) * valid).sum(axis=(0, 1))
    kl = mx.zeros((gamma,))
    loss = ce / n
    if lossless and cfg.distill:
        # The frozen main stream at t+j predicts the same token t+1+j.
        teach_pos = mx.clip(sp[..., None] + js, 0, L - 1).reshape(B, -1)
        th = mx.take_along_axis(h_final, teach_pos[..., None], axis=1).reshape(B, seg, gamma, -1)
        t_logp = mx.stop_gradient(nn.log_softmax(model.lm_logits(th).astype(mx.float32), axis=-1))
        s_logp = nn.log_softmax(logits.astype(mx.float32), axis=-1)
        kl = ((mx.exp(t_logp) * (t_logp - s_logp)).sum(axis=-1) * valid).sum(axis=(0, 1))
        loss = loss + cfg.distill_weight * kl / n
    return cfg.alpha_stream * loss.sum(), (ce, acc, kl)


def prune_loss(model, trainable: Trainable, cfg: TrainConfig, h_s0, tokens, spos, sweight):
    """(weighted loss, CE) of the pruning adapter: early-exit next-token prediction at the
    insertion layer, at the batch's stream positions. Those are the completion positions (a
    uniform sample of them in a long sequence), so this is the completion loss on a subset:
    the adapter is tiny and reads only ``h_s0``, and the head over every position of a batch
    was about a fifth of a lossless step (docs/DESIGN.md)."""
    rows = mx.arange(tokens.shape[0])[:, None]
    h = mx.stop_gradient(h_s0[rows, spos])
    ee = frozen_head_logits(model, trainable.streams.pruning(h))
    prune_ce = (nn.losses.cross_entropy(ee, tokens[rows, spos + 1]) * sweight).sum() / mx.maximum(sweight.sum(), 1.0)
    return cfg.alpha_stream * prune_ce, prune_ce


def stream_metrics(sums, n, cfg: TrainConfig) -> dict:
    """Per-stream means of the (ce, acc, kl) sums. Multiplied by ``1/n`` rather than divided
    by ``n``: ``ce / n`` is also a term of the loss, and under ``mx.compile`` (MLX 0.32) that
    same expression returned outside the gradient graph broke the compiled training step."""
    inv = 1.0 / n
    m = {"stream_ce": sums[0] * inv, "stream_acc": sums[1] * inv}
    if cfg.mode == "lossless" and cfg.distill:
        m["stream_kl"] = sums[2] * inv
    return m


def run_main(model, trainable: Trainable, cfg: TrainConfig, tokens):
    """The main pass's outputs; held fixed (no gradient) in lossless mode."""
    h_s0, tapes, h_final = main_pass(model, tokens, trainable.base_lora, trainable.streams.first_layer)
    if cfg.mode == "lossless":
        h_s0, h_final = mx.stop_gradient(h_s0), mx.stop_gradient(h_final)
        tapes = [t.frozen() for t in tapes]
    return h_s0, tapes, h_final


def compute_loss(model, trainable: Trainable, cfg: TrainConfig, tokens, loss_mask, spos, sweight, lengths):
    """(loss, metrics) of one batch as one graph; see the module docstring (training
    takes the same terms segment by segment: train/segmented.py)."""
    h_s0, tapes, h_final = run_main(model, trainable, cfg, tokens)
    total, metrics = main_loss(model, cfg, h_final, tokens, loss_mask)
    if not cfg.streams:
        metrics["loss"] = total
        return total, metrics
    if cfg.isolate_streams:  # the streams read the main pass but do not train it
        h_s0, tapes = mx.stop_gradient(h_s0), [t.frozen() for t in tapes]
    n = stream_counts(spos, sweight, lengths, trainable.streams.num_streams)
    sums = None
    for s in range(0, spos.shape[1], cfg.segment):
        sl = slice(s, s + cfg.segment)
        loss, parts = segment_loss(
            model, trainable, cfg, h_s0, tapes, h_final, tokens, spos[:, sl], sweight[:, sl], lengths, n
        )
        total = total + loss
        sums = parts if sums is None else tuple(a + b for a, b in zip(sums, parts))
    metrics.update(stream_metrics(sums, n, cfg))
    p_loss, metrics["prune_ce"] = prune_loss(model, trainable, cfg, h_s0, tokens, spos, sweight)
    total = total + p_loss
    metrics["loss"] = total
    return total, metrics
