"""Sampling stays lossless: the acceptance rule and whole ss generations."""

import itertools

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_unflatten

from specstream_mlx.method.acceptance import child_table, greedy_verify, rrs_decisions, walk_decisions
from specstream_mlx.method.tree import tree_buffers


def exact_rrs_output(p, q, k):
    """Output distribution of RRS with k i.i.d. drafts from q, computed exactly:
    sum over every draft tuple of its probability times the (analytic) output
    distribution of the trials."""
    V = len(p)
    total = np.zeros(V)
    for drafts in itertools.product(range(V), repeat=k):
        w = np.prod([q[x] for x in drafts])
        if w == 0:
            continue
        cur, reach = p.copy(), 1.0
        for x in drafts:
            acc = min(1.0, cur[x] / q[x])
            total[x] += w * reach * acc
            reach *= 1 - acc
            r = np.maximum(cur - q, 0)
            if r.sum() > 0:
                cur = r / r.sum()
        total += w * reach * cur
    return total


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("k", [1, 2, 3])
def test_rrs_is_exact_in_closed_form(seed, k):
    rng = np.random.default_rng(seed)
    p = rng.dirichlet(np.ones(5) * 0.7)
    q = rng.dirichlet(np.ones(5) * 0.7)
    q[rng.integers(5)] = 0  # drafts may miss tokens the target likes
    q /= q.sum()
    assert np.allclose(exact_rrs_output(p, q, k), p, atol=1e-12)


def rrs_on_device(p, q, drafts, seed):
    """Tokens out of single nodes, one per row of ``drafts`` (children drawn from ``q``),
    all verified by one :func:`rrs_decisions` call: a child's token, or the bonus."""
    n, k = drafts.shape
    first, bonus = rrs_decisions(
        mx.array(np.tile(p, (n, 1)), dtype=mx.float32),
        mx.array(q[None], dtype=mx.float32),
        drafts.astype(np.int32),
        np.full(n, k, dtype=np.int32),
        np.zeros(n, dtype=np.int32),
        mx.random.key(seed),
    )
    first, bonus = np.array(first), np.array(bonus)
    return np.where(first >= 0, drafts[np.arange(n), np.maximum(first, 0)], bonus)


@pytest.mark.parametrize("k", [1, 3])
def test_device_rrs_matches_the_target_distribution(k):
    """The implementation (not the formula) produces p: chi-square over 40k nodes, with a
    proposal that misses a token the target likes and favours ones it does not."""
    from scipy.stats import chisquare

    rng = np.random.default_rng(0)
    p = np.array([0.4, 0.25, 0.2, 0.1, 0.05])
    q = np.array([0.0, 0.1, 0.1, 0.4, 0.4])
    n = 40000
    drafts = rng.choice(5, size=(n, k), p=q)
    out = rrs_on_device(p, q, drafts, seed=k)
    assert chisquare(np.bincount(out, minlength=5), p * n).pvalue > 1e-3
    # ... and differently from the proposal: the first draft is not simply kept.
    assert np.mean(out == drafts[:, 0]) < 0.6


def test_device_rrs_keeps_the_first_accepted_child_and_stops_at_leaves():
    """A proposal equal to the target accepts the first child always; a leaf's bonus comes
    from its own target; padding past a node's children is never tried."""
    p = np.array([[0.1, 0.2, 0.3, 0.4], [0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 1.0]])
    kids = np.array([[1, 3], [0, 0], [0, 0]], dtype=np.int32)
    first, bonus = rrs_decisions(
        mx.array(p, dtype=mx.float32),
        mx.array(p[:1], dtype=mx.float32),  # q == p at the root
        kids,
        np.array([2, 0, 0], dtype=np.int32),
        np.array([0, 1, 1], dtype=np.int32),
        mx.random.key(0),
    )
    assert np.array(first).tolist() == [0, -1, -1] and np.array(bonus)[1:].tolist() == [2, 3]
    b = tree_buffers([-1, 0, 0])
    v = walk_decisions(b.children, np.array(first), np.array(bonus))
    assert v.path == [0, 1] and v.bonus == 2 and v.accepted == 1


