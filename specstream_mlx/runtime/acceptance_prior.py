"""What a model's streams are measured to accept, before any pass is run.

``--tree auto`` learns acceptance from its own passes; before the first one it has
only this prior, measured once on held-out prompts and stored with the streams
(``specstream.json``, ``extra.acceptance``). With it the policy predicts each
budget's tokens per pass and starts where that pays, or decodes plainly from the
first token when nothing is predicted to (:mod:`.autotune`).

The measurement decodes each prompt's greedy reply plainly, then runs the reply
once as a chain "draft" through the speculative pass: every node hosts its
streams, so each reply position gets the stream candidates a real pass would
draft from had that position been the last accepted one.
For each budget b, the dynamic tree that :func:`~.drafting.draft_tree` builds
from those candidates is walked along the reply: the accepted length is what a
greedy pass from that position would accept. The mean over positions is E_b.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Callable, Dict, List, Optional, Sequence

import mlx.core as mx
import numpy as np

from ..method.msa import all_stream_logits, ss_forward
from ..method.tree import Tree, TreeSpec
from .cache import make_cache
from .drafting import Candidates, draft_tree, stream_candidates
from .sampling import SamplingParams
from .steps import ar_steps, prefill

BUDGETS = (2, 4, 8, 12, 16, 24)
CANDIDATES = 8  # top-K per stream, as --tree auto drafts


@dataclass
class AcceptancePrior:
    """Mean accepted draft tokens per greedy pass, per dynamic-tree budget.

    Attributes:
        budgets: budget -> mean accepted tokens (the bonus token not counted).
        positions: reply positions measured.
        prompts: prompts decoded.
        max_tokens: reply length per prompt.
        data: where the prompts came from.
    """

    budgets: Dict[int, float]
    positions: int = 0
    prompts: int = 0
    max_tokens: int = 0
    data: Optional[str] = None
    note: str = field(default="greedy replies; every node hosts streams")

    def to_json(self) -> dict:
        d = asdict(self)
        d["budgets"] = {str(b): round(e, 4) for b, e in sorted(self.budgets.items())}
        return d

    @classmethod
    def from_extra(cls, extra: dict) -> Optional["AcceptancePrior"]:
        """The prior stored in a stream config's ``extra``, or None (absent or malformed:
        a prior is an optimisation, never a reason to refuse a model)."""
        d = extra.get("acceptance") if isinstance(extra, dict) else None
        if not isinstance(d, dict) or not isinstance(d.get("budgets"), dict):
            return None
        try:
            budgets = {int(b): float(e) for b, e in d["budgets"].items()}
        except (TypeError, ValueError):
            return None
        if not budgets or any(not (0.0 <= e < 64) for e in budgets.values()):
            return None
        return cls(budgets, int(d.get("positions", 0) or 0), int(d.get("prompts", 0) or 0))

    def expected(self, budget: int) -> float:
        """E_b for any budget: measured, else interpolated between measured budgets
        (flat beyond them; acceptance grows with the budget and saturates)."""
        if budget in self.budgets:
            return self.budgets[budget]
        xs = sorted(self.budgets)
        return float(np.interp(budget, xs, [self.budgets[x] for x in xs]))


def accepted_length(tree: Tree, continuation: Sequence[int]) -> int:
    """Draft tokens a greedy pass accepts: the longest path from the root whose tokens
    are the target's continuation."""
    children: Dict[int, Dict[int, int]] = {}
    for i in range(1, len(tree)):
        children.setdefault(tree.parents[i], {})[tree.tokens[i]] = i
    node, n = 0, 0
    for tok in continuation:
        nxt = children.get(node, {}).get(int(tok))
        if nxt is None:
            break
        node, n = nxt, n + 1
    return n


def measure_acceptance(
    model,
    prompts: List[mx.array],
    max_tokens: int = 64,
    budgets: Sequence[int] = BUDGETS,
    stop_tokens: Sequence[int] = (),
    progress: Optional[Callable[[int, int], None]] = None,
) -> AcceptancePrior:
    """Measure :class:`AcceptancePrior` of a :class:`~.loaded_model.SpeculativeModel` on
    ``prompts`` (1-D id arrays), greedy replies of up to ``max_tokens`` (ending at
    the first of ``stop_tokens``)."""
    greedy = SamplingParams()
    sums = {b: 0.0 for b in budgets}
    positions = 0
    for i, ids in enumerate(prompts):
        reply: List[int] = []
        stop = set(int(t) for t in stop_tokens)
        for step in ar_steps(model.base, ids, greedy):
            reply.extend(step.tokens)
            if len(reply) >= max_tokens or stop.intersection(step.tokens):
                break
        ended = bool(stop.intersection(reply[:max_tokens]))
        reply = reply[:max_tokens]
        # The reply as a chain rooted at the last prompt token: node d is reply token d-1.
        tokens = (int(ids[-1].item()), *reply)
        chain = Tree(tokens, tuple(range(-1, len(tokens) - 1)))
        cache = make_cache(model.base)
        prefill(model.base, ids[:-1], cache)
        out = ss_forward(model.base, model.streams, chain, cache[0].offset, cache)
        cand = stream_candidates(
            all_stream_logits(model.base, model.streams, out), CANDIDATES, greedy, vocab=model.streams.draft_vocab
        )
        mx.eval(*cand.arrays())
        cand = cand.to_host()  # (nodes, γ, K)
        gamma = cand.top.shape[1]
        # Had node n been the last accepted one, the pass's bonus token is reply token n + 1
        # (the next tree's root) and node n's streams draft the tokens after it. A reply that
        # stopped has its continuation known to the end: the positions before the stop count
        # too, accepting no more than is left, as the passes that end a real reply do (on
        # demo-sql's 15-token replies leaving them out overstated a pass's acceptance 1.5x).
        # A reply cut at max_tokens counts only positions whose continuation is known γ deep.
        last = len(tokens) - 1 if ended else len(tokens) - gamma - 1
        for node in range(0, last):
            cont = tokens[node + 2 : node + 2 + gamma]
            for b in budgets:
                spec = TreeSpec("dynamic", budget=b, depth=gamma)
                tree = draft_tree(tokens[node + 1], Candidates(cand.top[node], cand.ptop[node]), spec, greedy).tree
                sums[b] += accepted_length(tree, cont)
            positions += 1
        if progress:
            progress(i + 1, len(prompts))
    if positions == 0:
        raise ValueError(f"no reply position to measure: replies need more than {model.streams.num_streams} tokens")
    return AcceptancePrior({b: s / positions for b, s in sums.items()}, positions, len(prompts), max_tokens)
