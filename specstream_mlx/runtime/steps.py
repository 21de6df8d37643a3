"""The step-generator protocol and plain autoregressive decoding.

A decoding engine is a generator that takes prompt ids and yields one
:class:`Step` per target forward pass: the tokens that pass decided and a
typed :class:`StepInfo` of what happened in it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Callable, Generator, Iterator, List, Optional

import mlx.core as mx

from .cache import make_cache
from .plain_step import plain_step
from .sampling import KeyStream, SamplingParams, sample_token


@dataclass
class StepInfo:
    """Facts about one pass (speculative engines fill them; plain steps leave defaults).

    Attributes:
        accepted: draft tokens accepted in this pass (None for plain decoding).
        nodes: draft nodes the pass verified (root excluded), pruned ones included.
        pruned: draft nodes dropped by early-exit pruning before the top layers.
        tree: the draft-tree shape in use, e.g. ``dynamic:8`` or ``auto:dynamic:8``.
        fallback: why decoding switched to plain steps, when it did.
        resync: the device-side accepted node disagreed with host verification
            (never expected; the host verdict was used).
    """

    accepted: Optional[int] = None
    nodes: int = 0
    pruned: int = 0
    tree: Optional[str] = None
    fallback: Optional[str] = None
    resync: bool = False


@dataclass
class Step:
    """What one target forward pass produced."""

    tokens: List[int]
    info: StepInfo = field(default_factory=StepInfo)


def prefill(model, prompt: mx.array, cache, chunk: int = 512) -> None:
    """Run all of ``prompt`` (1-D ids) through the model into ``cache``, in chunks."""
    for start in range(0, prompt.shape[0], chunk):
        model(prompt[start : start + chunk][None], cache=cache)
        mx.eval([c.keys for c in cache])


@lru_cache(maxsize=1)
def _decode_stream():
    """A stream of its own for decoding (as mlx-lm's generation stream), made once: the next
    step's graph is queued there while the host builds the one after it."""
    make = getattr(mx, "new_thread_local_stream", mx.new_stream)
    return make(mx.default_device())


def ar_steps(
    model,
    prompt: mx.array,
    sampling: SamplingParams,
    cache=None,
    prefill_chunk: int = 512,
) -> Generator[Step, None, None]:
    """Plain autoregressive decoding; one token per forward pass (:func:`pipelined_tokens`)."""
    cache = cache if cache is not None else make_cache(model)
    prefill(model, prompt[:-1], cache, prefill_chunk)
    for y in pipelined_tokens(model, prompt[-1:], sampling, cache, KeyStream(sampling.seed)):
        yield Step([y.item()])


def pipelined_tokens(
    model,
    first: mx.array,
    sampling: SamplingParams,
    cache,
    keys: KeyStream,
    n: Optional[int] = None,
    stop: Optional[Callable[[], bool]] = None,
) -> Iterator[mx.array]:
    """Plain decoding from ``first`` (decided, not yet cached): the decided tokens, lazy.

    The next token's pass is queued (``mx.async_eval``) before the current token is
    handed out, so Python work overlaps the model's compute; each pass is one compiled
    graph (:mod:`.plain_step`). With ``n``, stop after ``n`` tokens; with ``stop``, after
    the first token before which it returns True (asked once per token, after the consumer
    has had the previous one). The last token is decided but not run: not in the cache,
    the state a speculative pass starts from."""
    step = plain_step(model)

    def forward(tok: mx.array) -> mx.array:
        with mx.stream(_decode_stream()):
            return sample_token(step(tok, cache), sampling, None if sampling.greedy else keys.next())

    y = forward(first)
    mx.async_eval(y)
    if n is not None and n < 1:
        return
    i = 0
    while True:
        i += 1
        last = (n is not None and i >= n) or (stop is not None and stop())
        if not last:
            nxt = forward(y)
            mx.async_eval(nxt)
        yield y
        if last:
            return
        y = nxt
