"""Sampling: the target distribution after temperature / top-k / top-p, and draws.

Every function is pure and takes an explicit PRNG key, so a seed fixes a run.
The same ``target_logprobs`` is applied to every distribution that takes part
in speculative acceptance, which is what keeps speculative sampling lossless.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import mlx.core as mx

from ..io.limits import SEED_MAX

GREEDY_BELOW = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. ``temperature == 0`` means greedy (argmax).

    Temperatures below ``GREEDY_BELOW`` (1e-5) are treated as greedy too:
    dividing float32 logits by them overflows, and the distribution they
    describe is the argmax anyway.

    Args:
        temperature: softmax temperature; 0 (or < 1e-5) for greedy. Default 0.
        top_p: nucleus mass kept (1.0 keeps everything). Default 1.0.
        top_k: keep the k most likely tokens (0 keeps everything). Default 0.
        seed: PRNG seed for sampling; None draws one from the clock.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: Optional[int] = None

    def __post_init__(self):
        # NaN fails every comparison: check for it explicitly.
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not math.isfinite(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        # MLX's PRNG keys take 64 unsigned bits (a chat's reply n uses seed + n, wrapped at SEED_MAX).
        if self.seed is not None and not 0 <= self.seed <= SEED_MAX:
            raise ValueError(f"seed must be an integer from 0 to {SEED_MAX}, got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


def processed_logits(logits: mx.array, params: SamplingParams) -> mx.array:
    """Logits (..., V) after temperature, top-k and top-p; removed tokens get -inf."""
    logits = logits.astype(mx.float32)
    if params.temperature > 0:
        logits = logits / params.temperature
    V = logits.shape[-1]
    if 0 < params.top_k < V:
        # k-th largest value per row; everything strictly below it goes.
        kth = mx.sort(logits, axis=-1)[..., V - params.top_k : V - params.top_k + 1]
        logits = mx.where(logits < kth, -mx.inf, logits)
    if params.top_p < 1.0:
        order = mx.argsort(-logits, axis=-1)
        sorted_logits = mx.take_along_axis(logits, order, axis=-1)
        probs = mx.softmax(sorted_logits, axis=-1)
        # Keep a token if the mass strictly before it is < top_p (the first always stays).
        before = mx.cumsum(probs, axis=-1) - probs
        keep_sorted = before < params.top_p
        inverse = mx.argsort(order, axis=-1)
        keep = mx.take_along_axis(keep_sorted, inverse, axis=-1)
        logits = mx.where(keep, logits, -mx.inf)
    return logits


def target_logprobs(logits: mx.array, params: SamplingParams) -> mx.array:
    """Log-probabilities (..., V) after temperature, top-k and top-p; removed tokens get -inf."""
    logits = processed_logits(logits, params)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def target_probs(logits: mx.array, params: SamplingParams) -> mx.array:
    """The target distribution (..., V) after temperature, top-k and top-p. One
    exponential per element (a softmax), not two (exp of log-probabilities): over a
    real vocabulary and a tree's rows, the exponentials are what sampled passes cost."""
    return mx.softmax(processed_logits(logits, params), axis=-1)


def sample_token(logits: mx.array, params: SamplingParams, key: Optional[mx.array]) -> mx.array:
    """One token per row of ``logits`` (..., V): argmax when greedy, else a draw."""
    if params.greedy:
        return mx.argmax(logits, axis=-1)
    return mx.random.categorical(target_logprobs(logits, params), key=key)


class KeyStream:
    """Successive independent PRNG keys from one seed."""

    def __init__(self, seed: Optional[int]):
        if seed is None:
            import time

            seed = time.time_ns() % (2**63)
        self._key = mx.random.key(seed)

    def next(self) -> mx.array:
        self._key, sub = mx.random.split(self._key)
        return sub
