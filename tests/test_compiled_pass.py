"""The compiled speculative pass computes what the op-by-op pass computes."""

import mlx.core as mx
import numpy as np
import pytest

from specstream_mlx.io.loading import load_model
from specstream_mlx.method.msa import commit_ss, ss_forward
from specstream_mlx.method.streams import StreamConfig, new_streams
from specstream_mlx.method.tree import Tree, TreeSpec
from specstream_mlx.runtime.cache import make_cache
from specstream_mlx.runtime.compiled_pass import SSPass
from specstream_mlx.runtime.loaded_model import SpeculativeModel
from specstream_mlx.runtime.sampling import SamplingParams
from specstream_mlx.runtime.speculative import ss_steps
from specstream_mlx.runtime.steps import ar_steps
from tests.test_speculative import pretend_trained, take

TREE = Tree((7, 9, 11, 12, 30), (-1, 0, 0, 1, 1))


@pytest.fixture(scope="module")
def model_streams(hf_models):
    _, _, dst = hf_models("qwen2")  # q/k/v biases: every projection kind in the pass
    model, _ = load_model(dst)
    streams = pretend_trained(new_streams(model, StreamConfig(num_streams=3, stream_layers=2, lora_rank=4)))
    return model, streams


def _prefilled(model, n):
    cache = make_cache(model)
    model(mx.array([[(5 * i) % 90 + 3 for i in range(n)]]), cache=cache)
    return cache


@pytest.mark.parametrize("hosts", [None, np.array([0, 3])], ids=["every-node", "two-hosts"])
def test_compiled_pass_equals_the_op_by_op_pass_across_capacity_growth(model_streams, hosts):
    """Passes after each other, committing a path each time, across the cache's 256-row
    growth (a new compiled shape): logits, stream states and cached rows agree."""
    model, streams = model_streams
    fwd = SSPass(model, streams, compiled=True)
    assert fwd.usable(_prefilled(model, 4), 0.0, len(TREE))
    caches = {"eager": _prefilled(model, 250), "compiled": _prefilled(model, 250)}
    for step in range(5):  # 250 + 5 per pass + 2 kept: crosses 256
        offset = caches["eager"][0].offset
        ref = ss_forward(model, streams, TREE, offset, caches["eager"], num_streams=2, hosts=hosts)
        out = fwd(TREE, offset, caches["compiled"], num_streams=2, hosts=hosts)
        assert np.array_equal(ref.hosts, out.hosts)
        assert mx.allclose(ref.main_logits, out.main_logits, atol=1e-4).item()
        assert mx.allclose(ref.stream_hidden, out.stream_hidden, atol=1e-4).item()
        path = [0, 1, 3] if step % 2 else [0, 2]
        for c in caches.values():
            commit_ss(c, streams, ref, path)
        for a, b in zip(caches["eager"], caches["compiled"]):
            assert a.offset == b.offset
            assert mx.allclose(a.keys[..., : a.offset, :], b.keys[..., : b.offset, :], atol=1e-4).item()
    assert caches["compiled"][0].capacity == 512


