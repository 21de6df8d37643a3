"""Prompt-lookup decoding: chain drafts from n-gram matches, verified exactly."""

from __future__ import annotations

from typing import Dict, Generator, List, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np

from ..method.msa import prefix_tree_mask
from ..method.tree import Tree, tree_buffers
from .cache import commit_cache, make_cache
from .sampling import KeyStream, SamplingParams
from .steps import Step, StepInfo, prefill
from .verification import verification_target, verify


class NgramIndex:
    """Prompt-lookup drafts: the tokens that followed the most recent earlier occurrence
    of the longest matching suffix n-gram of the history (n from ``ngram_max`` down).

    O(1) per query: for each n, the latest start of every n-gram of the history that has
    a continuation, updated as tokens are appended (a scan of a 2,000-token prompt per pass
    would cost about a millisecond, a GPU pass's whole time)."""

    def __init__(self, history: Sequence[int] = (), ngram_max: int = 3, ngram_min: int = 1):
        self.ngram_max, self.ngram_min = ngram_max, ngram_min
        self.history: List[int] = []
        self._starts: Dict[int, Dict[Tuple[int, ...], int]] = {n: {} for n in range(ngram_min, ngram_max + 1)}
        self.extend(history)

    def extend(self, tokens: Sequence[int]) -> None:
        h = self.history
        for tok in tokens:
            h.append(int(tok))
            t = len(h) - 1  # the n-grams ending just before t now have a continuation
            for n, starts in self._starts.items():
                if t - n >= 0:
                    starts[tuple(h[t - n : t])] = t - n

    def draft(self, max_len: int) -> List[int]:
        """Up to ``max_len`` tokens continuing the history so far (none without a match)."""
        h = self.history
        for n in range(self.ngram_max, self.ngram_min - 1, -1):
            if len(h) <= n:
                continue
            start = self._starts[n].get(tuple(h[-n:]))
            if start is not None:
                return h[start + n : start + n + max_len]
        return []


class HitRates:
    """How often a request's n-gram continuations are right: ``first`` the rate at which a
    continuation's first token is the one decoding decided, ``later`` the rate for each
    further token given the ones before it matched (a copied span tends to go on). Both
    start at Beta(1, 1) ([hits, tries])."""

    def __init__(self):
        self.first = [1, 2]
        self.later = [1, 2]

    def scores(self, length: int) -> List[float]:
        """Path scores of a continuation of ``length`` tokens: the chance that each of its
        prefixes is right."""
        p1, p2 = self.first[0] / self.first[1], self.later[0] / self.later[1]
        return [p1 * p2**k for k in range(length)]

    def count(self, chain: Sequence[int], tokens: Sequence[int]) -> None:
        """Count a continuation against the tokens decoding decided after it."""
        for k, (want, got) in enumerate(zip(chain, tokens)):
            rate = self.first if k == 0 else self.later
            rate[1] += 1
            if want != got:
                break
            rate[0] += 1


class LookupBranch:
    """The n-gram continuation a ``+lookup`` tree merges in, with its measured hit rates.

    Scores are calibrated on the request itself (``rates``, shared with the request's
    :class:`LookupReplay`: what lookup passes replayed over its plain tokens showed counts
    as what its real passes show). Every pass's decided tokens count, whether or not the
    continuation's nodes made it into the tree."""

    def __init__(self, length: int, rates: Optional[HitRates] = None):
        self.length = length
        self.index: Optional[NgramIndex] = None
        self.rates = rates if rates is not None else HitRates()
        self.chain: List[int] = []

    def propose(self, decided: Sequence[int]) -> "tuple[List[int], List[float]]":
        """The continuation of ``decided`` (prompt and reply so far) and its path scores."""
        if self.index is None:
            self.index = NgramIndex(decided)
        else:
            self.index.extend(decided[len(self.index.history) :])
        self.chain = self.index.draft(self.length)
        return self.chain, self.rates.scores(len(self.chain))

    def observe(self, tokens: Sequence[int]) -> None:
        """Count the last proposal against the tokens its pass decided."""
        self.rates.count(self.chain, tokens)
        self.chain = []

    def forget(self) -> None:
        """Drop the last proposal unjudged (plain steps decided the tokens after it)."""
        self.chain = []


class LookupReplay:
    """What lookup passes would have accepted over tokens decoded without them. Greedy
    decoding decides the same tokens whichever way it drafts, so the passes can be replayed
    exactly: a pass at position ``p`` drafts the continuation of ``decided[:p]``, accepts
    its longest prefix that ``decided[p:]`` repeats (``a`` tokens) and decides ``a + 1``.
    Each replayed continuation is counted in ``rates`` as a real pass's would be: the
    request's lookup branch scores its continuations by them. (Without them, a branch that
    began after a replayed copy scored its continuations by the prior alone; on SmolLM2's
    copying demo prompt, with a lookup pass's stored cost at 2.76 plain steps, no
    continuation cleared that gate, no pass ran to re-time the arm, and the reply decoded
    plainly while prompt lookup alone ran 1.6-1.9x as fast.)"""

    def __init__(self, length: int):
        self.length = length
        self.index = NgramIndex()
        self.pos = 0  # where the next replayed pass starts
        self.rates = HitRates()

    def replay(self, decided: Sequence[int], start: int) -> List[int]:
        """Accepted lengths of the passes whose tokens are all decided, from ``start`` (the
        first token decided without passes) or where the last replayed pass ended."""
        self.pos = max(self.pos, start)
        out = []
        while self.pos >= 1 and self.pos + self.length < len(decided):
            self.index.extend(decided[len(self.index.history) : self.pos])
            chain = self.index.draft(self.length)
            a = 0
            while a < len(chain) and chain[a] == decided[self.pos + a]:
                a += 1
            self.rates.count(chain, decided[self.pos : self.pos + len(chain)])
            out.append(a)
            self.pos += a + 1
        return out


def lookup_steps(
    model,
    prompt: mx.array,
    sampling: SamplingParams,
    cache=None,
    draft_len: int = 5,
    prefill_chunk: int = 512,
) -> Generator[Step, None, None]:
    """Prompt-lookup decoding verified exactly like ``ss`` (lossless)."""
    cache = cache if cache is not None else make_cache(model)
    keys = KeyStream(sampling.seed)
    index = NgramIndex(prompt.tolist())
    prefill(model, prompt[:-1], cache, prefill_chunk)
    root = index.history[-1]
    while True:
        draft = index.draft(draft_len)
        tree = Tree.chain([root] + draft)
        buf = tree_buffers(tree.parents)
        offset = cache[0].offset
        positions = mx.array((offset + buf.depths)[None].astype(np.int32))
        mask = prefix_tree_mask(offset, buf.ancestor_mask)
        logits = model(mx.array([tree.tokens], dtype=mx.int32), cache=cache, positions=positions, mask=mask)[0]
        # A deterministic draft is a one-hot proposal: accept x with prob p(x).
        q = None
        if not sampling.greedy and draft:
            q = (mx.arange(logits.shape[-1])[None] == mx.array(draft)[:, None]).astype(mx.float32)
        target = verification_target(logits, sampling, tree, buf, q, None if sampling.greedy else keys.next())
        mx.eval(target)
        verdict = verify(tree, buf, sampling, np.array(target))
        commit_cache(cache, verdict.path)
        new = [tree.tokens[i] for i in verdict.path[1:]] + [verdict.bonus]
        index.extend(new)
        root = verdict.bonus
        yield Step(new, StepInfo(accepted=verdict.accepted, nodes=len(draft)))
