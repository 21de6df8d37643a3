"""Prompt-lookup decoding: chain drafts from n-gram matches, verified exactly."""

from __future__ import annotations

from typing import Generator, List, Sequence

import mlx.core as mx
import numpy as np

from ..method.msa import prefix_tree_mask
from ..method.tree import Tree, tree_buffers
from .cache import commit_cache, make_cache
from .sampling import KeyStream, SamplingParams
from .steps import Step, StepInfo, prefill
from .verification import verification_target, verify


def lookup_draft(history: Sequence[int], max_len: int, ngram_max: int = 3, ngram_min: int = 1) -> List[int]:
    """Tokens that followed the most recent earlier occurrence of the longest
    matching suffix n-gram of ``history`` (prompt-lookup decoding)."""
    h = list(history)
    for n in range(ngram_max, ngram_min - 1, -1):
        if len(h) <= n:
            continue
        suffix = h[-n:]
        for start in range(len(h) - n - 1, -1, -1):
            if h[start : start + n] == suffix:
                cont = h[start + n : start + n + max_len]
                if cont:
                    return cont
    return []


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
    history = prompt.tolist()
    prefill(model, prompt[:-1], cache, prefill_chunk)
    root = history[-1]
    while True:
        draft = lookup_draft(history, draft_len)
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
        history.extend(new)
        root = verdict.bonus
        yield Step(new, StepInfo(accepted=verdict.accepted, nodes=len(draft)))