def test_launching_the_lower_layers_early_computes_the_same_pass(model_streams, monkeypatch):
    """The op-by-op pass queues its first layers' evaluation while it builds the rest:
    the launches happen, and logits, stream states and cached rows are the same bits as
    a pass evaluated at its end."""
    from specstream_mlx.method import msa

    model, streams = model_streams
    launched = []
    queue = mx.async_eval
    monkeypatch.setattr(msa.mx, "async_eval", lambda *a: launched.append(1) or queue(*a))
    outs, caches = {}, {}
    first = streams.first_layer
    # After the first layer, then after every `every` layers (layer indices every-1, 2·every-1, ...).
    expected = {0: 0, 1: first, 4: 1 + first // 4}
    for every in (0, 1, 4):
        launched.clear()
        monkeypatch.setattr(msa, "LAUNCH_EVERY", every)
        caches[every] = _prefilled(model, 20)
        outs[every] = ss_forward(model, streams, TREE, 20, caches[every], num_streams=2)
        mx.eval(outs[every].main_logits, outs[every].stream_hidden)
        assert len(launched) == expected[every]
    for every in (1, 4):
        assert np.array_equal(np.array(outs[0].main_logits), np.array(outs[every].main_logits))
        assert np.array_equal(np.array(outs[0].stream_hidden), np.array(outs[every].stream_hidden))
        for a, b in zip(caches[0], caches[every]):
            assert a.offset == b.offset == 20 + len(TREE)
            assert np.array_equal(np.array(a.keys), np.array(b.keys))
            assert np.array_equal(np.array(a.values), np.array(b.values))


def test_a_pass_without_stream_rows_runs_none_of_the_streams_lora(model_streams, monkeypatch):
    """The streams' LoRA changes stream rows only: a pass that hosts no streams (a lookup
    branch's) computes none of it, one that hosts them does, and both verify the tree
    with the same main rows."""
    from specstream_mlx.method.streams import LoRA

    model, streams = model_streams
    calls = []
    apply = LoRA.low_rank
    monkeypatch.setattr(LoRA, "low_rank", lambda self, x: calls.append(x.shape) or apply(self, x))
    outs = {}
    for name, hosts in (("none", np.zeros(0, dtype=np.int64)), ("two", np.array([0, 3]))):
        calls.clear()
        outs[name] = ss_forward(model, streams, TREE, 20, _prefilled(model, 20), num_streams=2, hosts=hosts)
        mx.eval(outs[name].main_logits)
        n_loras = sum(len(layer) for layer in streams.lora.values())
        assert len(calls) == (0 if name == "none" else n_loras)
    assert outs["none"].stream_hidden.shape[0] == 0 and outs["two"].stream_hidden.shape[0] == 2
    assert mx.allclose(outs["none"].main_logits, outs["two"].main_logits, atol=1e-5).item()


def test_compiled_pass_reads_no_key_past_its_span(model_streams):
    """Past the tree's end rounded up to 64 rows the buffers hold NaN: the compiled pass
    never reads them (its logits equal the op-by-op pass's and are finite)."""
    model, streams = model_streams
    fwd = SSPass(model, streams, compiled=True)
    eager, compiled = _prefilled(model, 20), _prefilled(model, 20)
    for c in compiled:
        c.grow_to(256)
        c.keys[..., 64:, :] = mx.nan
        c.values[..., 64:, :] = mx.nan
    ref = ss_forward(model, streams, TREE, 20, eager, num_streams=2)
    out = fwd(TREE, 20, compiled, num_streams=2)
    assert compiled[0].capacity == 256 and not np.isnan(np.array(out.main_logits)).any()
    assert mx.allclose(ref.main_logits, out.main_logits, atol=1e-4).item()
    assert mx.allclose(ref.stream_hidden, out.stream_hidden, atol=1e-4).item()


def test_compiled_pass_honours_a_sliding_window(hf_models):
    """gemma3's local layers under the whole-buffer layout: with a window longer than the
    pass's rows it compiles and agrees with the op-by-op pass long after the window is
    full; with a shorter one it runs op by op."""
    _, _, dst = hf_models("gemma3")
    model, _ = load_model(dst)
    streams = pretend_trained(new_streams(model, StreamConfig(num_streams=3, stream_layers=2, lora_rank=4)))
    fwd = SSPass(model, streams, compiled=True)
    assert not fwd.usable(_prefilled(model, 4), 0.0, len(TREE))  # window 6 <= 5 rows + 3 streams
    for layer in model.layers:
        if layer.self_attn.window:
            layer.self_attn.window = 11
    assert fwd.usable(_prefilled(model, 4), 0.0, len(TREE))
    caches = {"eager": _prefilled(model, 40), "compiled": _prefilled(model, 40)}
    for step in range(4):
        offset = caches["eager"][0].offset
        ref = ss_forward(model, streams, TREE, offset, caches["eager"])
        out = fwd(TREE, offset, caches["compiled"])
        assert mx.allclose(ref.main_logits, out.main_logits, atol=1e-4).item()
        assert mx.allclose(ref.stream_hidden, out.stream_hidden, atol=1e-4).item()
        for c in caches.values():
            commit_ss(c, streams, ref, [0, 1, 3] if step % 2 else [0, 2])
    # The window is what the pass sees: without it the same pass gives other logits.
    windowed = ss_forward(model, streams, TREE, 40, _prefilled(model, 40))
    for layer in model.layers:
        layer.self_attn.window = None
    unwindowed = ss_forward(model, streams, TREE, 40, _prefilled(model, 40))
    assert not mx.allclose(unwindowed.main_logits, windowed.main_logits, atol=1e-3).item()


def test_compiled_pass_after_a_pruned_pass_that_straddles_a_cache_growth(model_streams):
    """A pruned pass writes every tree row in the lower layers but only the kept rows in
    the stream layers: at 250 + 9 rows the lower layers' buffers grow past 256 and the
    stream layers' do not. The next compiled pass must still run, and agree with the
    op-by-op pass."""
    model, streams = model_streams
    fwd = SSPass(model, streams, compiled=True)
    chain = Tree(tuple(range(10, 19)), tuple(range(-1, 8)))
    caches = {"eager": _prefilled(model, 250), "compiled": _prefilled(model, 250)}
    for c in caches.values():
        out = ss_forward(model, streams, chain, 250, c, pruning_threshold=0.9999, num_streams=2)
        assert len(out.kept) < len(chain)  # pruned: the stream layers wrote fewer rows
        commit_ss(c, streams, out, [0])
    caps = {c.capacity for c in caches["compiled"]}
    root = Tree((21,), (-1,))
    offset = caches["eager"][0].offset
    ref = ss_forward(model, streams, root, offset, caches["eager"], num_streams=2)
    got = fwd(root, offset, caches["compiled"], num_streams=2)
    assert len(caps) > 1 and len({c.capacity for c in caches["compiled"]}) == 1
    assert mx.allclose(ref.main_logits, got.main_logits, atol=1e-4).item()
    assert mx.allclose(ref.stream_hidden, got.stream_hidden, atol=1e-4).item()


def test_compiled_pass_sees_weights_changed_after_compiling(model_streams):
    """Weights are inputs of the compiled graph, not constants: updating the streams
    (as training does) changes the next compiled pass like the op-by-op one."""
    model, streams = model_streams
    fwd = SSPass(model, streams, compiled=True)
    fwd(TREE, 12, _prefilled(model, 12))
    old = streams.embeddings
    try:
        streams.embeddings = old * 3.0
        ref = ss_forward(model, streams, TREE, 12, _prefilled(model, 12))
        out = fwd(TREE, 12, _prefilled(model, 12))
        assert mx.allclose(ref.stream_hidden, out.stream_hidden, atol=1e-4).item()
    finally:
        streams.embeddings = old


def test_pruned_passes_run_op_by_op(model_streams):
    model, streams = model_streams
    fwd = SSPass(model, streams, compiled=True)
    assert not fwd.usable(_prefilled(model, 4), 0.5, len(TREE))
    assert fwd.usable(_prefilled(model, 4), 0.5, 1)  # a root-only tree has nothing to prune
    assert not fwd.usable(make_cache(model), 0.0, len(TREE))  # nothing cached yet: no buffers


@pytest.mark.parametrize("spec", ["dynamic:6", "dynamic:6@1", "cartesian:2x2x1"])
def test_compiled_greedy_ss_equals_plain_decoding(model_streams, spec):
    model, streams = model_streams
    sm = SpeculativeModel(model, streams, compiled=True)
    rng = np.random.RandomState(3)
    for L in (1, 9, 30):  # a 1-token prompt starts with an empty cache (first pass op by op)
        prompt = mx.array(rng.randint(3, 90, size=L).tolist())
        ref, _ = take(ar_steps(model, prompt, SamplingParams()), 40)
        out, _ = take(ss_steps(sm, prompt, SamplingParams(), tree=TreeSpec.parse(spec)), 40)
        assert out == ref


def test_compiled_sampling_draws_what_the_op_by_op_pass_draws(model_streams):
    """Same seed, same draws: the compiled pass changes no probability the sampler sees
    (beyond float rounding, which these logits do not reach)."""
    model, streams = model_streams
    prompt = mx.array([5, 17, 33, 2, 90, 41])
    runs = []
    for compiled in (False, True):
        sm = SpeculativeModel(model, streams, compiled=compiled)
        sampling = SamplingParams(temperature=0.8, seed=11)
        runs.append(take(ss_steps(sm, prompt, sampling, tree=TreeSpec.parse("dynamic:6")), 40)[0])
    assert runs[0] == runs[1]


def test_auto_runs_the_pass_kind_the_model_is_set_to(model_streams, monkeypatch):
    """Compiled passes are a setting (``SPECSTREAM_COMPILE=1``), not a measurement:
    --tree auto runs the kind the model says, and op by op by default."""
    from specstream_mlx.runtime.loaded_model import SpeculativeModel as SM

    model, streams = model_streams
    for env, want in (("1", True), ("", False), ("0", False)):
        monkeypatch.setenv("SPECSTREAM_COMPILE", env)
        sm = SM(model, streams)
        list(zip(range(12), ss_steps(sm, mx.array([5, 17, 33, 2]), SamplingParams(), tree="auto")))
        assert sm.tuners["greedy"].compiled is want and list(sm._passes) == [want]


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "sampled"])
def test_auto_times_passes_and_plain_probes_without_changing_the_output(model_streams, monkeypatch, temperature):
    """--tree auto times its tree passes and short plain probes inside real generations;
    a probe decodes plain tokens on the same cache and the next pass drafts from its last
    token. Greedy output still equals ar's, sampled output stays in the target's support
    (top-p), every probe step counts as a pass that accepted nothing, and the tuner ends
    up with online costs."""
    import specstream_mlx.runtime.autotune as A
    import specstream_mlx.runtime.loaded_model as engine
    from specstream_mlx.runtime.step_costs import PassCosts

    model, streams = model_streams
    monkeypatch.setattr(A, "PLAIN_EVERY", 5)
    monkeypatch.setattr(engine, "auto_policy_for", lambda *a, **k: A.AutoPolicy(PassCosts(), depth=3))
    # Keep drafting trees whatever the timings say (this test is about the probes, not the choice).
    monkeypatch.setattr(A.AutoPolicy, "_choose", lambda self: None)
    sm = SpeculativeModel(model, streams, compiled=False)
    prompt = mx.array([5, 17, 33, 2, 90, 41, 7])
    sampling = SamplingParams(temperature=temperature, top_p=0.9, seed=3)
    steps = ss_steps(sm, prompt, sampling, tree="auto")
    out, probes, tree_passes = [], 0, 0
    while len(out) < 90:
        step = next(steps)
        out += step.tokens
        probes += step.info.tree is None and step.info.accepted == 0 and len(step.tokens) == 1
        tree_passes += step.info.nodes > 0
    auto = sm.tuners["greedy" if temperature == 0 else "sampled"]
    costs = auto.costs
    assert probes >= 2 * A.PLAIN_PROBE and costs.plain_n >= A.TIME_MIN
    # Every pass over a drafted tree is booked to its arm (exploring ones and those just
    # before a probe included), except the last, still running when we stopped.
    assert sum(costs.timed.values()) == tree_passes - 1
    # ... and to an arm the policy has: sampled drafts used to be booked to a budget-0 arm.
    assert set(costs.timed) <= set(auto.arms()), costs.timed
    assert any(n >= A.TIME_MIN for n in costs.timed.values())
    assert costs.measured(max(costs.timed, key=costs.timed.get)) is not None
    if temperature == 0:
        ref, _ = take(ar_steps(model, prompt, sampling), 90)
        assert out[:90] == ref
    else:  # every token inside the top-p nucleus of its prefix
        full = mx.concatenate([prompt, mx.array(out[:90])])
        probs = mx.softmax(model(full[None])[0, len(prompt) - 1 : -1] / 0.8, axis=-1)
        order = mx.argsort(-probs, axis=-1)
        sorted_p = mx.take_along_axis(probs, order, axis=-1)
        rank = mx.argmax(order == full[len(prompt) :, None], axis=-1)
        before = mx.take_along_axis(mx.cumsum(sorted_p, axis=-1) - sorted_p, rank[:, None], axis=-1)
        assert (before < 0.9 + 1e-4).all().item()


