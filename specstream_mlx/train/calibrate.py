"""Calibrating the early-exit pruning threshold (paper §3.1.3) on held-out data.

Pruning drops a draft child when the early-exit transition probability
``P_ee(child | parent)`` — the pruning adapter's logits at the stream-insertion
layer, through the model's own LM head — is below a threshold. A child that
greedy verification would accept is the main stream's argmax at its parent, so
the threshold is set as the ``1 - keep`` quantile of ``P_ee(argmax | parent)``
over held-out positions: pruning then keeps a fraction ``keep`` of the children
that would have been accepted. The same positions also say how many of the
other likely children (the main stream's runners-up, what a tree drafts besides
the right token) the threshold removes: the rows it saves.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Callable, Optional

import mlx.core as mx
import numpy as np

from ..method.streams import StreamParams
from .data import Dataset, make_batch
from .objective import main_pass


@dataclass
class PruningCalibration:
    """Result of :func:`calibrate_pruning`.

    Attributes:
        threshold: the early-exit probability below which children are pruned.
        keep: the target share of would-be-accepted children kept.
        kept_accepted: measured share of would-be-accepted children that survive.
        pruned_runners_up: measured share of the main stream's 2nd..4th choices pruned.
        positions: held-out positions measured.
    """

    threshold: float
    keep: float
    kept_accepted: float
    pruned_runners_up: float
    positions: int

    def to_json(self) -> dict:
        return asdict(self)


def mlx_top4_probabilities(model, streams: StreamParams, tokens: np.ndarray) -> np.ndarray:
    """(B, L, 4): early-exit probabilities of the main stream's four best choices, best first."""
    h_s0, _, h_final = main_pass(model, mx.array(tokens), {}, streams.first_layer)
    main = model.lm_logits(h_final)
    ee = model.lm_logits(streams.pruning(h_s0))
    p_ee = mx.softmax(ee.astype(mx.float32), axis=-1)
    order = mx.argsort(-main, axis=-1)[..., :4]  # main's choices, best first
    return np.array(mx.take_along_axis(p_ee, order, axis=-1))


def _positions(top4: np.ndarray, mask: np.ndarray):
    """(P_ee of the main argmax, P_ee of the runners-up) at the masked positions."""
    probs = top4[mask.astype(bool)]  # (positions, 4)
    return probs[:, 0], probs[:, 1:].ravel()


def calibrate_pruning(
    model,
    streams: StreamParams,
    ds: Dataset,
    keep: float = 0.98,
    batch_size: int = 8,
    max_positions: int = 8192,
    top4: Optional[Callable[[np.ndarray], np.ndarray]] = None,
) -> PruningCalibration:
    """Threshold keeping ``keep`` of the children greedy verification would accept.

    ``top4(tokens) -> (B, L, 4)`` computes the probabilities (default: this MLX model;
    the torch backend passes its own)."""
    top4 = top4 or (lambda tokens: mlx_top4_probabilities(model, streams, tokens))
    if not 0 < keep <= 1:
        raise ValueError(f"keep must be in (0, 1], got {keep}")
    accepted, runners = [], []
    seen = 0
    for i in range(0, len(ds), batch_size):
        exs = ds.examples[i : i + batch_size]
        seq_len = max(len(e.tokens) for e in exs)
        b = make_batch(exs, seq_len, 1, None)
        a, r = _positions(top4(b.tokens), b.loss_mask)
        accepted.append(a)
        runners.append(r)
        seen += len(a)
        if seen >= max_positions:
            break
    acc = np.concatenate(accepted) if accepted else np.zeros(0)
    run = np.concatenate(runners) if runners else np.zeros(0)
    if not len(acc):
        raise ValueError("no completion positions to calibrate on")
    threshold = float(np.quantile(acc, 1.0 - keep)) if keep < 1 else 0.0
    return PruningCalibration(
        threshold=threshold,
        keep=keep,
        kept_accepted=float((acc >= threshold).mean()),
        pruned_runners_up=float((run < threshold).mean()) if len(run) else 0.0,
        positions=int(len(acc)),
    )
