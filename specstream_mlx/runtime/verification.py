"""One verification path for every speculative engine (ss and lookup).

:func:`verification_target` is the lazy device-side input (the target's
argmax when greedy, its processed distribution when sampling), evaluated by
the engine in the same sync as whatever else the pass needs;
:func:`verify` applies the pure rule of :mod:`specstream_mlx.method.acceptance`
on the host.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
import numpy as np

from ..method.acceptance import Verdict, greedy_verify, sample_verify
from ..method.tree import Tree, TreeBuffers
from .sampling import SamplingParams, target_probs


def verification_target(main_logits: mx.array, sampling: SamplingParams) -> mx.array:
    """(n,) argmax per node when greedy, else (n, V) target probabilities; lazy."""
    if sampling.greedy:
        return mx.argmax(main_logits, axis=-1)
    return target_probs(main_logits, sampling)


def verify(
    tree: Tree,
    buffers: TreeBuffers,
    sampling: SamplingParams,
    target: np.ndarray,
    draft_q: Optional[np.ndarray],
    rng: np.random.Generator,
) -> Verdict:
    """The accepted path and bonus token of ``tree`` given the evaluated target.

    ``draft_q``: (depth, V) distributions the children at each depth were
    drawn from (sampling only; None when the tree has no drafts)."""
    if sampling.greedy:
        return greedy_verify(tree.tokens, buffers.children, target)
    if draft_q is None:
        draft_q = np.zeros((0, target.shape[1]))
    return sample_verify(tree.tokens, buffers.children, buffers.depths, target, draft_q, rng)
