"""Where a greedy ``ss`` reply and an ``ar`` reply part: a tie of the two best logits.

Greedy ``ss`` takes each token as the argmax of a verification pass's logits, ``ar`` as the
argmax of a plain step's. Both compute the same sums, but a pass multiplies several rows at
once (attention composed over a tree, the cache rows it reads written by earlier passes),
so a logit can differ from the step's in its last bits. Where the two best logits are that
close, which one is larger is the rounding's choice, and the replies part there; anywhere
else they are the same tokens.
:func:`divergence` tells the two cases apart for a reply pair that differs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import mlx.core as mx
import numpy as np

from .cache import make_cache
from .loaded_model import base_model

# Float32 spacings (at the best logit) within which two logits count as tied: room for a few
# roundings, far below any preference a model expresses (at a logit of 32 a spacing is 3.8e-6).
TIE_SPACINGS = 4


@dataclass
class Divergence:
    """The first position where two greedy replies differ, and whether it is a tie.

    Attributes:
        position: index of the first differing token (or the shorter reply's length).
        tie: the two tokens' logits there are within ``TIE_SPACINGS`` float32 spacings of
            the best logit (recomputed in one forward over the prompt and the shared tokens).
        gap: the first reply's token's logit minus the second's, in that forward (None
            where one reply only stops earlier).
    """

    position: int
    tie: bool
    gap: Optional[float]


def first_difference(a: Sequence[int], b: Sequence[int]) -> Optional[int]:
    """Index of the first token where ``a`` and ``b`` differ; None where they are equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def is_rounding_tie(logits: np.ndarray, x: int, y: int, spacings: int = TIE_SPACINGS) -> bool:
    """Whether tokens ``x`` and ``y`` both have logits within ``spacings`` float32 spacings of
    the best one: either may be the argmax of the same sums added in another order."""
    logits = np.asarray(logits, dtype=np.float32)
    best = logits.max()
    tol = spacings * np.spacing(np.abs(best))
    return bool(best - logits[x] <= tol and best - logits[y] <= tol)


def divergence(model, prompt: Sequence[int], first: Sequence[int], second: Sequence[int]) -> Optional[Divergence]:
    """Where the greedy replies ``first`` and ``second`` to ``prompt`` part (None: they do
    not), with the logits there from one forward of ``model`` over the prompt and the tokens
    both replies share."""
    k = first_difference(first, second)
    if k is None:
        return None
    if k >= min(len(first), len(second)):
        return Divergence(k, False, None)  # one stopped (EOS, a limit) where the other went on
    cache = make_cache(model)
    out = model(mx.array([list(prompt) + list(first[:k])]), cache=cache)
    logits = np.array(out[0, -1].astype(mx.float32))
    gap = float(logits[first[k]] - logits[second[k]])
    return Divergence(k, is_rounding_tie(logits, first[k], second[k]), gap)


def parts_at_a_tie(model, prompt: Sequence[int], first: Sequence[int], second: Sequence[int]) -> bool:
    """Whether the greedy replies ``first`` and ``second`` to ``prompt`` part at a tie
    (:func:`divergence`); ``model`` a loaded model or a bare base model."""
    where = divergence(base_model(model), prompt, first, second)
    return bool(where and where.tie)
