"""Tree buffers and drafters, without a model."""

import re

import numpy as np
import pytest

from specstream_mlx.method.msa import msa_tree_part
from specstream_mlx.method.tree import (
    Tree,
    TreeSpec,
    cartesian_tree,
    dynamic_tree,
    restrict,
    subtree_keep,
    tree_buffers,
)


def leaf_paths(buffers) -> tuple:
    """Root-to-leaf node index paths, one per leaf (in node order of the leaves): the
    reference the tree tests read buffers with."""
    par = buffers.parents
    paths = []
    for leaf in (i for i, c in enumerate(buffers.children) if not c):
        path = [leaf]
        while par[path[-1]] >= 0:
            path.append(int(par[path[-1]]))
        paths.append(tuple(reversed(path)))
    return tuple(paths)


def test_buffers_of_a_small_tree():
    #        0
    #      1   2
    #     3 4   5
    parents = [-1, 0, 0, 1, 1, 2]
    b = tree_buffers(parents)
    assert b.depths.tolist() == [0, 1, 1, 2, 2, 2]
    assert b.children == ((1, 2), (3, 4), (5,), (), (), ())
    assert leaf_paths(b) == ((0, 1, 3), (0, 1, 4), (0, 2, 5))
    assert b.ancestor_mask[4].tolist() == [True, True, False, False, True, False]
    assert b.ancestor_mask[5].tolist() == [True, False, True, False, False, True]
    # Ancestor mask is reflexive and lower-triangular for a BFS-ordered tree.
    assert np.all(np.diag(b.ancestor_mask)) and not np.triu(b.ancestor_mask, 1).any()


def test_chain_is_causal():
    b = tree_buffers(Tree.chain([5, 6, 7, 8]).parents)
    assert (b.ancestor_mask == np.tril(np.ones((4, 4), bool))).all()


def test_invalid_trees_are_refused():
    with pytest.raises(ValueError):
        Tree((1, 2), (0, 0))
    with pytest.raises(ValueError):
        Tree((1, 2, 3), (-1, 2, 0))


def test_cartesian_tree_sizes():
    cands = [[10, 11, 12], [20, 21, 22], [30, 31, 32]]
    t = cartesian_tree(0, cands, (3, 2, 1))
    assert len(t) == 1 + 3 + 6 + 6
    b = tree_buffers(t.parents)
    assert b.depths.tolist().count(3) == 6
    # Every depth-2 node carries one of stream 2's first two candidates.
    assert {t.tokens[i] for i in range(len(t)) if b.depths[i] == 2} == {20, 21}


def test_dynamic_tree_keeps_highest_cumulative_paths():
    tokens = np.array([[1, 2, 3], [4, 5, 6]])
    probs = np.array([[0.6, 0.3, 0.1], [0.9, 0.05, 0.05]])
    t = dynamic_tree(0, tokens, probs, budget=3)
    # Scores: 1:.6, 1->4:.54, 2:.3, 2->4:.27, 3:.1 ...  -> top 3 = {1, 1->4, 2}
    b = tree_buffers(t.parents)
    paths = {tuple(t.tokens[i] for i in p) for p in leaf_paths(b)}
    assert paths == {(0, 1, 4), (0, 2)}
    assert len(t) == 4
    # Exhaustive check against brute force on random inputs.
    rng = np.random.default_rng(0)
    for _ in range(50):
        D, K, budget = 3, 3, int(rng.integers(1, 15))
        p = np.sort(rng.dirichlet(np.ones(K), size=D), axis=1)[:, ::-1]
        tok = np.arange(D * K).reshape(D, K)
        t = dynamic_tree(-1, tok, p, budget)
        got = sorted(_scores(t, tok, p), reverse=True)
        every = sorted(_all_scores(p, D, K), reverse=True)[:budget]
        assert np.allclose(got, every)


def _scores(t, tok, p):
    where = {int(tok[g, r]): p[g, r] for g in range(tok.shape[0]) for r in range(tok.shape[1])}
    s = [1.0] * len(t)
    for i in range(1, len(t)):
        s[i] = s[t.parents[i]] * where[t.tokens[i]]
    return s[1:]


def _all_scores(p, D, K):
    out, frontier = [], [1.0]
    for g in range(D):
        frontier = [f * p[g, r] for f in frontier for r in range(K)]
        out += frontier
    return out


def test_pruning_drops_whole_subtrees():
    parents = [-1, 0, 0, 1, 1, 2]
    keep = subtree_keep(parents, [True, False, True, True, True, True])
    assert keep.tolist() == [True, False, True, False, False, True]
    t = Tree((9, 1, 2, 3, 4, 5), tuple(parents))
    sub, idx = restrict(t, keep)
    assert sub.tokens == (9, 2, 5) and sub.parents == (-1, 0, 1) and idx.tolist() == [0, 2, 5]