def test_sampled_verification_on_a_tree_matches_target_two_tokens():
    """Two-token outputs of device RRS over depth-2 trees equal the target's joint: 20k
    trees verified in one call (their nodes side by side), walked on the host."""
    from scipy.stats import chisquare

    rng = np.random.default_rng(1)
    V, n = 3, 20000
    p_root = np.array([0.5, 0.3, 0.2])
    p_child = {t: rng.dirichlet(np.ones(V)) for t in range(V)}
    q = np.array([[0.2, 0.2, 0.6], [0.6, 0.3, 0.1]])
    b = tree_buffers([-1, 0, 0, 1, 2])
    d1 = rng.choice(V, size=(n, 2), p=q[0])
    d2 = rng.choice(V, size=n, p=q[1])
    tokens = np.stack([np.full(n, 9), d1[:, 0], d1[:, 1], d2, d2], axis=1)  # (n, 5)
    uniform = np.ones(V) / V
    target = np.stack([p_root[None].repeat(n, 0), p_child_rows(p_child, d1[:, 0]), p_child_rows(p_child, d1[:, 1])])
    target = np.concatenate([target, np.stack([uniform[None].repeat(n, 0)] * 2)]).transpose(1, 0, 2)  # (n, 5, V)
    kids, count = child_table(tokens[0].tolist(), b)  # the shape every tree shares
    kid_tokens = np.zeros((n, 5, kids.shape[1]), dtype=np.int32)
    for node, children in enumerate(b.children):
        for j, c in enumerate(children):
            kid_tokens[:, node, j] = tokens[:, c]
    first, bonus = rrs_decisions(
        mx.array(target.reshape(-1, V), dtype=mx.float32),
        mx.array(q, dtype=mx.float32),
        kid_tokens.reshape(n * 5, -1),
        np.tile(count, n),
        np.tile(b.depths, n),
        mx.random.key(3),
    )
    first, bonus = np.array(first).reshape(n, 5), np.array(bonus).reshape(n, 5)
    counts = np.zeros((V, V))
    for i in range(n):
        v = walk_decisions(b.children, first[i], bonus[i])
        out = [int(tokens[i, j]) for j in v.path[1:]] + [v.bonus]
        if len(out) == 1:  # need the second token: continue from the bonus
            out.append(int(rng.choice(V, p=p_child[out[0]])))
        counts[out[0], out[1]] += 1
    joint = np.array([[p_root[a] * p_child[a][c] for c in range(V)] for a in range(V)])
    assert chisquare(counts.ravel(), joint.ravel() * n).pvalue > 1e-3


def p_child_rows(p_child, toks):
    return np.stack([p_child[int(t)] for t in toks])


def test_greedy_verify_walks_matching_children():
    parents = [-1, 0, 0, 1, 2]
    tokens = [7, 4, 5, 6, 8]
    b = tree_buffers(parents)
    argmax = np.array([5, 0, 8, 0, 3])  # root wants 5 (node 2), node 2 wants 8 (node 4), node 4 wants 3
    v = greedy_verify(tokens, b.children, argmax)
    assert v.path == [0, 2, 4] and v.bonus == 3 and v.accepted == 2


def test_device_accepted_node_agrees_with_greedy_verify():
    """The on-device greedy acceptance (one sync per pass) finds the same last
    node as the host walk, on random dynamic trees and random targets that
    accept anywhere from nothing to a full path."""
    from specstream_mlx.method.acceptance import greedy_accepted_node
    from specstream_mlx.method.tree import Tree, dynamic_tree

    rng = np.random.default_rng(0)
    depths_seen = set()
    for trial in range(200):
        depth, K, V = 4, 4, 6
        top = np.stack([rng.permutation(V)[:K] for _ in range(depth)])
        probs = np.sort(rng.dirichlet(np.ones(K), size=depth), axis=1)[:, ::-1]
        tree = dynamic_tree(int(rng.integers(V)), top, probs, int(rng.integers(1, 14)))
        b = tree_buffers(tree.parents)
        # Targets that often follow the tree: each node wants one of its children's tokens.
        argmax = np.array(
            [tree.tokens[rng.choice(c)] if c and rng.random() < 0.8 else int(rng.integers(V)) for c in b.children]
        )
        host = greedy_verify(tree.tokens, b.children, argmax)
        dev = int(greedy_accepted_node(tree.tokens, b, mx.array(argmax)).item())
        assert dev == host.path[-1], (trial, tree, argmax)
        depths_seen.add(len(host.path) - 1)
    assert {0, 1, 2, 3} <= depths_seen  # the test covers short and long acceptances
    assert int(greedy_accepted_node(Tree((3,), (-1,)).tokens, tree_buffers([-1]), mx.array([1])).item()) == 0


# --- end to end: ss sampling vs the exact ar distribution ------------------

V = 6
N_TOKENS = 3


