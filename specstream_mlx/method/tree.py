"""Draft trees: pure functions from a tree to the buffers a forward pass needs.

A tree is flattened in breadth-first order; node 0 is the root (the token that
is already decided: the last prompt token or the previous step's bonus token).
Every other node is a draft token whose parent precedes it. Nothing here
touches a model: tokens and probabilities go in, numpy buffers come out.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from functools import lru_cache
from typing import List, Optional, Sequence

import numpy as np


@dataclass(frozen=True)
class Tree:
    """A flattened draft tree. ``parents[0] == -1``; ``parents[i] < i``."""

    tokens: tuple
    parents: tuple

    def __post_init__(self):
        if len(self.tokens) != len(self.parents) or not self.tokens:
            raise ValueError("a tree needs one parent per token and at least a root")
        if self.parents[0] != -1:
            raise ValueError("node 0 must be the root (parent -1)")
        for i, p in enumerate(self.parents[1:], 1):
            if not 0 <= p < i:
                raise ValueError(f"node {i} has parent {p}; parents must precede children")

    def __len__(self) -> int:
        return len(self.tokens)

    @staticmethod
    def chain(tokens: Sequence[int]) -> "Tree":
        """A single path: the shape of prompt-lookup or single-stream drafts."""
        return Tree(tuple(int(t) for t in tokens), tuple(range(-1, len(tokens) - 1)))


@dataclass(frozen=True)
class TreeBuffers:
    """What a forward pass over a flattened tree needs.

    Attributes:
        depths: (n,) depth of each node; its RoPE position is ``offset + depth``.
        ancestor_mask: (n, n) bool; ``[i, j]`` is True when j is i or an ancestor of i.
        parents: (n,) parent index, -1 for the root.
        children: per node, the indices of its children in order.
        child_index: (n, W) the same as a table, -1 past the last (W: the most children any
            node has); with ``child_count`` (n,) it gathers per-pass child tables.
    """

    depths: np.ndarray
    ancestor_mask: np.ndarray
    parents: np.ndarray
    children: tuple
    child_index: np.ndarray
    child_count: np.ndarray


def tree_buffers(parents: Sequence[int]) -> TreeBuffers:
    """Buffers of the tree with these parents; built once per tree shape (cached)."""
    return _tree_buffers(tuple(int(p) for p in parents))


@lru_cache(maxsize=1024)
def _tree_buffers(parents: tuple) -> TreeBuffers:
    n = len(parents)
    par = np.asarray(parents, dtype=np.int64)
    depths = np.zeros(n, dtype=np.int32)
    anc = np.zeros((n, n), dtype=bool)
    children: List[List[int]] = [[] for _ in range(n)]
    for i in range(n):
        anc[i, i] = True
        p = par[i]
        if p >= 0:
            depths[i] = depths[p] + 1
            anc[i] |= anc[p]
            children[p].append(i)
    W = max((len(c) for c in children), default=0)
    index = np.full((n, W), -1, dtype=np.int64)
    for i, kids in enumerate(children):
        index[i, : len(kids)] = kids
    count = np.array([len(c) for c in children], dtype=np.int32)
    for a in (depths, anc, par, index, count):
        a.flags.writeable = False  # shared by every pass over this shape
    return TreeBuffers(depths, anc, par, tuple(tuple(c) for c in children), index, count)


def subtree_keep(parents: Sequence[int], keep_node: Sequence[bool]) -> np.ndarray:
    """Nodes kept after pruning: a node stays when it and all its ancestors pass.

    The root always stays (it is already decided)."""
    keep = np.zeros(len(parents), dtype=bool)
    keep[0] = True
    for i in range(1, len(parents)):
        keep[i] = bool(keep_node[i]) and keep[parents[i]]
    return keep


def restrict(tree: Tree, keep: np.ndarray) -> "tuple[Tree, np.ndarray]":
    """The kept subtree, re-indexed; also the original index of each kept node."""
    idx = np.flatnonzero(keep)
    remap = {int(o): k for k, o in enumerate(idx)}
    parents = tuple(-1 if tree.parents[o] < 0 else remap[tree.parents[o]] for o in idx)
    tokens = tuple(tree.tokens[o] for o in idx)
    return Tree(tokens, parents), idx


def endpoint_probabilities(parents: Sequence[int], reach: Sequence[float]) -> np.ndarray:
    """P(node i is the last accepted node) from ``reach[i]`` = P(the path to i is
    accepted) (1 for the root): reach[i] minus the reach of its children."""
    e = np.asarray(reach, dtype=np.float64).copy()
    for i in range(1, len(parents)):
        e[parents[i]] -= reach[i]
    return np.clip(e, 0.0, None)


def hosting_nodes(parents: Sequence[int], reach: Sequence[float], m: int) -> np.ndarray:
    """The nodes that host streams under a hosting policy, in node order: the root
    and the ``m`` other nodes most likely to be the last accepted one (where the
    next draft's streams are needed). The root always hosts, so every accepted
    node has a hosting ancestor whose later streams can still draft."""
    e = endpoint_probabilities(parents, reach)
    e[0] = np.inf
    return np.sort(np.argsort(-e, kind="stable")[: m + 1])


# --- drafters --------------------------------------------------------------


# Tokens of an n-gram continuation a ``+lookup`` tree merges in (prompt-lookup's usual draft).
LOOKUP_LEN = 5
# The most draft nodes a tree may have. Each node is a row through every layer and the
# LM head, and the tree mask is nodes x nodes: trees that pay hold tens of nodes (the method's
# paper, Medusa's and EAGLE's trees under 100; ``--tree auto`` tries up to 24), while a
# mistyped ``cartesian:1000x1000`` (a million rows) had run the machine out of memory.
MAX_DRAFT_NODES = 512


def draft_nodes(widths: Sequence[int]) -> int:
    """Draft nodes of a Cartesian tree (root excluded), counted no further than just past
    :data:`MAX_DRAFT_NODES`."""
    total, level = 0, 1
    for w in widths:
        level *= w
        total += level
        if total > MAX_DRAFT_NODES:
            break
    return total


@dataclass(frozen=True)
class TreeSpec:
    """Shape of the draft tree.

    Args:
        kind: "cartesian" (top-k per stream, every node expanded: the paper's
            tree) or "dynamic" (the ``budget`` nodes of highest cumulative
            stream probability).
        widths: children per node at each depth for "cartesian", e.g. (3, 2, 1)
            gives 1 + 3 + 6 + 6 nodes. Length is the tree depth (<= streams).
        budget: draft nodes (root excluded) for "dynamic".
        depth: deepest level for "dynamic" (<= streams).
        hosting: the hosting mode: streams only at the root and this many other nodes
            (the most likely last accepted ones); 0 hosts them at every node.
        lookup: "dynamic" only: draft up to this many tokens of an n-gram continuation
            (prompt lookup over the prompt and the reply so far) in the tree, under the
            same budget, scored by the lookup's measured hit rate; 0 for none.
    """

    kind: str = "dynamic"
    widths: tuple = (3, 2, 1, 1)
    budget: int = 12
    depth: int = 4
    hosting: int = 0
    lookup: int = 0

    def __post_init__(self):
        # A spec that would draft nothing is a mistake, not a root-only pass.
        if self.kind not in ("cartesian", "dynamic"):
            raise ValueError(f"tree kind must be cartesian or dynamic, got {self.kind!r}")
        if self.kind == "cartesian" and (not self.widths or min(self.widths) < 1):
            raise ValueError(f"{self.describe()}: every width must be at least 1 (and there must be one)")
        if self.kind == "dynamic" and (self.budget < 1 or self.depth < 1):
            raise ValueError(f"{self.describe()}: the budget and the depth must be at least 1")
        asked = draft_nodes(self.widths) if self.kind == "cartesian" else max(self.budget, self.lookup)
        if asked > MAX_DRAFT_NODES:
            raise ValueError(f"{self.describe()}: over {MAX_DRAFT_NODES} draft nodes; trees that pay hold tens")
        if self.hosting < 0:
            raise ValueError(f"{self.describe()}: the number of hosting nodes must be at least 0")
        if self.lookup < 0 or (self.lookup and self.kind != "dynamic"):
            raise ValueError(f"{self.describe()}: lookup branches need a dynamic tree and a length of at least 1")

    @property
    def max_depth(self) -> int:
        # A dynamic tree of b nodes is at most b deep.
        return len(self.widths) if self.kind == "cartesian" else min(self.depth, self.budget)

    def describe(self) -> str:
        at = f"@{self.hosting}" if self.hosting else ""
        if self.kind == "cartesian":
            return "cartesian:" + "x".join(str(w) for w in self.widths) + at
        depth = f",{self.depth}" if self.depth != 4 else ""
        lookup = "" if not self.lookup else "+lookup" if self.lookup == LOOKUP_LEN else f"+lookup:{self.lookup}"
        return f"dynamic:{self.budget}{depth}{lookup}{at}"

    @staticmethod
    def parse(text: str) -> "TreeSpec":
        """``cartesian:3x2x1``, ``topk:3,4`` (k, depth), ``dynamic:12`` or ``chain:4``,
        each optionally followed by ``@M``: streams hosted at the M likeliest endpoints;
        a dynamic tree also by ``+lookup`` or ``+lookup:N``: n-gram continuation branches."""
        from dataclasses import replace

        body, at, count = text.partition("@")
        if at:
            try:
                m = int(count)
            except ValueError:
                m = -1
            if m < 1 and "+" in count:  # dynamic:8@1+lookup: the suffixes in the wrong order
                fixed = f"{body}+{count.partition('+')[2]}@{count.partition('+')[0]}"
                raise ValueError(f"bad tree spec {text!r}: +lookup goes before @M ({fixed!r})")
            if m < 1:
                raise ValueError(f"bad tree spec {text!r}: @M needs a positive number of hosting nodes")
            return replace(TreeSpec.parse(body), hosting=m)
        body, plus, extra = text.partition("+")
        if plus:
            name, colon, n = extra.partition(":")
            try:
                length = int(n) if colon else LOOKUP_LEN
            except ValueError:
                length = -1
            if name != "lookup" or length < 1:
                raise ValueError(f"bad tree spec {text!r}: use +lookup or +lookup:N (N >= 1) after a dynamic tree")
            base = TreeSpec.parse(body)
            if base.kind != "dynamic":
                raise ValueError(f"bad tree spec {text!r}: lookup branches need a dynamic tree")
            try:
                return replace(base, lookup=length)
            except ValueError as e:
                raise ValueError(f"bad tree spec {text!r}: {str(e).partition(': ')[2]}") from None
        kind, _, arg = text.partition(":")
        try:
            fields = TreeSpec._fields(kind, arg)
        except ValueError:
            fields = None
        if fields is not None:
            if kind == "topk" and fields["widths"] and fields["widths"][0] < 1:
                raise ValueError(f"bad tree spec {text!r}: K must be at least 1")
            if kind == "topk" and not fields["widths"]:
                raise ValueError(f"bad tree spec {text!r}: DEPTH must be at least 1")
            if kind == "chain" and not fields["widths"]:
                raise ValueError(f"bad tree spec {text!r}: N must be at least 1")
            try:
                return TreeSpec(**fields)
            except ValueError as e:
                raise ValueError(f"bad tree spec {text!r}: {str(e).partition(': ')[2]}") from None
        raise ValueError(
            f"bad tree spec {text!r}; use cartesian:3x2x1, topk:K,DEPTH, chain:N, dynamic:BUDGET[,DEPTH] "
            "(each optionally @M: streams at the M likeliest endpoints) or auto"
        )

    @staticmethod
    def _fields(kind: str, arg: str) -> Optional[dict]:
        """The constructor arguments a spec's text names (unchecked), or None for an unknown kind."""
        if kind == "cartesian":
            return dict(kind="cartesian", widths=tuple(int(w) for w in arg.split("x")))
        if kind == "topk":
            k, d = (int(x) for x in arg.split(","))
            return dict(kind="cartesian", widths=(k,) * max(d, 0))
        if kind == "chain":
            return dict(kind="cartesian", widths=(1,) * max(int(arg), 0))
        if kind == "dynamic":
            budget, _, depth = arg.partition(",")
            return dict(kind="dynamic", budget=int(budget), depth=int(depth) if depth else 4)
        return None


def cartesian_tree(root: int, candidates: Sequence[Sequence[int]], widths: Sequence[int]) -> Tree:
    """Children at depth g are the first ``widths[g-1]`` candidates of stream g,
    under every node of depth g-1. ``candidates[g-1]`` are stream g's tokens in
    preference order (top-k when greedy, i.i.d. draws when sampling)."""
    tokens, parents = [root], [-1]
    level = [0]
    for g, w in enumerate(widths):
        nxt = []
        for p in level:
            for tok in candidates[g][:w]:
                tokens.append(int(tok))
                parents.append(p)
                nxt.append(len(tokens) - 1)
        level = nxt
    return Tree(tuple(tokens), tuple(parents))


def dynamic_candidates(tokens: np.ndarray, probs: np.ndarray, budget: int):
    """Best-first expansion of the stream candidates: up to ``budget`` nodes as
    (token, parent, score) in decreasing score order; parent 0 is the root and
    node i+1 is the i-th entry. The tree of any smaller budget b is exactly
    the first b entries, since every prefix of a path scores at least as high.

    ``tokens``/``probs``: (depth, K) stream candidates sorted by descending
    probability; a path's score is the product of its tokens' probabilities.
    Popping a node pushes its first child and its next sibling."""
    depth, K = tokens.shape
    out = []
    heap = []
    counter = 0
    if depth > 0 and K > 0:
        heapq.heappush(heap, (-float(probs[0, 0]), counter, 0, 0, 0, 1.0))
    while heap and len(out) < budget:
        neg, _, g, r, parent, pscore = heapq.heappop(heap)
        score = -neg
        out.append((int(tokens[g, r]), parent, score))
        node = len(out)
        if r + 1 < K:
            counter += 1
            heapq.heappush(heap, (-(pscore * float(probs[g, r + 1])), counter, g, r + 1, parent, pscore))
        if g + 1 < depth:
            counter += 1
            heapq.heappush(heap, (-(score * float(probs[g + 1, 0])), counter, g + 1, 0, node, score))
    return out


def dynamic_tree(root: int, tokens: np.ndarray, probs: np.ndarray, budget: int, candidates=None) -> Tree:
    """The ``budget`` paths of highest cumulative probability, as a BFS-ordered tree."""
    cands = (candidates if candidates is not None else dynamic_candidates(tokens, probs, budget))[:budget]
    return _bfs_order([root] + [c[0] for c in cands], [-1] + [c[1] for c in cands])


def merge_chain(tree: Tree, scores: Sequence[float], chain: Sequence[int], chain_scores: Sequence[float], budget: int):
    """A draft tree with a chain of tokens (an n-gram continuation) merged in from the root,
    and the ``budget`` best nodes of the union kept: returns ``(tree, scores)``, BFS-ordered.

    ``scores``: per node of ``tree``, its path's probability of acceptance (1 at the root);
    ``chain_scores[k]``: the chain's for its first k + 1 tokens (non-increasing). A chain
    token a node already has as a child joins that child (its score the larger of the two);
    the rest hang below it as new nodes. Both sources score a node no higher than its
    parent, so the best ``budget`` nodes (ties broken by depth) include every ancestor."""
    tokens, parents = list(tree.tokens), list(tree.parents)
    score = [float(x) for x in scores]
    depth = [0] * len(tokens)
    child = {}
    for i in range(1, len(tokens)):
        depth[i] = depth[parents[i]] + 1
        child[(parents[i], tokens[i])] = i
    node = 0
    for tok, sc in zip(chain, chain_scores):
        nxt = child.get((node, int(tok)))
        if nxt is None:
            tokens.append(int(tok))
            parents.append(node)
            score.append(float(sc))
            depth.append(depth[node] + 1)
            nxt = len(tokens) - 1
            child[(node, int(tok))] = nxt
        else:
            score[nxt] = max(score[nxt], float(sc))
        node = nxt
    best = sorted(range(1, len(tokens)), key=lambda i: (-score[i], depth[i], i))[:budget]
    keep = sorted([0] + best)
    remap = {o: k for k, o in enumerate(keep)}
    kept_parents = [-1 if parents[o] < 0 else remap[parents[o]] for o in keep]
    order = _bfs_permutation(kept_parents)
    return _bfs_order([tokens[o] for o in keep], kept_parents), np.array([score[keep[o]] for o in order])


def _bfs_permutation(parents: Sequence[int]) -> List[int]:
    """The old index of each node of the breadth-first order (siblings keep their order)."""
    children = [[] for _ in parents]
    for i, p in enumerate(parents):
        if p >= 0:
            children[p].append(i)
    order = [0]
    k = 0
    while k < len(order):
        order.extend(children[order[k]])
        k += 1
    return order


def _bfs_order(tokens: List[int], parents: List[int]) -> Tree:
    """Re-order a tree so nodes are breadth-first and siblings keep their order."""
    order = _bfs_permutation(parents)
    new_index = {o: k for k, o in enumerate(order)}
    return Tree(
        tuple(tokens[o] for o in order),
        tuple(-1 if parents[o] < 0 else new_index[parents[o]] for o in order),
    )
