"""One verification path for every speculative engine (ss and lookup).

:func:`verification_target` is the lazy device-side result (the target's argmax
per node when greedy; when sampling, per node the first accepted child and the
bonus token of recursive rejection sampling, computed on the device), evaluated
by the engine in the same sync as whatever else the pass needs; :func:`verify`
turns it into the verdict on the host with the pure rules of
:mod:`specstream_mlx.method.acceptance`.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
import numpy as np

from ..method.acceptance import Verdict, child_table, greedy_verify, rrs_decisions, walk_decisions
from ..method.tree import Tree, TreeBuffers
from .sampling import SamplingParams, target_probs


def verification_target(
    main_logits: mx.array,
    sampling: SamplingParams,
    tree: Optional[Tree] = None,
    buffers: Optional[TreeBuffers] = None,
    draft_q: Optional[mx.array] = None,
    key: Optional[mx.array] = None,
    q_rows: Optional[np.ndarray] = None,
) -> mx.array:
    """Greedy: (n,) argmax per node. Sampling: (2, n) per node the first accepted child
    (-1: none) and the bonus token, for ``tree`` whose node i was drawn from
    ``draft_q[q_rows[i]]`` (default: a node at depth d + 1 from ``draft_q[d]``; None: no
    children), with PRNG ``key``. Lazy."""
    if sampling.greedy:
        return mx.argmax(main_logits, axis=-1)
    kids, count = child_table(tree.tokens, buffers)
    rows = buffers.depths if q_rows is None else child_table(q_rows, buffers)[0]
    first, bonus = rrs_decisions(target_probs(main_logits, sampling), draft_q, kids, count, rows, key)
    return mx.stack([first, bonus])


def verify(tree: Tree, buffers: TreeBuffers, sampling: SamplingParams, target: np.ndarray) -> Verdict:
    """The accepted path and bonus token of ``tree`` given the evaluated target."""
    if sampling.greedy:
        return greedy_verify(tree.tokens, buffers.children, target)
    return walk_decisions(buffers.children, target[0], target[1])