def tiny_vocab_model():
    from specstream_mlx.method.streams import StreamConfig, new_streams
    from specstream_mlx.models import build_model

    cfg = dict(
        model_type="llama",
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=V,
        tie_word_embeddings=False,
    )
    mx.random.seed(0)
    model = build_model(cfg)
    model.update(
        tree_unflatten(
            [
                (k, mx.random.normal(v.shape) * (0.6 if v.ndim > 1 else 0.1) + (1.0 if "norm" in k else 0.0))
                for k, v in tree_flatten(model.parameters())
            ]
        )
    )
    streams = new_streams(model, StreamConfig(num_streams=2, stream_layers=1, lora_rank=0))
    # Stream drafts that are good but not perfect: the main model's head, slightly perturbed.
    streams.embeddings = mx.random.normal(streams.embeddings.shape) * 0.3
    return model, streams


def exact_sequence_distribution(model, prompt, sampling, n_tokens=N_TOKENS):
    """P(x1 .. xn | prompt) under plain sampling, by enumerating all prefixes."""
    from specstream_mlx.runtime.sampling import target_logprobs

    seqs = [list(s) for s in itertools.product(range(V), repeat=n_tokens - 1)]
    ids = mx.array([prompt + s for s in seqs])
    lp = np.array(target_logprobs(model(ids), sampling))  # (V^(n-1), L + n - 1, V)
    L = len(prompt)
    dist = np.zeros((V,) * n_tokens)
    for s, row in zip(seqs, lp):
        prefix = np.prod([np.exp(row[L - 1 + j, x]) for j, x in enumerate(s)])
        dist[tuple(s)] = prefix * np.exp(row[L + n_tokens - 2])
    return dist