def test_msa_mask_layout():
    anc = tree_buffers([-1, 0]).ancestor_mask  # root and one child
    m = msa_tree_part(anc, gamma=2)
    # rows/keys: main0 main1 s(0,1) s(0,2) s(1,1) s(1,2)
    assert m[0].tolist() == [1, 0, 0, 0, 0, 0]
    assert m[1].tolist() == [1, 1, 0, 0, 0, 0]  # main never sees streams
    assert m[2].tolist() == [1, 0, 1, 0, 0, 0]
    assert m[3].tolist() == [1, 0, 1, 1, 0, 0]  # stream 2 sees stream 1 of its node
    assert m[4].tolist() == [1, 1, 0, 0, 1, 0]  # never other nodes' streams
    assert m[5].tolist() == [1, 1, 0, 0, 1, 1]


@pytest.mark.parametrize("text,nodes", [("cartesian:3x2x1", 16), ("topk:2,3", 15), ("chain:4", 5), ("dynamic:12", 13)])
def test_tree_spec_parse(text, nodes):
    """The parsed spec drafts trees of the expected size."""
    spec = TreeSpec.parse(text)
    top = np.arange(100, 140).reshape(4, 10)
    probs = np.tile(np.linspace(0.5, 0.01, 10), (4, 1))
    if spec.kind == "cartesian":
        t = cartesian_tree(0, top, spec.widths)
    else:
        t = dynamic_tree(0, top[: spec.max_depth], probs[: spec.max_depth], spec.budget)
    assert len(t) == nodes


def test_tree_spec_parse_error():
    with pytest.raises(ValueError, match="bad tree spec"):
        TreeSpec.parse("bushy")


@pytest.mark.parametrize(
    "text, rule",
    [
        ("dynamic:0", "the budget and the depth must be at least 1"),
        ("dynamic:-3", "the budget and the depth must be at least 1"),
        ("dynamic:4,0", "the budget and the depth must be at least 1"),
        ("topk:0,3", "K must be at least 1"),
        ("topk:3,0", "DEPTH must be at least 1"),
        ("chain:0", "N must be at least 1"),
        ("cartesian:2x0", "every width must be at least 1"),
    ],
)
def test_tree_specs_that_would_draft_nothing_are_refused(text, rule):
    """Such specs used to run root-only passes silently (chain:0: an empty max())."""
    with pytest.raises(ValueError, match=f"bad tree spec '{re.escape(text)}': {rule}"):
        TreeSpec.parse(text)
    with pytest.raises(ValueError, match="at least"):
        TreeSpec("dynamic", budget=0)


@pytest.mark.parametrize(
    "text", ["cartesian:1000x1000", "cartesian:8x8x8", "dynamic:513", "dynamic:100000@1", "dynamic:8+lookup:1000"]
)
def test_trees_beyond_any_that_pays_are_refused_before_a_pass(text):
    """`generate --tree cartesian:1000x1000` had asked for a million rows a pass: the
    process grew to the machine's 24 GB and was killed; `dynamic:100000` took 4.5 GB."""
    named = text.partition("@")[0]  # the tree, without its hosting suffix
    with pytest.raises(ValueError, match=f"bad tree spec '{re.escape(named)}': over 512 draft nodes"):
        TreeSpec.parse(text)


@pytest.mark.parametrize("widths", [(3, 2, 1), (4, 4, 4, 4), (8, 8, 7)])
def test_the_draft_node_bound_counts_the_nodes_a_cartesian_spec_drafts(widths):
    """340 nodes (4x4x4x4) are taken, 520 (8x8x7) refused: the bound counts what is drafted."""
    from specstream_mlx.method.tree import MAX_DRAFT_NODES, draft_nodes

    nodes = len(cartesian_tree(0, np.zeros((len(widths), max(widths)), int), widths)) - 1  # root excluded
    assert draft_nodes(widths) == nodes
    text = "cartesian:" + "x".join(map(str, widths))
    if nodes <= MAX_DRAFT_NODES:
        assert TreeSpec.parse(text).widths == widths
    else:
        with pytest.raises(ValueError, match="over 512 draft nodes"):
            TreeSpec.parse(text)


def test_suffixes_in_the_wrong_order_are_refused_with_the_right_order():
    """`dynamic:8@1+lookup` used to say only that @M needs a positive number."""
    with pytest.raises(ValueError, match=re.escape("+lookup goes before @M ('dynamic:8+lookup@1')")):
        TreeSpec.parse("dynamic:8@1+lookup")
    spec = TreeSpec.parse("dynamic:8+lookup@1")
    assert spec.hosting == 1 and spec.lookup and spec.budget == 8


