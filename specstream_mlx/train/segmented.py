"""An MLX training step whose memory is bounded by one segment of stream positions.

The stream pass is the largest part of a training step: (1+γ)·N_s rows per
stream position. Differentiated as one graph, every segment's activations are
alive at once. Here the main pass runs once (its outputs evaluated), then each
segment's loss is differentiated and evaluated on its own, its gradients
added to a running sum, so only one segment's graph exists at a time.

Lossless mode: the main pass is frozen, the segments' gradients are the
whole gradient. Shared mode: the base LoRA also receives gradient through the
main pass's outputs (the insertion-layer input and the MSA layers' keys and
values). Those output gradients are summed over segments, then sent through
the main pass in one backward pass of ``main loss + Σ <output, its gradient>``
(a vector-Jacobian product as a scalar loss), which recomputes the main
forward pass once: the price of not holding its graph across segments.
"""

from __future__ import annotations

from typing import List

import mlx.core as mx
from mlx.utils import tree_map

from .config import TrainConfig
from .objective import (
    KVTape,
    Trainable,
    main_loss,
    main_pass,
    prune_loss,
    run_main,
    segment_loss,
    stream_counts,
    stream_metrics,
)


def _flatten(h_s0, tapes: List[KVTape], h_final) -> list:
    return [h_s0, h_final] + [a for t in tapes for a in (t.keys, t.values)]


def _unflatten(arrays: list):
    tapes = [KVTape(arrays[i], arrays[i + 1]) for i in range(2, len(arrays), 2)]
    return arrays[0], tapes, arrays[1]


def _add(a, b):
    return b if a is None else tree_map(mx.add, a, b)


class SegmentedStep:
    """``step(tokens, loss_mask, spos, sweight, lengths) -> (loss, metrics)``: one optimizer update."""

    def __init__(self, model, trainable: Trainable, optimizer, cfg: TrainConfig):
        self.model, self.trainable, self.optimizer, self.cfg = model, trainable, optimizer, cfg
        self.shared = cfg.mode != "lossless"
        # Shared mode also needs the gradient w.r.t. the main outputs (argument 1), unless the
        # streams are isolated from the main pass (then the main loss alone trains it).
        self.through_main = self.shared and not cfg.isolate_streams
        self.seg_grad = mx.value_and_grad(self._segment, argnums=(0, 1) if self.through_main else 0)
        self.main_grad = mx.grad(self._main_surrogate)

    def _segment(self, params, main: list, tokens, sp, w, lengths, n, prune_at):
        self.trainable.update(params)
        h_s0, tapes, h_final = _unflatten(main)
        loss, parts = segment_loss(
            self.model, self.trainable, self.cfg, h_s0, tapes, h_final, tokens, sp, w, lengths, n
        )
        prune_ce = mx.array(0.0)
        if prune_at is not None:  # the pruning adapter's loss rides on the first segment
            p_loss, prune_ce = prune_loss(self.model, self.trainable, self.cfg, h_s0, tokens, *prune_at)
            loss = loss + p_loss
        return loss, (parts, prune_ce)

    def _main_surrogate(self, params, tokens, loss_mask, cotangents: list):
        self.trainable.update(params)
        h_s0, tapes, h_final = main_pass(
            self.model, tokens, self.trainable.base_lora, self.trainable.streams.first_layer
        )
        term, _ = main_loss(self.model, self.cfg, h_final, tokens, loss_mask)
        outs = _flatten(h_s0, tapes, h_final)
        return term + sum((o * c).sum() for o, c in zip(outs, cotangents) if c is not None)

    def __call__(self, tokens, loss_mask, spos, sweight, lengths):
        total, metrics, grads = self.loss_and_grad(tokens, loss_mask, spos, sweight, lengths)
        self.optimizer.update(self.trainable, grads)
        return total, metrics

    def loss_and_grad(self, tokens, loss_mask, spos, sweight, lengths):
        """(loss, metrics, gradients of the trainable parameters), segment by segment."""
        cfg, trainable = self.cfg, self.trainable
        params = trainable.trainable_parameters()
        h_s0, tapes, h_final = run_main(self.model, trainable, cfg, tokens)
        main = [mx.stop_gradient(a) for a in _flatten(h_s0, tapes, h_final)]
        total, metrics = main_loss(self.model, cfg, h_final, tokens, loss_mask)
        mx.eval(main, total, metrics)
        n = stream_counts(spos, sweight, lengths, trainable.streams.num_streams)
        grads = cots = sums = None
        for s in range(0, spos.shape[1], cfg.segment):
            sl = slice(s, s + cfg.segment)
            prune_at = (spos, sweight) if s == 0 else None
            args = (params, main, tokens, spos[:, sl], sweight[:, sl], lengths, n, prune_at)
            (loss, (parts, prune_ce)), g = self.seg_grad(*args)
            if self.through_main:
                g, g_main = g
                cots = _add(cots, g_main)
            grads = _add(grads, g)
            sums = parts if sums is None else tuple(a + b for a, b in zip(sums, parts))
            total = total + loss
            if s == 0:
                metrics["prune_ce"] = prune_ce
            mx.eval(grads, cots, sums, total)  # frees this segment's graph
        if self.shared:
            grads = _add(grads, self.main_grad(params, tokens, loss_mask, cots or []))
        trainable.update(params)
        metrics.update(stream_metrics(sums, n, cfg))
        metrics["loss"] = total
        return total, metrics, grads