@pytest.mark.parametrize(
    "top_p,pruning,eager,hosts,probes,n_tokens,n,lookup,draft_vocab",
    [
        (1.0, 0.0, True, 0, False, 3, 2500, False, None),
        (0.8, 0.02, False, 1, False, 4, 5000, False, None),
        (0.8, 0.0, True, 0, True, 3, 2500, False, None),
        (1.0, 0.0, True, 0, False, 4, 2500, True, None),
        (0.8, 0.0, False, 0, False, 3, 2500, False, (0, 2, 3, 5)),
    ],
    ids=["plain", "top_p-pruning-noneager-hosting", "auto-plain-probes", "hybrid-lookup", "draft-vocab-noneager"],
)
def test_ss_sampling_matches_ar_distribution(
    top_p, pruning, eager, hosts, probes, n_tokens, n, lookup, draft_vocab, monkeypatch
):
    """Seeded ss generations of 3 or 4 tokens against the exact ar distribution.

    Sample counts: the case with every feature on draws 5,000; the others 2,500, which
    resolve a total-variation distance of about 0.07 over their ~50 pooled cells
    (√(cells / n) / 2). Removing the residual update from rejection sampling moves every
    case much further than that: checked once, each then fails at these counts with a
    p-value below 1e-20 (the case with every feature on: 1e-236, total variation 0.27).

    The second case turns on everything that could break losslessness at once: nucleus
    sampling (top-p 0.8), an early-exit pruning threshold that prunes greedy trees, and
    the non-eager branch (stream logits computed after verification, as for any real
    vocabulary), and streams hosted at one node per tree; its 4 tokens reach passes that
    verify drafts from a hosting ancestor's later streams (counted: with 3 tokens no such
    draft is ever verified before the sequence is complete). The third has ``--tree auto`` interleave its
    timed plain probes with tree passes (a one-token probe after every other pass). The
    fourth drafts hybrid trees: stream draws plus an n-gram lookup branch of point-mass
    proposals from a prompt that repeats itself (lookup nodes must be accepted, counted;
    verifying the lookup nodes against the stream proposal instead of their point mass
    fails it, p < 1e-30, checked once). The fifth drafts from 4 of the 6 token ids only:
    the proposals are spread over the whole vocabulary (0 at ids 1 and 4), which the target
    still emits through the residual."""
    from scipy.stats import chisquare

    import specstream_mlx.runtime.speculative as spec_mod
    from specstream_mlx.method.tree import TreeSpec
    from specstream_mlx.runtime.sampling import SamplingParams
    from specstream_mlx.runtime.speculative import ss_steps

    if not eager:
        monkeypatch.setattr(spec_mod, "EAGER_STREAM_LOGITS", 0)
    # Whether the next draft comes from a hosting ancestor's streams, shifted (set by each pass).
    shifted = {"next": False}
    usable = spec_mod._usable

    def spy(arrays, slot, shift):
        shifted["next"] = slot >= 0 and shift > 0
        return usable(arrays, slot, shift)

    monkeypatch.setattr(spec_mod, "_usable", spy)
    tree = TreeSpec("cartesian", (2, 1), hosting=hosts)
    # Hybrid trees: where the lookup branch starts in the tree being verified, and how
    # often a verdict's path went through it.
    branch = {"tree": None, "start": 0, "accepted": 0}
    if lookup:
        tree = TreeSpec("dynamic", budget=4, depth=2, lookup=3)
        hang, verify = spec_mod.with_lookup_sampled, spec_mod.verify

        def hang_spy(draft, chain, *a):
            out = hang(draft, chain, *a)
            branch["tree"], branch["start"] = out.tree, len(draft.tree)
            return out

        def verify_spy(t, b, s, target):
            v = verify(t, b, s, target)
            if t == branch["tree"]:  # a hybrid tree: did the path go through its lookup branch?
                branch["accepted"] += any(i >= branch["start"] for i in v.path)
            return v

        monkeypatch.setattr(spec_mod, "with_lookup_sampled", hang_spy)
        monkeypatch.setattr(spec_mod, "verify", verify_spy)
    if probes:
        import specstream_mlx.runtime.autotune as A
        import specstream_mlx.runtime.loaded_model as engine
        from specstream_mlx.runtime.step_costs import PassCosts

        # A one-token probe after every tree pass (timed plain tokens are always "needed").
        monkeypatch.setattr(A, "PLAIN_PROBE", 1)
        monkeypatch.setattr(A, "PLAIN_EVERY", 1)
        monkeypatch.setattr(A, "TIME_MIN", 1)
        monkeypatch.setattr(
            engine, "auto_policy_for", lambda *a, **k: A.AutoPolicy(PassCosts(), depth=2, budget=2, hosting=0)
        )
        monkeypatch.setattr(A.AutoPolicy, "_choose", lambda self: None)
        tree = "auto"
    model, streams = tiny_vocab_model()
    if draft_vocab:
        streams.use_draft_vocab(model, np.array(draft_vocab))
    if pruning:
        # The threshold is real: it prunes nodes of greedy trees of this model.
        greedy = ss_steps(
            model,
            mx.array([4]),
            SamplingParams(),
            streams=streams,
            tree=TreeSpec("cartesian", (3, 2)),
            pruning_threshold=pruning,
        )
        assert sum(next(greedy).info.pruned for _ in range(6)) > 0
    # One token: no separate prefill pass, so the test stays fast; the hybrid case's prompt
    # repeats itself so lookup finds continuations from the first drafted tree on.
    prompt = [4, 1, 4, 2, 4] if lookup else [4]
    sampling = SamplingParams(temperature=0.9, top_p=top_p)
    dist = exact_sequence_distribution(model, prompt, sampling, n_tokens)
    counts = np.zeros_like(dist)
    accepted = probed = shifted_verified = 0
    for i in range(n):
        s = SamplingParams(temperature=0.9, top_p=top_p, seed=i)
        steps = ss_steps(
            model,
            mx.array(prompt),
            s,
            streams=streams,
            tree=tree,
            pruning_threshold=pruning,
        )
        out = []
        shifted["next"] = False
        while len(out) < n_tokens:
            from_shift = shifted["next"]
            step = next(steps)
            shifted_verified += from_shift and step.info.nodes > 0
            accepted += step.info.accepted
            probed += step.info.tree is None and len(out) > 0  # plain probe steps carry no tree
            out += step.tokens
        counts[tuple(out[:n_tokens])] += 1
    # Drafts were accepted (and probes decoded tokens) often enough for the test to mean something.
    assert accepted > (0.03 if probes else 0.2 if draft_vocab else 0.3) * n  # 4 of 6 ids: fewer accepted
    assert probed > 0.5 * n if probes else probed == 0
    assert shifted_verified > 0.02 * n if hosts else shifted_verified == 0
    assert branch["accepted"] > 0.05 * n if lookup else branch["accepted"] == 0
    expected = dist.ravel() * n
    keep = expected > 5  # pool rare cells so the chi-square approximation holds
    # Sequences outside the nucleus (probability exactly 0) must never appear.
    assert counts.ravel()[dist.ravel() == 0].sum() == 0
    obs, exp = counts.ravel()[keep], expected[keep]
    if expected[~keep].sum() > 0:
        obs = np.append(obs, counts.ravel()[~keep].sum())
        exp = np.append(exp, expected[~keep].sum())
    exp *= obs.sum() / exp.sum()  # float32 probabilities sum to 1 within ~1e-7
    assert chisquare(obs, exp).pvalue > 1e-3
    tv = 0.5 * np.abs(counts.ravel() / n - dist.ravel()).sum()
    assert tv < (0.06 if n_tokens == 3 else 0.1)