def test_hosting_policy_buffers():
    """Endpoint probabilities, the hosting nodes, their mask rows and stream sources."""
    from specstream_mlx.method.msa import stream_sources
    from specstream_mlx.method.tree import endpoint_probabilities, hosting_nodes

    #      0
    #    1   2
    #   3     4
    parents = [-1, 0, 0, 1, 2]
    reach = [1.0, 0.6, 0.3, 0.5, 0.1]
    e = endpoint_probabilities(parents, reach)
    assert np.allclose(e, [0.1, 0.1, 0.2, 0.5, 0.1])
    assert hosting_nodes(parents, reach, 2).tolist() == [0, 2, 3]  # the root always hosts
    assert hosting_nodes(parents, reach, 1).tolist() == [0, 3]
    b = tree_buffers(parents)
    hosts = np.array([2, 3])
    m = msa_tree_part(b.ancestor_mask, 2, hosts)
    assert m.shape == (5 + 2 * 2, 5 + 2 * 2)
    assert m[5, :5].tolist() == [1, 0, 1, 0, 0]  # stream 1 of node 2 sees 0 and 2
    assert m[7, :5].tolist() == [1, 1, 0, 1, 0]  # stream 1 of node 3 sees 0, 1, 3
    assert m[8, 5:].tolist() == [0, 0, 1, 1]  # stream 2 of node 3: its own streams 1..2
    slot, shift = stream_sources(b.parents, b.depths, hosts)
    # Node 4 (depth 2) has hosting ancestor 2 (depth 1): its streams from j = 2 on.
    assert slot.tolist() == [-1, -1, 0, 1, 0] and shift.tolist() == [0, 0, 0, 0, 1]


def test_tree_spec_hosting_suffix():
    spec = TreeSpec.parse("dynamic:8@2")
    assert spec.kind == "dynamic" and spec.budget == 8 and spec.hosting == 2
    assert spec.describe() == "dynamic:8@2"
    assert TreeSpec.parse("cartesian:3x2@1").hosting == 1
    with pytest.raises(ValueError, match="@M"):
        TreeSpec.parse("dynamic:8@0")


def test_merge_chain_joins_shared_prefixes_and_keeps_the_best_nodes():
    from specstream_mlx.method.tree import merge_chain, tree_buffers

    # root 5 -> 7 (0.6) -> 8 (0.3); root -> 9 (0.2)
    tree = Tree((5, 7, 9, 8), (-1, 0, 0, 1))
    scores = [1.0, 0.6, 0.2, 0.3]
    # The chain 7, 4, 4 shares node 7 and adds two nodes below it.
    merged, s = merge_chain(tree, scores, [7, 4, 4], [0.9, 0.5, 0.25], budget=4)
    paths = {}
    for i in range(len(merged)):
        path, j = [], i
        while j >= 0:
            path.append(merged.tokens[j])
            j = merged.parents[j]
        paths[tuple(reversed(path))] = s[i]
    # Kept: the best 4 of {7: 0.9, 7-4: 0.5, 7-8: 0.3, 7-4-4: 0.25, 9: 0.2}; 7's score is the larger.
    assert paths == {(5,): 1.0, (5, 7): 0.9, (5, 7, 4): 0.5, (5, 7, 8): 0.3, (5, 7, 4, 4): 0.25}
    b = tree_buffers(merged.parents)
    assert list(b.depths) == sorted(b.depths)  # breadth-first
    # A budget too small for the chain's tail keeps every kept node's ancestors.
    small, _ = merge_chain(tree, scores, [3, 3, 3], [0.4, 0.35, 0.1], budget=3)
    assert len(small) == 4 and all(p < i for i, p in enumerate(small.parents))
    assert set(zip(small.tokens, small.parents)) >= {(3, 0)}
    # No chain: the tree itself.
    same, s2 = merge_chain(tree, scores, [], [], budget=3)
    assert same == tree and list(s2) == scores


@pytest.mark.parametrize("V", [300, 49_152, 50_001])
@pytest.mark.parametrize("K", [1, 8, 40])
def test_top_k_by_blocks_finds_the_largest_logits(V, K):
    """The two-stage top-K (blocks' maxima, then the best blocks' entries; the last block
    padded when the vocabulary is not a whole number of blocks) selects the K largest
    values of every row, as a full sort does; small vocabularies take one partition."""
    import mlx.core as mx

    from specstream_mlx.runtime.drafting import top_k_indices

    rng = np.random.default_rng(V + K)
    # Many near-equal values in a few blocks: the K largest crowd into fewer than K blocks.
    logits = rng.normal(size=(3, V)).astype(np.float32)
    logits[0, :K] += 10.0
    logits[1, -K:] += 10.0  # the padded last block
    got = np.array(top_k_indices(mx.array(logits), K))
    assert got.shape == (3, K) and all(len(set(r)) == K for r in got.tolist())
    want = -np.sort(-logits, axis=-1)[:, :K]
    np.testing.assert_array_equal(np.sort(np.take_along_axis(logits, got, -1), -1), np.sort(want, -1))


def test_greedy_candidates_are_the_softmax_top_k():
    import mlx.core as mx

    from specstream_mlx.runtime.drafting import stream_candidates
    from specstream_mlx.runtime.sampling import SamplingParams

    logits = mx.array(np.random.default_rng(0).normal(size=(2, 4, 5000)).astype(np.float32) * 4)
    cand = stream_candidates(logits, 6, SamplingParams())
    probs = np.array(mx.softmax(logits, axis=-1))
    order = np.argsort(-probs, axis=-1)[..., :6]
    np.testing.assert_array_equal(np.array(cand.top), order)
    np.testing.assert_allclose(np.array(cand.ptop), np.take_along_axis(probs, order, -1), rtol=1e-5, atol=1e-7)
