"""Speculative decoding is exact: greedy ss/lookup equal plain decoding, token for token."""

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_unflatten

from specstream_mlx.convert import ConvertOptions, convert
from specstream_mlx.io.loading import load_model
from specstream_mlx.method.streams import StreamConfig, new_streams
from specstream_mlx.method.tree import TreeSpec
from specstream_mlx.runtime.cache import make_cache
from specstream_mlx.runtime.lookup import NgramIndex, lookup_steps
from specstream_mlx.runtime.sampling import SamplingParams
from specstream_mlx.runtime.speculative import ss_steps
from specstream_mlx.runtime.steps import ar_steps
from tests.helpers.hf_reference import ARCHITECTURES

GREEDY = SamplingParams()
TREES = [
    TreeSpec("dynamic", budget=10, depth=3),
    TreeSpec("cartesian", (3, 2, 1)),
    # Hosting policies: streams at the root and the 2 (1) likeliest other endpoints;
    # the next draft then often comes from a hosting ancestor's later streams.
    TreeSpec("dynamic", budget=10, depth=3, hosting=2),
    TreeSpec("cartesian", (3, 2, 1), hosting=1),
    # Hybrid: n-gram continuation branches merged in under the same budget.
    TreeSpec("dynamic", budget=10, depth=3, lookup=5),
    TreeSpec("dynamic", budget=6, depth=3, lookup=4, hosting=1),
]


def take(steps, n, pruned=None):
    """The first ``n`` tokens and the passes they took; ``pruned`` (a list) collects the
    nodes each pass pruned."""
    out, passes = [], 0
    while len(out) < n:
        step = next(steps)
        # The device-side greedy acceptance (one sync per pass) must agree with
        # the host verdict; a disagreement is repaired but reported as "resync".
        assert not step.info.resync, "device and host acceptance disagree"
        out += step.tokens
        passes += 1
        if pruned is not None:
            pruned.append(step.info.pruned)
    return out[:n], passes


def pretend_trained(streams, seed=1):
    """Non-zero LoRA and embeddings, as after training: must not touch main rows."""
    mx.random.seed(seed)
    streams.update(
        tree_unflatten([(k, mx.random.normal(v.shape) * 0.05) for k, v in tree_flatten(streams.parameters())])
    )
    return streams


def check_exact(model, streams, vocab, n_prompts=6, n_tokens=24, seed=0, lengths=(1, 40), chunk=512):
    """Greedy ss (and lookup) equal ar on random prompts, every third one with early-exit
    pruning (which must prune something), plus a 250-token prompt whose pruned passes
    cross the cache's 256-row growth."""
    rng = np.random.RandomState(seed)
    pruned = []
    for i in range(n_prompts + 1):
        L = int(rng.randint(*lengths)) if i < n_prompts else 250
        prompt = mx.array(rng.randint(3, vocab, size=L).tolist())
        ref, _ = take(ar_steps(model, prompt, GREEDY, prefill_chunk=chunk), n_tokens)
        spec = TREES[i % len(TREES)]
        thr = 0.02 if i % 3 == 2 or i == n_prompts else 0.0
        got, _ = take(
            ss_steps(model, prompt, GREEDY, streams=streams, tree=spec, pruning_threshold=thr, prefill_chunk=chunk),
            n_tokens,
            pruned if thr else None,
        )
        assert got == ref, f"ss != ar (prompt {i}, len {L}, tree {spec.describe()}, prune {thr})"
        got, _ = take(lookup_steps(model, prompt, GREEDY, prefill_chunk=chunk), n_tokens)
        assert got == ref, f"lookup != ar (prompt {i}, len {L})"
    assert sum(pruned) > 0, "the pruned runs pruned nothing: they did not test pruning"


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_ss_greedy_equals_ar_untrained(hf_models, arch):
    _, _, dst = hf_models(arch)
    model, _ = load_model(dst)
    streams = new_streams(model, StreamConfig(num_streams=3, stream_layers=2, lora_rank=4))
    check_exact(model, streams, 151)