@pytest.mark.parametrize("compiled", [False, True], ids=["op-by-op", "compiled"])
def test_few_hosted_streams_share_the_main_rows_lm_head_product(model_streams, monkeypatch, compiled):
    """Up to ``MERGED_STREAM_ROWS`` hosted stream rows go through the LM head with the main
    rows (one read of the head's weights): the pass returns every host's stream logits,
    equal to the head applied to the stream states alone, and main logits equal to the
    pass that leaves the streams for later. Above it the streams wait for the verdict."""
    from specstream_mlx.method import msa

    model, streams = model_streams
    default, outs = msa.MERGED_STREAM_ROWS, {}
    assert default >= 4
    for rows in (default, 0):
        monkeypatch.setattr(msa, "MERGED_STREAM_ROWS", rows)
        fwd = SSPass(model, streams, compiled=compiled)  # a fresh trace per setting
        outs[rows] = fwd(TREE, 20, _prefilled(model, 20), num_streams=2, hosts=np.array([0, 3]))  # 2 x 2 rows
    merged, apart = outs[default], outs[0]
    assert apart.stream_logits is None and merged.stream_logits is not None
    assert merged.stream_logits.shape == (2, 2, model.args.vocab_size)
    assert mx.allclose(merged.stream_logits, model.lm_logits(apart.stream_hidden), atol=1e-4).item()
    assert mx.allclose(merged.main_logits, apart.main_logits, atol=1e-4).item()
    monkeypatch.setattr(msa, "MERGED_STREAM_ROWS", default)
    fwd = SSPass(model, streams, compiled=compiled)
    every = fwd(TREE, 20, _prefilled(model, 20), num_streams=2)  # 5 hosts x 2 rows: above it
    assert default < 10 and every.stream_logits is None
