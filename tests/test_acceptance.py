"""Sampling stays lossless: the acceptance rule and whole ss generations."""

import itertools

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_unflatten

from specstream_mlx.method.acceptance import greedy_verify, rrs_step, sample_verify
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


def _rrs_sample(p, q, k, rng):
    drafts = rng.choice(len(q), size=k, p=q)
    i, resid = rrs_step(p, q, drafts.tolist(), rng)
    return int(drafts[i]) if i is not None else int(rng.choice(len(resid), p=resid / resid.sum()))


def test_rrs_implementation_matches_target_distribution():
    """The implementation (not the formula) produces p: chi-square over 40k draws."""
    from scipy.stats import chisquare

    rng = np.random.default_rng(0)
    p = np.array([0.4, 0.25, 0.2, 0.1, 0.05])
    q = np.array([0.1, 0.1, 0.1, 0.3, 0.4])
    n = 40000
    counts = np.bincount([_rrs_sample(p, q, 3, rng) for _ in range(n)], minlength=5)
    assert chisquare(counts, p * n).pvalue > 1e-3


def test_sample_verify_on_a_tree_matches_target_two_tokens():
    """Two-token outputs of sample_verify over a depth-2 tree equal the target's joint."""
    rng = np.random.default_rng(1)
    V = 3
    p_root = np.array([0.5, 0.3, 0.2])
    p_child = {t: rng.dirichlet(np.ones(V)) for t in range(V)}
    q = np.array([[0.2, 0.2, 0.6], [0.6, 0.3, 0.1]])
    counts = np.zeros((V, V))
    n = 20000
    b = tree_buffers([-1, 0, 0, 1, 2])
    for _ in range(n):
        d1 = rng.choice(V, size=2, p=q[0]).tolist()
        d2 = rng.choice(V, size=1, p=q[1]).tolist()
        tokens = [9] + d1 + [d2[0], d2[0]]
        target = np.stack([p_root, p_child[d1[0]], p_child[d1[1]], np.ones(V) / V, np.ones(V) / V])
        v = sample_verify(tokens, b.children, b.depths, target, q, rng)
        out = [tokens[i] for i in v.path[1:]] + [v.bonus]
        if len(out) == 1:  # need the second token: continue from the bonus
            out.append(int(rng.choice(V, p=p_child[out[0]])))
        counts[out[0], out[1]] += 1
    joint = np.array([[p_root[a] * p_child[a][b] for b in range(V)] for a in range(V)])
    from scipy.stats import chisquare

    assert chisquare(counts.ravel(), joint.ravel() * n).pvalue > 1e-3


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


def exact_sequence_distribution(model, prompt, sampling):
    """P(x1 x2 x3 | prompt) under plain sampling, by enumerating all prefixes."""
    from specstream_mlx.runtime.sampling import target_logprobs

    seqs = [list(s) for s in itertools.product(range(V), repeat=N_TOKENS - 1)]
    ids = mx.array([prompt + s for s in seqs])
    lp = np.array(target_logprobs(model(ids), sampling))  # (V^2, L, V)
    L = len(prompt)
    dist = np.zeros((V,) * N_TOKENS)
    for s, row in zip(seqs, lp):
        p1 = np.exp(row[L - 1, s[0]])
        p2 = np.exp(row[L, s[1]])
        dist[s[0], s[1], :] = p1 * p2 * np.exp(row[L + 1])
    return dist


@pytest.mark.parametrize(
    "top_p,pruning,eager,hosts,probes",
    [(1.0, 0.0, True, 0, False), (0.8, 0.02, False, 1, False), (0.8, 0.0, True, 0, True)],
    ids=["plain", "top_p-pruning-noneager-hosting", "auto-plain-probes"],
)
def test_ss_sampling_matches_ar_distribution(top_p, pruning, eager, hosts, probes, monkeypatch):
    """10,000 seeded ss generations of 3 tokens against the exact ar distribution.

    The second case turns on everything that could break losslessness at once: nucleus
    sampling (top-p 0.8), an early-exit pruning threshold that prunes greedy trees, and
    the non-eager branch (stream logits computed after verification, as for any real
    vocabulary), and streams hosted at one node per tree (drafts then also come from
    a hosting ancestor's later streams). The third has ``--tree auto`` interleave its
    timed plain probes with tree passes (a one-token probe after every other pass)."""
    from scipy.stats import chisquare

    import specstream_mlx.runtime.speculative as spec_mod
    from specstream_mlx.method.tree import TreeSpec
    from specstream_mlx.runtime.sampling import SamplingParams
    from specstream_mlx.runtime.speculative import ss_steps

    if not eager:
        monkeypatch.setattr(spec_mod, "EAGER_STREAM_LOGITS", 0)
    tree = TreeSpec("cartesian", (2, 1), hosts=hosts)
    if probes:
        import specstream_mlx.runtime.autotune as A
        import specstream_mlx.runtime.engine as engine

        monkeypatch.setattr(spec_mod, "PLAIN_PROBE", 1)
        monkeypatch.setattr(engine, "auto_tree_for", lambda *a, **k: A.AutoTree({0: 1.0, 2: 1.0}, depth=2, budget=2))
        monkeypatch.setattr(A.AutoTree, "choose", lambda self: self.budget)
        monkeypatch.setattr(A.AutoTree, "plain_probe_due", lambda self: self.passes % 2 == 0)
        tree = "auto"
    model, streams = tiny_vocab_model()
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
    prompt = [4]  # one token: no separate prefill pass, so the test stays fast
    sampling = SamplingParams(temperature=0.9, top_p=top_p)
    dist = exact_sequence_distribution(model, prompt, sampling)
    n = 4000 if probes else 10000
    counts = np.zeros_like(dist)
    accepted = probed = 0
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
        while len(out) < N_TOKENS:
            step = next(steps)
            accepted += step.info.accepted
            probed += step.info.tree is None and len(out) > 0  # plain probe steps carry no tree
            out += step.tokens
        counts[tuple(out[:N_TOKENS])] += 1
    # Drafts were accepted (and probes decoded tokens) often enough for the test to mean something.
    assert accepted > (0.03 if probes else 0.3) * n
    assert probed > 0.5 * n if probes else probed == 0
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
    assert tv < 0.06