@pytest.mark.parametrize("arch", ["llama", "phi3", "qwen3", "gemma3"])
def test_ss_greedy_equals_ar_trained_like(hf_models, arch):
    _, _, dst = hf_models(arch)
    model, _ = load_model(dst)
    streams = pretend_trained(new_streams(model, StreamConfig(num_streams=4, stream_layers=3, lora_rank=4)))
    check_exact(model, streams, 151, seed=5)


def test_ss_greedy_equals_ar_quantized(hf_models, tmp_path):
    _, src, _ = hf_models("llama-q")
    dst = convert(
        str(src), str(tmp_path / "q4"), ConvertOptions(dtype="float32", quantize=True, q_bits=4, q_group_size=32)
    )
    model, _ = load_model(dst, dequantize=False)  # the quantized path itself
    streams = pretend_trained(new_streams(model, StreamConfig(num_streams=3, stream_layers=2, lora_rank=4)))
    check_exact(model, streams, 151, seed=7)


def test_ss_greedy_equals_ar_long_prompts(hf_models):
    """Long prompts, prefilled in several chunks, then many steps."""
    _, _, dst = hf_models("qwen2")
    model, _ = load_model(dst)
    streams = new_streams(model, StreamConfig(num_streams=3, stream_layers=2, lora_rank=4))
    check_exact(model, streams, 151, n_prompts=3, n_tokens=48, seed=3, lengths=(300, 420), chunk=128)


def test_perfect_streams_accept_everything(hf_models, monkeypatch):
    """Oracle: streams that predict the true continuation are always accepted,
    so every pass after the first yields γ+1 tokens."""
    import specstream_mlx.runtime.speculative as spec_mod

    _, _, dst = hf_models("llama")
    model, _ = load_model(dst)
    gamma = 4
    streams = new_streams(model, StreamConfig(num_streams=gamma, stream_layers=2, lora_rank=0))
    prompt = mx.array([5, 17, 33, 2, 90, 41])
    n = 41
    ref, _ = take(ar_steps(model, prompt, GREEDY), n + gamma + 1)
    full = prompt.tolist() + ref
    cache = make_cache(model)

    def oracle_logits(model_, streams_, out, node):
        # The accepted node sits at position offset + depth; the bonus token
        # follows it and stream j must predict the token j places after the bonus.
        pos = out.offset + int(out.buffers.depths[int(node.item() if hasattr(node, "item") else node)])
        logits = mx.full((gamma, 151), -10.0)
        for j in range(gamma):
            logits[j, full[pos + 2 + j]] = 10.0
        return logits

    monkeypatch.setattr(spec_mod, "stream_logits", oracle_logits)
    steps = ss_steps(model, prompt, GREEDY, cache=cache, streams=streams, tree=TreeSpec("cartesian", (1,) * gamma))
    got, passes = take(steps, n)
    assert got == ref[:n]
    # 1 token from the prompt pass, then gamma+1 per pass.
    assert passes == 1 + -(-(n - 1) // (gamma + 1))


def test_perfect_streams_from_a_hosting_ancestor(hf_models, monkeypatch):
    """Streams hosted at the root only: after a 2-token chain is accepted, the next
    draft comes from the root's streams 3..4 (shifted by the chain's depth), so with
    perfect streams every pass still yields 3 tokens and only the root's rows carry streams."""
    import specstream_mlx.runtime.speculative as spec_mod

    _, _, dst = hf_models("llama")
    model, _ = load_model(dst)
    gamma = 4
    streams = new_streams(model, StreamConfig(num_streams=gamma, stream_layers=2, lora_rank=0))
    prompt = mx.array([5, 17, 33, 2, 90, 41])
    n = 31
    ref, _ = take(ar_steps(model, prompt, GREEDY), n + gamma + 1)
    full = prompt.tolist() + ref
    hosted_rows = []

    def oracle_logits(model_, streams_, out, slot):
        host = int(out.hosts[int(slot.item() if hasattr(slot, "item") else slot)])
        hosted_rows.append(out.stream_hidden.shape[0])
        pos = out.offset + int(out.buffers.depths[host])
        logits = mx.full((out.stream_hidden.shape[1], 151), -10.0)
        for j in range(out.stream_hidden.shape[1]):
            logits[j, full[pos + 2 + j]] = 10.0
        return logits

    monkeypatch.setattr(spec_mod, "stream_logits", oracle_logits)
    monkeypatch.setattr(spec_mod, "hosting_nodes", lambda parents, reach, m: np.array([0]))
    spec = TreeSpec("cartesian", (1, 1), hosting=1)
    # Host all 4 streams (a 2-deep tree alone would host 2): shifted drafts need 3..4.
    monkeypatch.setattr(TreeSpec, "max_depth", property(lambda self: gamma))
    got, passes = take(ss_steps(model, prompt, GREEDY, streams=streams, tree=spec), n)
    assert got == ref[:n]
    assert passes == 1 + -(-(n - 1) // 3)
    assert set(hosted_rows[1:]) == {1}  # after the first pass only the root hosts streams


def lookup_draft(history, max_len, ngram_max=3, ngram_min=1):
    """The reference the index must match: scan back for the most recent earlier
    occurrence of the longest matching suffix n-gram."""
    h = list(history)
    for n in range(ngram_max, ngram_min - 1, -1):
        if len(h) <= n:
            continue
        for start in range(len(h) - n - 1, -1, -1):
            if h[start : start + n] == h[-n:]:
                cont = h[start + n : start + n + max_len]
                if cont:
                    return cont
    return []


def test_lookup_draft():
    for h, n, want in (([1, 2, 3, 4, 9, 1, 2, 3], 3, [4, 9, 1]), ([7, 8], 3, []), ([5, 6, 5], 2, [6, 5])):
        assert lookup_draft(h, n) == want and NgramIndex(h).draft(n) == want


def test_ss_needs_streams(hf_models):
    from specstream_mlx.method.streams import NoStreamsError

    _, _, dst = hf_models("llama")
    model, _ = load_model(dst)
    with pytest.raises(NoStreamsError):
        next(ss_steps(model, mx.array([1, 2]), GREEDY))


def test_cache_grows_only_with_accepted_tokens(hf_models):
    _, _, dst = hf_models("llama")
    model, _ = load_model(dst)
    streams = new_streams(model, StreamConfig(num_streams=3, stream_layers=2, lora_rank=0))
    cache = make_cache(model)
    prompt = mx.array(list(range(3, 23)))
    steps = ss_steps(model, prompt, GREEDY, cache=cache, streams=streams, tree=TreeSpec("dynamic", budget=12))
    produced = 0
    for _ in range(30):
        produced += len(next(steps).tokens)
        # The cache holds the prompt and all decided tokens except the newest (the next root).
        assert cache[0].offset == 20 + produced - 1
        assert cache[-1].offset == cache[0].offset
    assert cache[0].capacity == 256


def test_hosting_fewer_streams_keeps_their_states(hf_models):
    """A pass that hosts only streams 1..g (the next tree is at most g deep)
    computes the same main logits and the same states for those streams."""
    from specstream_mlx.method.msa import ss_forward
    from specstream_mlx.method.tree import Tree

    _, _, dst = hf_models("llama")
    model, _ = load_model(dst)
    streams = pretend_trained(new_streams(model, StreamConfig(num_streams=4, stream_layers=2, lora_rank=4)))
    tree = Tree((7, 9, 11, 12), (-1, 0, 0, 1))
    outs = []
    for g in (None, 2):
        cache = make_cache(model)
        model(mx.array([[5, 17, 33, 2, 90]]), cache=cache)
        outs.append(ss_forward(model, streams, tree, 5, cache, num_streams=g))
    full, part = outs
    assert part.stream_hidden.shape[1] == 2
    assert mx.allclose(full.main_logits, part.main_logits, atol=1e-5).item()
    assert mx.allclose(full.stream_hidden[:, :2], part.stream_hidden, atol=1e-5).item()


def test_ngram_index_drafts_what_the_scan_drafts():
    rng = np.random.default_rng(0)
    for trial in range(200):
        h = rng.integers(0, 4 if trial % 2 else 12, size=int(rng.integers(1, 60))).tolist()
        index = NgramIndex(h[:5])
        index.extend(h[5:])
        for L in (1, 3, 6):
            assert index.draft(L) == lookup_draft(h, L), (h, L)


def test_lookup_branches_are_accepted_and_exact(hf_models):
    """Greedy decoding of a small random model falls into loops: a +lookup tree must then
    accept its n-gram branches (more tokens per pass than streams that draft noise) and
    still decode exactly the plain tokens."""
    _, _, dst = hf_models("llama")
    model, _ = load_model(dst)
    streams = new_streams(model, StreamConfig(num_streams=3, stream_layers=2, lora_rank=4))
    streams.embeddings = mx.random.normal(streams.embeddings.shape, key=mx.random.key(0)) * 100.0
    rng = np.random.RandomState(3)
    prompts = [mx.array(rng.randint(3, 151, size=12).tolist()) for _ in range(4)]
    n, passes = 64, {}
    for spec in ("dynamic:6,3", "dynamic:6,3+lookup"):
        passes[spec] = 0
        for prompt in prompts:
            ref, _ = take(ar_steps(model, prompt, GREEDY), n)
            got, k = take(ss_steps(model, prompt, GREEDY, streams=streams, tree=spec), n)
            assert got == ref, spec
            passes[spec] += k
    assert passes["dynamic:6,3+lookup"] < 0.75 * passes["dynamic:6,3"], passes


def test_tree_spec_lookup_text():
    spec = TreeSpec.parse("dynamic:8+lookup")
    assert spec.lookup == 5 and spec.budget == 8 and spec.describe() == "dynamic:8+lookup"
    spec = TreeSpec.parse("dynamic:8,3+lookup:3@2")
    assert (spec.lookup, spec.depth, spec.hosting) == (3, 3, 2)
    assert TreeSpec.parse(spec.describe()) == spec
    for bad in ("cartesian:2x1+lookup", "dynamic:8+lookup:0", "dynamic:8+lookahead", "dynamic:8+lookup:x"):
        with pytest.raises(ValueError, match="lookup"):
            TreeSpec.parse(bad)


def test_the_stream_lora_leaves_main_rows_bit_for_bit_and_adds_its_delta_to_stream_rows():
    """In a pass the streams' LoRA is confined to stream rows by a row mask, in one fused
    element-wise kernel: main rows keep the frozen projection's bits (what keeps lossless
    mode exact), a zero's sign and a row whose delta is not finite included; stream rows get
    ``scale * (x @ a) @ b`` added."""
    from specstream_mlx.method.streams import LoRA, LoRAAdapter, stream_row_mask

    rng = np.random.default_rng(3)
    lora = LoRA(24, 40, rank=4, scale=2.0)
    lora.a = mx.array(rng.standard_normal((24, 4)).astype(np.float32))
    lora.b = mx.array(rng.standard_normal((4, 40)).astype(np.float32))
    x = mx.array(rng.standard_normal((1, 7, 24)).astype(np.float32))
    y = mx.array(rng.standard_normal((1, 7, 40)).astype(np.float32))
    y[0, 1, 3] = -0.0  # a zero's sign, kept too
    x_inf = mx.array(np.array(x))
    x_inf[0, 2, :] = mx.inf  # a non-finite delta on a main row stays off it
    out = np.array(LoRAAdapter({"q_proj": lora}, stream_row_mask(4, 7))("q_proj", x_inf, y))
    assert np.array_equal(out[:, :4].view(np.uint32), np.array(y)[:, :4].view(np.uint32))
    want = np.array(y)[:, 4:] + 2.0 * (np.array(x)[:, 4:] @ np.array(lora.a) @ np.array(lora.b))
    assert np.allclose(out[:, 4:], want, rtol=1e-5, atol=1e-5)
    assert not np.allclose(out[:, 4:], np.array(y)[:, 4:])
    # Without a mask (training) every row gets it, the projection's name picks the LoRA.
    every = LoRAAdapter({"q_proj": lora})
    assert np.allclose(np.array(every("q_proj", x, y)), np.array(y) + np.array(lora(x)), rtol=1e-6, atol=1e-6)
    assert every("k_proj", x, y) is y
