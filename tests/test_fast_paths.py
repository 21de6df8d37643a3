"""The decoding fast paths compute what the plain op-by-op model computes: RoPE from
precomputed angles, the compiled plain step (across KV growth), one-row products
forwarded to GEMV; and the BLAS setting is parsed as documented."""

import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_unflatten

from specstream_mlx.demo.tiny import tiny_config
from specstream_mlx.models import build_model
from specstream_mlx.models.base import ModelArgs, RoPE
from specstream_mlx.runtime.cache import attention_span, make_cache, trim_cache
from specstream_mlx.runtime.plain_step import PlainStep

# The tiny test llama, smaller still and with odd widths (a vocabulary of 97).
CFG = tiny_config(intermediate_size=96, num_hidden_layers=3, vocab_size=97, rope_theta=10000.0)


def _model(seed=0, **kw):
    """A random tiny llama (weights scaled up so that logits differ between tokens)."""
    mx.random.seed(seed)
    m = build_model({**CFG, **kw})
    flat = [(k, mx.random.normal(v.shape) * 0.2 if v.ndim > 1 else v) for k, v in tree_flatten(m.parameters())]
    m.update(tree_unflatten(flat))
    mx.eval(m.parameters())
    return m


def test_floor_counts_the_keys_and_values_a_step_reads():
    """``floor --context``'s bytes: every layer's key and value rows in the compute dtype, a
    sliding-window layer's at most its window; and the timed prompt's ids stay within a tiny
    vocabulary at any length."""
    from specstream_mlx.bench.machine import kv_bytes, plain_step_ms

    m = _model()
    per_row = 2 * m.args.num_key_value_heads * m.args.head_dim * 4  # float32
    assert kv_bytes(m, 100) == 3 * 100 * per_row
    m.layers[1].self_attn.window = 32  # one sliding-window layer
    assert kv_bytes(m, 100) == (2 * 100 + 32) * per_row and kv_bytes(m, 20) == 3 * 20 * per_row
    m.layers[1].self_attn.window = None
    times = plain_step_ms(m, tokens=3, context=300)  # 300 > the 97-token vocabulary
    assert len(times) == 3 and all(t > 0 for t in times)


def test_floor_times_each_weights_products_from_the_caches(monkeypatch):
    """``floor``'s cached products: per product weight one timed run of ``repeat`` products of
    that weight (a (1, k) row by its transpose) in one evaluation, the median divided by
    ``repeat``, summed over the weights; the report words it beside the products read from
    memory, and a report written before it was measured still reads."""
    from dataclasses import asdict

    from specstream_mlx.bench import machine

    m = _model()
    weights = machine.product_weights(m)
    evaluated = []
    real_eval = mx.eval

    def recording_eval(*args):
        evaluated.append([tuple(a.shape) for a in (args[0] if isinstance(args[0], list) else args)])
        return real_eval(*args)

    def one_run(run, reps):
        run()
        return 6.0  # ms, whatever the weight

    monkeypatch.setattr(machine, "median_ms", one_run)
    monkeypatch.setattr(mx, "eval", recording_eval)
    total = machine.time_cached_products(m, reps=5, repeat=7)
    monkeypatch.undo()
    assert total == pytest.approx(len(weights) * 6.0 / 7)
    runs = [shapes for shapes in evaluated if len(shapes) == 7]  # the timed runs, not the rows made first
    assert len(runs) == len(weights)
    assert [shapes[0] for shapes in runs] == [(1, w.shape[0]) for w in weights]
    assert all(len(set(shapes)) == 1 for shapes in runs)

    bandwidth = {"one_thread": 1e10, "all_threads": 2e10, "threads": 2}
    rep = machine.FloorReport("tiny", 1000, bandwidth, 2.5, [10.0], [6.0], load=[0.1], cached_products_ms=[4, 5, 9])
    assert "alone 6.0 ms (2.40x), 5.0 ms with each weight read from the caches (2.00x), everything" in rep.summary()
    old = asdict(rep)
    del old["cached_products_ms"]
    assert "alone 6.0 ms (2.40x), everything else 4.0 ms" in machine.FloorReport(**old).summary()
    stored = machine.FloorReport(
        **{**old, "stored_weights": 121, "stored_float_bytes": 538_000_000, "stored_half": 121}
    )
    assert "(121 weights read as stored, 121 with float16 scales, 538 MB as float32)" in stored.summary()


def test_floor_words_the_products_arithmetic_at_the_machines_product_rate():
    """``floor`` also says how long a step's multiply-adds take at this machine's float32
    product rate, and from how many rows at once their arithmetic, not their bytes, bounds
    them; a report without the rate (one written before it was measured) says nothing."""
    from dataclasses import asdict

    from specstream_mlx.bench import machine

    m = _model()
    assert machine.step_multiply_adds(m) == sum(w.size for w in machine.product_weights(m))
    assert 0 < machine.gemm_rate(size=64, reps=1) < float("inf")
    bandwidth = {"one_thread": 1e10, "all_threads": 2e10, "threads": 2}
    plain = machine.FloorReport("tiny", 1000, bandwidth, 2.5, [10.0], [6.0], load=[0.1])
    assert "multiply-adds" not in plain.summary()
    # 2.5 ms of bytes against 1 ms of multiply-adds a row: from 3 rows on the arithmetic bounds them.
    counted = machine.FloorReport(
        "tiny", 1000, bandwidth, 2.5, [10.0], [6.0], load=[0.1], multiply_adds=100_000_000, gemm_rate=1e11
    )
    assert "its 100 M multiply-adds take 1.00 ms at this machine's float32 product rate (100 G/s" in counted.summary()
    assert "bound by their arithmetic, not the bytes, from 3 rows on" in counted.summary()
    slow = machine.FloorReport(**{**asdict(counted), "gemm_rate": 2e10})  # 5 ms of multiply-adds a row
    assert "take 5.00 ms" in slow.summary() and "from one row on" in slow.summary()


@pytest.mark.parametrize("factor", [1.0, 0.5])
def test_rope_from_angles_equals_mx_fast_rope(factor):
    args = ModelArgs.from_dict({**CFG, "partial_rotary_factor": factor})
    rope = RoPE(16, args)
    x = mx.random.normal((2, 5, 4, 16))
    pos = mx.array([[3, 4, 4, 5, 9], [0, 1, 2, 3, 700]], dtype=mx.int32)
    got = rope(x, pos)  # (B, H, L, D)
    want = mx.fast.rope(
        x.reshape(10, 4, 1, 16), rope.dims, traditional=False, base=10000.0, scale=1.0, offset=pos.reshape(-1)
    ).reshape(2, 5, 4, 16)
    np.testing.assert_allclose(np.array(got.transpose(0, 2, 1, 3)), np.array(want), atol=2e-4)
    # The same rotation precomputed once (as a forward shares it across layers).
    np.testing.assert_allclose(np.array(rope(x, rope.angles(pos))), np.array(got), atol=0)


def _prefilled_pair(m):
    """Two caches holding the same 8-token prefix of ``m``: one for the op-by-op forward,
    one for the compiled step."""
    prompt = mx.array([[3, 1, 4, 1, 5, 9, 2, 6]])
    pair = make_cache(m), make_cache(m)
    for cache in pair:
        m(prompt, cache=cache)
    return pair


def _decode_pair(m, step, ca, cb, n):
    """``n`` greedy tokens from token 7, fed to the op-by-op forward (cache ``ca``) and to the
    compiled ``step`` (cache ``cb``) alike: yields (index, the forward's logits, the step's);
    the next token is the forward's choice."""
    tok = mx.array([7])
    for i in range(n):
        la = m(tok.reshape(1, 1), cache=ca)[:, -1, :]
        lb = step(tok, cb)
        yield i, la, lb
        tok = mx.argmax(la, axis=-1)


def test_compiled_plain_step_equals_the_model_across_cache_growth():
    """Token by token past a 256-row growth of the KV buffers: the compiled step's logits
    and the cache it leaves equal the op-by-op forward's."""
    m = _model()
    step = PlainStep(m)
    ca, cb = _prefilled_pair(m)
    for i, la, lb in _decode_pair(m, step, ca, cb, 260):
        # Every 37th, at each change of the attended span (offset + 1 = 64k, 64k + 1), past 256.
        if i % 37 == 0 or (9 + i) % 64 in (0, 1) or i > 245:
            np.testing.assert_allclose(np.array(lb), np.array(la), atol=1e-4)
    tok = mx.argmax(la, axis=-1)
    assert ca[0].offset == cb[0].offset == 268 and cb[0].capacity >= 512
    np.testing.assert_allclose(np.array(cb[2].keys[..., :268, :]), np.array(ca[2].keys[..., :268, :]), atol=1e-4)
    # Trimming (a rejected speculative step) and rewriting stays consistent.
    trim_cache(ca, 3)
    trim_cache(cb, 3)
    np.testing.assert_allclose(np.array(step(tok, cb)), np.array(m(tok.reshape(1, 1), cache=ca)[:, -1]), atol=1e-4)


def test_attention_span_covers_the_rows_in_whole_granules_within_the_capacity():
    assert [attention_span(e, 256) for e in (1, 63, 64, 65, 200, 256)] == [64, 64, 64, 128, 256, 256]
    assert attention_span(300, 512, granule=32) == 320 and attention_span(511, 512, granule=100) == 512


def test_compiled_plain_step_reads_no_key_past_its_span():
    """Rows of the KV buffers past the attended span are never read: NaN there (a masked
    key's value still enters the weighted sum as 0 · NaN) leaves the step's logits equal
    to the op-by-op forward's; attending over the whole capacity would turn them NaN."""
    m = _model()
    step = PlainStep(m)
    ca, cb = _prefilled_pair(m)
    for c in cb:
        c.grow_to(256)
        c.keys[..., 64:, :] = mx.nan
        c.values[..., 64:, :] = mx.nan
    for _, la, lb in _decode_pair(m, step, ca, cb, 3):
        assert cb[0].capacity == 256 and not np.isnan(np.array(lb)).any()
        np.testing.assert_allclose(np.array(lb), np.array(la), atol=1e-4)


@pytest.mark.parametrize(
    "arch, fuse, one_row",
    [
        ("llama", False, "fused"),
        ("llama-linear", True, "composed"),
        ("mistral-window", True, "composed"),
        ("qwen2", True, "fused"),
        ("qwen3", True, "composed"),
        ("qwen3", False, "composed"),
        ("phi3", True, "composed"),
        ("gemma3", True, "composed"),
    ],
)
def test_one_row_step_equals_the_model_in_every_architecture(hf_models, monkeypatch, arch, fuse, one_row):
    """The compiled step keeps its row two-dimensional through the layers (each
    attention in its two-dimensional form, ``Attention.rows``): with q/k/v fused or apart, per-head
    norms, partial rotary, RoPE scaling, a window on every layer or Gemma's local layers
    with their own RoPE base, its logits equal the op-by-op forward's, 24 tokens past
    every window."""
    from specstream_mlx.io.loading import load_model
    from specstream_mlx.models import base
    from specstream_mlx.models.fusion import fuse_projections
    from specstream_mlx.runtime.attention_choice import Forms, set_attention_form

    _, _, dst = hf_models(arch)
    model, _ = load_model(dst)
    if fuse:
        fuse_projections(model)  # phi3 is stored fused
    assert model.layers[0].self_attn.fused_qkv == fuse
    set_attention_form(model, Forms("fused", one_row))
    rows = []
    real = base.Attention.rows
    monkeypatch.setattr(base.Attention, "rows", lambda self, *a: rows.append(self) or real(self, *a))
    step = PlainStep(model)
    ca, cb = _prefilled_pair(model)
    for _, la, lb in _decode_pair(model, step, ca, cb, 24):
        np.testing.assert_allclose(np.array(lb), np.array(la), atol=1e-4)
    assert {id(a) for a in rows} == {id(layer.self_attn) for layer in model.layers}  # each in its two-dimensional form


@pytest.mark.parametrize("arch", ["llama", "qwen3", "phi3", "gemma3"])
def test_a_pass_lower_layers_as_rows_equal_the_batched_layers(hf_models, arch):
    """A tree pass's main rows go through the layers below the streams two-dimensional
    (``Attention.rows`` over several rows, a tree mask): the hidden states and the cache
    they leave equal the (1, n, dim) layers' on the same tree."""
    from types import SimpleNamespace

    from specstream_mlx.io.loading import load_model
    from specstream_mlx.method.msa import lower_layers, prefix_tree_mask
    from specstream_mlx.method.tree import tree_buffers
    from specstream_mlx.models.fusion import fuse_projections

    _, _, dst = hf_models(arch)
    model, _ = load_model(dst)
    fuse_projections(model)
    parents = (-1, 0, 0, 1, 1, 2, 3)
    buf = tree_buffers(parents)
    ca, cb = _prefilled_pair(model)
    offset = ca[0].offset
    positions = mx.array((offset + buf.depths)[None].astype(np.int32))
    tokens = mx.array([[11, 12, 13, 14, 15, 16, 17]], dtype=mx.int32)
    mask = prefix_tree_mask(offset, buf.ancestor_mask)
    got = lower_layers(model, SimpleNamespace(first_layer=len(model.layers)), tokens, positions, mask, ca, 2)
    want = model.embed(tokens)
    rot = model.rotation(positions)
    for layer, c in zip(model.layers, cb):
        want = layer(want, mask, c, rot)
    assert got.shape == want.shape == (1, len(parents), model.args.hidden_size)
    np.testing.assert_allclose(np.array(got), np.array(want), atol=1e-5)
    for a, b in zip(ca, cb):
        assert a.offset == b.offset == offset + len(parents)
        rows = slice(0, a.offset)
        np.testing.assert_allclose(np.array(a.keys[..., rows, :]), np.array(b.keys[..., rows, :]), atol=1e-5)


def test_blas_setting_is_parsed_and_refused_in_one_line(monkeypatch):
    from specstream_mlx import platform_info as P

    monkeypatch.setattr(P, "find_blas", lambda name: f"/lib/{name}.so" if name == "openblas" else None)
    monkeypatch.setattr(P, "openblas_coretype", lambda path: None)  # OpenBLAS knows this CPU
    # The default falls through the preference order to what is installed.
    c = P.choose_blas(None, gemv=False)
    assert c.library.name == "openblas" and c.threads == P.LIBRARIES["openblas"].threads
    assert c.env() == {"LD_PRELOAD": "/lib/openblas.so", "OPENBLAS_NUM_THREADS": "2", "OPENBLAS_THREAD_TIMEOUT": "4"}
    monkeypatch.setattr(P, "openblas_coretype", lambda path: "SkylakeX" if path == "/lib/openblas.so" else None)
    assert c.env()["OPENBLAS_CORETYPE"] == "SkylakeX"  # it does not: its best kernels named
    monkeypatch.setattr(P, "gemv_forwarder", lambda: "/cache/libspecstream-gemv.so")
    assert P.choose_blas(None).env()["LD_PRELOAD"] == "/cache/libspecstream-gemv.so:/lib/openblas.so"
    assert P.choose_blas("openblas:1").env()["OPENBLAS_NUM_THREADS"] == "1"
    assert P.choose_blas("none").path is None and P.choose_blas("none").env() == {}
    for bad, needle in (("blis", "install libblis4-pthread"), ("openblas:0", "positive"), ("mkl", "unknown")):
        with pytest.raises(P.BlasSettingError, match=needle):
            P.choose_blas(bad)
    with pytest.raises(P.BlasSettingError, match="no such file"):
        P.choose_blas("/nowhere/libblas.so")


def test_allocator_setting_is_parsed_and_refused_in_one_line(monkeypatch):
    from specstream_mlx import platform_info as P

    installed = {"tcmalloc": "/lib/libtcmalloc_minimal.so.4", "mimalloc": "/lib/libmimalloc.so.2"}
    monkeypatch.setattr(P, "find_malloc", lambda name: installed.get(name))
    monkeypatch.delenv("MALLOC_CONF", raising=False)
    monkeypatch.setattr(P.sys, "platform", "linux")
    # The default is the first of the preference order that is installed; glibc is none.
    assert P.choose_malloc(None) == P.choose_malloc("") == installed[P.MALLOC_PREFERENCE[1]]
    assert P.choose_malloc("glibc") is None and P.choose_malloc("mimalloc") == installed["mimalloc"]
    bad_settings = (("jemalloc", "install libjemalloc2"), ("hoard", "unknown allocator"), ("/no/lib.so", "no such"))
    for bad, needle in bad_settings:
        with pytest.raises(P.BlasSettingError, match=needle):
            P.choose_malloc(bad)
    # Preloaded first, in front of the forwarder and the BLAS; alone when there is no BLAS.
    monkeypatch.setattr(P, "find_blas", lambda name: f"/lib/{name}.so" if name == "openblas" else None)
    monkeypatch.setattr(P, "gemv_forwarder", lambda: "/cache/libspecstream-gemv.so")
    env = P.choose_blas(None, malloc="tcmalloc").env()
    assert env["LD_PRELOAD"] == "/lib/libtcmalloc_minimal.so.4:/cache/libspecstream-gemv.so:/lib/openblas.so"
    assert P.choose_blas("none", malloc="mimalloc").env() == {"LD_PRELOAD": "/lib/libmimalloc.so.2"}
    assert P.choose_blas(None).malloc is None  # the library call's default: no allocator
    # jemalloc comes with its memory in huge pages; the others with nothing of the kind.
    installed["jemalloc"] = "/lib/libjemalloc.so.2"
    env = P.choose_blas("none", malloc="jemalloc").env()
    assert env == {"LD_PRELOAD": "/lib/libjemalloc.so.2", "MALLOC_CONF": "thp:always"}
    assert "MALLOC_CONF" not in P.choose_blas(None, malloc="tcmalloc").env()


_ALLOCATOR = """
import re
import mlx.core as mx
from specstream_mlx.platform_info import malloc_in_use
a = mx.ones((32 << 20,))  # 128 MB, as a model's weights are allocated
mx.eval(a)
huge = re.search(r"AnonHugePages:\\s*(\\d+)", open("/proc/self/smaps_rollup").read())
print(malloc_in_use().split()[0], int(huge.group(1)) if huge else -1)
"""


def _huge_pages_on_request() -> bool:
    """Whether this kernel gives transparent huge pages to memory that asks for them."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[never]" not in f.read()
    except OSError:
        return False


def test_the_cli_runs_under_the_chosen_allocator():
    """MLX frees on its stream thread what the graph-building thread allocated; glibc's
    allocator took 2-5 ms of a SmolLM2 step for it (bench/malloc.md). The CLI re-executes
    itself once with the chosen allocator preloaded (only a process's start can replace
    malloc), names it in doctor, and refuses a wrong setting in one line. jemalloc comes
    with ``MALLOC_CONF=thp:always`` (a value set by hand wins): its memory is then in huge
    pages, which a plain step and prefill ran faster with."""
    import os

    from specstream_mlx.platform_info import MALLOC_PREFERENCE, _uses_mlx_cpu_wheel, choose_malloc, find_malloc

    if not _uses_mlx_cpu_wheel() or choose_malloc(None) is None:
        pytest.skip("needs MLX's Linux CPU wheel and an allocator package (CI installs both)")
    default = next(n for n in MALLOC_PREFERENCE if find_malloc(n))
    keep = ("LD_PRELOAD", "SPECSTREAM_MALLOC", "SPECSTREAM_BLAS_REEXEC", "MALLOC_CONF")
    env = {k: v for k, v in os.environ.items() if k not in keep}

    def doctor(**extra):
        out = subprocess.run(
            [sys.executable, "-m", "specstream_mlx", "doctor"], capture_output=True, text=True, env={**env, **extra}
        )
        line = next((x for x in out.stdout.splitlines() if x.startswith("malloc:")), "malloc:")
        return out, line.split()[1:2], line.split()[3:]

    out, name, conf = doctor()
    assert out.returncode == 0 and name == [default], out
    assert conf == (["MALLOC_CONF=thp:always"] if default == "jemalloc" else []), out.stdout
    if default == "jemalloc":
        out, _, conf = doctor(MALLOC_CONF="thp:never")
        assert out.returncode == 0 and conf == ["MALLOC_CONF=thp:never"], out.stdout
    out, name, _ = doctor(SPECSTREAM_MALLOC="glibc")
    assert out.returncode == 0 and name == ["glibc"], out
    out, _, _ = doctor(SPECSTREAM_MALLOC="hoard")
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1 and "SPECSTREAM_MALLOC" in out.stderr
    # Programs that import the library get it from the printed environment.
    words = subprocess.run(
        [sys.executable, "-m", "specstream_mlx.blas_env"], capture_output=True, text=True, env=env, check=True
    ).stdout.split()
    printed = dict(w.split("=", 1) for w in words)
    ran = subprocess.run([sys.executable, "-c", _ALLOCATOR], capture_output=True, text=True, env={**env, **printed})
    assert ran.returncode == 0 and ran.stdout.split()[0] == default, ran.stderr
    if default == "jemalloc" and _huge_pages_on_request():
        assert int(ran.stdout.split()[1]) >= 64 << 10, ran.stdout  # KB of the array in huge pages
    bare = subprocess.run([sys.executable, "-c", _ALLOCATOR], capture_output=True, text=True, env=env)
    assert bare.stdout.split()[0] == "glibc", bare.stderr


LOCK_CHECK = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdio.h>

enum { THREADS = 4, TURNS = 200000 };
static pthread_mutex_t shared = PTHREAD_MUTEX_INITIALIZER;
static volatile long counter;

static void *add(void *arg) {
  for (int i = 0; i < TURNS; i++) {
    pthread_mutex_lock(&shared);
    long seen = counter; /* a lost update shows if two threads ever hold the mutex at once */
    counter = seen + 1;
    pthread_mutex_unlock(&shared);
  }
  return arg;
}

int main(void) {
  pthread_t t[THREADS];
  for (int i = 0; i < THREADS; i++)
    pthread_create(&t[i], NULL, add, NULL);
  for (int i = 0; i < THREADS; i++)
    pthread_join(t[i], NULL);
  pthread_mutexattr_t attr;
  pthread_mutex_t rec, chk;
  pthread_mutexattr_init(&attr);
  pthread_mutexattr_settype(&attr, PTHREAD_MUTEX_RECURSIVE);
  pthread_mutex_init(&rec, &attr);
  int twice = pthread_mutex_lock(&rec) == 0 && pthread_mutex_lock(&rec) == 0;  /* a recursive mutex counts */
  twice = twice && pthread_mutex_unlock(&rec) == 0 && pthread_mutex_unlock(&rec) == 0;
  twice = twice && pthread_mutex_unlock(&rec) != 0;  /* ... and is free after two unlocks */
  pthread_mutexattr_settype(&attr, PTHREAD_MUTEX_ERRORCHECK);
  pthread_mutex_init(&chk, &attr);
  pthread_mutex_lock(&chk);
  int again = pthread_mutex_lock(&chk);  /* the owner locking again: EDEADLK, not a hang */
  int (*spins)(void) = (int (*)(void))dlsym(RTLD_DEFAULT, "specstream_lock_spins");
  printf("%ld %d %d %d\n", counter, twice, again == EDEADLK, spins ? spins() : -1);
  return 0;
}
"""


def _run_preloaded(tmp_path, source: str, setting: str, cases, unloaded: list) -> dict:
    """Builds the C program ``source`` and runs it with the forwarder's library preloaded,
    ``setting`` set to each case's value (None: unset), and once without the library (the C
    library's own functions); asserts each run's output words. Returns the environment
    without the preload and the setting."""
    import os
    import shutil

    from specstream_mlx import platform_info as P

    if not P._uses_mlx_cpu_wheel():
        pytest.skip("needs MLX's Linux CPU wheel (CI installs it)")
    choice = P.choose_blas("openblas")
    assert choice.forwarder is not None, "the forwarder did not build (no C compiler?)"
    cc = shutil.which("cc") or shutil.which("gcc")
    (tmp_path / "check.c").write_text(source)
    program = str(tmp_path / "check")
    subprocess.run([cc, "-O2", str(tmp_path / "check.c"), "-o", program, "-lpthread", "-ldl"], check=True)
    bare = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", setting)}
    for value, want in cases:
        env = {**bare, "LD_PRELOAD": choice.forwarder, **({setting: value} if value is not None else {})}
        out = subprocess.run([program], env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0 and out.stdout.split() == want, (value, out)
    out = subprocess.run([program], env=bare, capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == unloaded, out
    return bare


def _doctor_reports(bare: dict, key: str, setting: str, default: str, bad: str) -> None:
    """`doctor` in an environment without the preload (the CLI's re-execution adds it) shows
    ``key`` as ``default``, as 0 with ``setting`` 0, and refuses ``bad`` in one line."""
    env = {k: v for k, v in bare.items() if k not in ("SPECSTREAM_BLAS_REEXEC", "MALLOC_CONF")}
    for value, want in ((None, default), ("0", "0"), (bad, None)):
        extra = {setting: value} if value is not None else {}
        done = subprocess.run(
            [sys.executable, "-m", "specstream_mlx", "doctor"], capture_output=True, text=True, env={**env, **extra}
        )
        if want is None:
            assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1 and setting in done.stderr
        else:
            shown = next((x.split()[1] for x in done.stdout.splitlines() if x.startswith(f"{key}:")), None)
            assert done.returncode == 0 and shown == want, done


def test_mutexes_spin_then_lock_and_still_exclude(tmp_path):
    """MLX's graph-building and stream threads contend for a few mutexes at every
    operation; preloaded, the forwarder's library makes a contended pthread_mutex_lock try
    a bounded number of times before it sleeps (SPECSTREAM_LOCK_SPIN, default 100). A C
    program's threads then still never hold a mutex together (no lost update in 800,000
    increments), a recursive mutex still counts, an error-checking one still refuses its
    owner; the CLI runs with it (doctor) and refuses a bad setting in one line."""
    from specstream_mlx import platform_info as P

    done = ["800000", "1", "1"]  # no lost update, a recursive mutex counts, an error-checking one refuses
    cases = [(None, [*done, "100"]), ("7", [*done, "7"]), ("0", [*done, "0"])]
    bare = _run_preloaded(tmp_path, LOCK_CHECK, P.LOCK_SPIN_ENV, cases, [*done, "-1"])

    _doctor_reports(bare, "lock_spin", P.LOCK_SPIN_ENV, "100", "lots")


COND_CHECK = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <unistd.h>

enum { ITEMS = 100000, SLOTS = 4 };
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t not_full = PTHREAD_COND_INITIALIZER, not_empty = PTHREAD_COND_INITIALIZER;
static long queue[SLOTS], sum;
static int head, count, flag;

static void *produce(void *arg) {
  for (long i = 1; i <= ITEMS; i++) {
    pthread_mutex_lock(&mu);
    while (count == SLOTS)
      pthread_cond_wait(&not_full, &mu);
    queue[(head + count++) % SLOTS] = i;
    pthread_cond_signal(&not_empty);
    pthread_mutex_unlock(&mu);
  }
  return arg;
}

static void *consume(void *arg) {
  for (long i = 0; i < ITEMS; i++) {
    pthread_mutex_lock(&mu);
    while (count == 0)
      pthread_cond_wait(&not_empty, &mu);
    sum += queue[head]; /* an item lost or taken twice shows in the sum */
    head = (head + 1) % SLOTS;
    count--;
    pthread_cond_broadcast(&not_full);
    pthread_mutex_unlock(&mu);
  }
  return arg;
}

static void *late(void *arg) { /* long after any spin gave up: the waiter sleeps, and wakes */
  usleep(20000);
  pthread_mutex_lock(&mu);
  flag = 1;
  pthread_cond_broadcast(&not_empty);
  pthread_mutex_unlock(&mu);
  return arg;
}

int main(void) {
  pthread_t p, c, l;
  pthread_create(&p, NULL, produce, NULL);
  pthread_create(&c, NULL, consume, NULL);
  pthread_join(p, NULL);
  pthread_join(c, NULL);
  pthread_create(&l, NULL, late, NULL);
  pthread_mutex_lock(&mu);
  while (!flag)
    pthread_cond_wait(&not_empty, &mu);
  pthread_mutex_unlock(&mu);
  pthread_join(l, NULL);
  long (*us)(void) = (long (*)(void))dlsym(RTLD_DEFAULT, "specstream_cond_spin_us");
  long (*spun)(void) = (long (*)(void))dlsym(RTLD_DEFAULT, "specstream_cond_spun_waits");
  printf("%ld %d %ld %d\n", sum, flag, us ? us() : -1, spun ? spun() > 0 : -1);
  return 0;
}
"""


def test_condition_waits_poll_then_sleep_and_lose_no_wake_up(tmp_path):
    """The stream thread wakes MLX's graph-building thread, waiting on the scheduler's
    condition variable, at every task it finishes; preloaded, the forwarder's library makes a
    pthread_cond_wait poll for a broadcast or signal for a while (SPECSTREAM_COND_SPIN_US,
    default 200 us) before it sleeps, so such a wake-up needs no system call. A C program's
    100,000 items through a four-slot queue guarded by two condition variables then all
    arrive once (waits ended by a poll among them), a waiter whose poll gave up sleeps and is
    still woken 20 ms later, with the setting's value, 0 and not preloaded alike; the CLI
    reports it (doctor) and refuses a bad one in one line."""
    from specstream_mlx import platform_info as P

    done = [str(100000 * 100001 // 2), "1"]  # every item once; the late waiter woken
    cases = [(None, [*done, "200", "1"]), ("50", [*done, "50", "1"]), ("0", [*done, "0", "0"])]
    bare = _run_preloaded(tmp_path, COND_CHECK, P.COND_SPIN_ENV, cases, [*done, "-1", "-1"])

    _doctor_reports(bare, "cond_spin_us", P.COND_SPIN_ENV, "200", "long")


def test_a_bad_prefetch_setting_is_refused_in_one_line():
    """SPECSTREAM_SKINNY_PREFETCH takes nta, t0, t1 or off; the kernel reads it in C at its
    start, where a misspelt value used to leave the default in place without a word."""
    import os

    from specstream_mlx import platform_info as P

    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "SPECSTREAM_BLAS_REEXEC", "MALLOC_CONF")}
    for value, ok in (("T1x", False), ("", True), ("t0", True)):
        done = subprocess.run(
            [sys.executable, "-m", "specstream_mlx", "doctor"],
            capture_output=True,
            text=True,
            env={**env, P.PREFETCH_ENV: value},
        )
        if ok:
            assert done.returncode == 0, done.stderr
        else:
            lines = done.stderr.strip().splitlines()
            assert done.returncode == 2 and len(lines) == 1, done.stderr
            assert P.PREFETCH_ENV in lines[0] and "'T1x'" in lines[0] and "nta, t0, t1 or off" in lines[0], lines


@pytest.mark.parametrize(
    "name, good, bad",
    [
        ("SPECSTREAM_SKINNY_ROWS", ("0", "9", "48"), ("nine", "-1")),  # "nine" had turned the kernel off
        ("SPECSTREAM_SKINNY_THREADS", ("1", "2"), ("0", "two")),  # either had run it on one thread
        ("SPECSTREAM_SKINNY_MIN_ROWS", ("1", "2"), ("0", "3")),
        ("SPECSTREAM_SKINNY_PARALLEL_MIN", ("0", "262144"), ("-1", "lots")),
        ("SPECSTREAM_SKINNY_SPIN_US", ("0", "50"), ("-5", "long")),
        ("SPECSTREAM_SKINNY_YIELD", ("0", "1"), ("2", "yes")),
        ("SPECSTREAM_SKINNY_ISA", ("avx2", "avx512"), ("sse", "AVX2")),
        ("SPECSTREAM_PRODUCTS", ("exact", "q8", "q16"), ("Q8", "int8", " q8", "q16 ")),  # strcmp in the kernel
    ],
)
def test_every_kernel_setting_is_checked_before_the_kernel_reads_it(monkeypatch, name, good, bad):
    """The kernel reads its settings in C (atoi, strcmp), where a value it cannot read keeps its
    default or turns a mechanism off without a word: the CLI refuses them first, in one line
    that names the setting and the value (BlasSettingError)."""
    from specstream_mlx import platform_info as P

    for value in good:
        monkeypatch.setenv(name, value)
        P.configured_choice(malloc=False)
    for value in bad:
        monkeypatch.setenv(name, value)
        with pytest.raises(P.BlasSettingError, match=name) as e:
            P.configured_choice(malloc=False)
        assert repr(value) in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("setting", ["KBLOCK_ENV", "AHEAD_ENV"])
def test_a_bad_depth_block_or_read_ahead_setting_is_refused_in_one_line(setting):
    """SPECSTREAM_SKINNY_KBLOCK takes a number of depth columns (0: whole depths) and
    SPECSTREAM_SKINNY_AHEAD_KB a number of KB (0: none); the kernel reads them in C with
    atoi, where "lots" would have turned the blocks off without a word."""
    import os

    from specstream_mlx import platform_info as P

    name = getattr(P, setting)

    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "SPECSTREAM_BLAS_REEXEC", "MALLOC_CONF")}
    for value, ok in (("lots", False), ("-5", False), ("99999999999", False), ("", True), ("0", True), ("256", True)):
        done = subprocess.run(
            [sys.executable, "-m", "specstream_mlx", "doctor"],
            capture_output=True,
            text=True,
            env={**env, name: value},
        )
        if ok:
            assert done.returncode == 0, done.stderr
        else:
            lines = done.stderr.strip().splitlines()
            assert done.returncode == 2 and len(lines) == 1, done.stderr
            assert name in lines[0] and repr(value) in lines[0], lines


GEMV_CHECK = r"""
import json, sys
import mlx.core as mx, numpy as np
from specstream_mlx.platform_info import gemv_forwarding, skinny_ahead_kb, skinny_kernel, skinny_prefetch
rng = np.random.default_rng(0)
worst = 0.0
cases = []
# One row, both weight layouts, a strided row, alpha/beta (the GEMV path and the kernel).
for k, n in ((64, 96), (576, 192), (1536, 576), (7, 3)):
    w = rng.standard_normal((n, k)).astype(np.float32)  # a weight, (out, in)
    x = rng.standard_normal((1, k)).astype(np.float32)
    big = rng.standard_normal((k, 5)).astype(np.float32)
    cases += [
        (mx.array(x) @ mx.array(w).T, x @ w.T),  # b transposed: one row times a weight
        (mx.array(x) @ mx.array(w.T.copy()), x @ w.T),  # b as stored
        (mx.array(big)[:, 2:3].T @ mx.array(w).T, big[:, 2:3].T @ w.T),  # a with a stride
        (mx.array(np.vstack([x, x * 2])) @ mx.array(w).T, np.vstack([x, x * 2]) @ w.T),  # two rows
        (mx.addmm(mx.ones((1, n)), mx.array(x), mx.array(w).T, alpha=0.5, beta=2.0), 2.0 + 0.5 * (x @ w.T)),
    ]
# A few rows (a tree pass): every row-tile remainder, columns not a multiple of the tile,
# depths not a multiple of the vector, rows and weights with a leading stride, more rows
# than a tile takes (in blocks by a small weight, up to 192 rows; else GEMM), alpha/beta,
# and a product large enough for the pool.
# Each weight is drawn once and multiplied by every row count (drawing it anew for each
# took most of this check's time).
# (64, 40) and (64, 200): a short depth, as attention's scores and values have, with
# every column-block remainder of the transposed and the stored-(k x n) tiles; (70, 300):
# a short depth past whole 16 x 16 transpositions, by keys enough for the pool (a thin operand).
# (1100, 37): a depth split into blocks with a short last one (SPECSTREAM_SKINNY_KBLOCK).
for k, n in ((576, 197), (13, 70), (1536, 576), (1100, 37), (576, 4099), (64, 40), (64, 200), (70, 300)):
    w = rng.standard_normal((n, k + 5)).astype(np.float32)[:, 2 : k + 2]  # ldb > k
    wt = np.ascontiguousarray(w.T)  # b stored (k x n), as attention's values are
    # MLX copies a strided weight before it multiplies (as stored, k x n); a contiguous one
    # reaches the kernel transposed (n x k), as attention's keys and every weight do.
    w_mx, wt_mx, wc_mx = mx.array(w), mx.array(wt), mx.array(np.ascontiguousarray(w))
    for m in (1, 2, 3, 4, 5, 6, 7, 9, 13, 16, 31, 32, 33, 47, 48, 49, 51, 80, 97, 192, 193):
        a = rng.standard_normal((m, k + 3)).astype(np.float32)[:, 1 : k + 1]  # lda > k
        cases.append((mx.array(a) @ w_mx.T, a @ w.T))
        cases.append((mx.array(a) @ wc_mx.T, a @ w.T))
        cases.append((mx.array(a) @ wt_mx, a @ wt))
        c0 = rng.standard_normal((m, n)).astype(np.float32)
        got = mx.addmm(mx.array(c0), mx.array(a), w_mx.T, alpha=0.5, beta=-1.5)
        cases.append((got, -1.5 * c0 + 0.5 * (a @ w.T)))
for got, want in cases:
    worst = max(worst, float(np.abs(np.array(got) - want).max() / (np.abs(want).max() + 1e-6)))
# A row's output is the same bits in a product of many rows and of it alone (a tree pass's
# logits and a plain step's), at depths the kernel multiplies whole and in blocks.
rows_apart = 0.0
for k, n in ((576, 300), (1536, 200), (1100, 37)):
    w_mx = mx.array(rng.standard_normal((n, k)).astype(np.float32))
    a = mx.array(rng.standard_normal((13, k)).astype(np.float32))
    together = np.array(a @ w_mx.T)
    for i in range(13):
        rows_apart = max(rows_apart, float(np.abs(np.array(a[i : i + 1] @ w_mx.T)[0] - together[i]).max()))
print(json.dumps({"forwarding": gemv_forwarding(), "skinny": skinny_kernel(), "prefetch": skinny_prefetch(),
                  "ahead": skinny_ahead_kb(), "worst": worst, "rows_apart": rows_apart}))
"""


def _cpuinfo(key: str) -> str:
    """The first CPU's ``key`` line of /proc/cpuinfo ('' where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.split(":")[0].strip() == key), "")
    except OSError:
        return ""


def _cpu_flags() -> set:
    return set(_cpuinfo("flags").split())


@pytest.mark.parametrize("library", ["blis", "openblas"])
@pytest.mark.parametrize("kernel", ["avx512", "avx2", "two-rows-up", "pausing", "t0-sleeping", "nta", "t1", "gemv"])
def test_forwarded_products_compute_what_gemm_does(library, kernel):
    """With the forwarder preloaded in front of each installed BLAS, products of one and
    of a few rows (both weight layouts, strided rows and weights, every tile remainder,
    alpha/beta) equal NumPy's, through its own kernel's AVX-512 and AVX2 tiles, with one-row
    products left to the library's GEMV, with workers that pause instead of yielding while
    they wait (and read 512 KB ahead, a setting the kernel reports), with T0 prefetches at
    every row count and workers that sleep between all products (each product wakes them),
    with NTA prefetches and with T1 (the default) named explicitly, and with the kernel off."""
    import json
    import os
    import subprocess
    import sys

    from specstream_mlx import platform_info as P

    if P.find_blas(library) is None:
        pytest.fail(f"{library} is not installed: .ci/run installs both libraries")
    choice = P.choose_blas(library)
    assert choice.forwarder is not None, "the forwarder did not build (no C compiler?)"
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD" and not k.startswith("SPECSTREAM_SKINNY")}
    env.update(choice.env())
    if kernel == "gemv":
        env["SPECSTREAM_SKINNY_ROWS"] = "0"
    elif kernel == "avx2":
        env["SPECSTREAM_SKINNY_ISA"] = "avx2"
    elif kernel == "two-rows-up":
        env["SPECSTREAM_SKINNY_MIN_ROWS"] = "2"
    elif kernel == "pausing":
        env.update(SPECSTREAM_SKINNY_YIELD="0", SPECSTREAM_SKINNY_AHEAD_KB="512")
    elif kernel == "t0-sleeping":
        env.update(SPECSTREAM_SKINNY_PREFETCH="t0", SPECSTREAM_SKINNY_SPIN_US="0")
    elif kernel in ("nta", "t1"):
        env["SPECSTREAM_SKINNY_PREFETCH"] = kernel
    out = subprocess.run([sys.executable, "-c", GEMV_CHECK], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["forwarding"] is True and res["worst"] < 1e-5, res
    flags = _cpu_flags()
    if kernel == "gemv" or not {"avx2", "fma"} <= flags:
        assert res["skinny"] is None, res
    else:  # AVX-512 tiles where the CPU has them (and they were not declined), else AVX2
        bits = 512 if kernel != "avx2" and "avx512f" in flags else 256
        least = 2 if kernel == "two-rows-up" else 1
        assert res["skinny"] is not None and res["skinny"][0] == least and res["skinny"][1] >= 32, res
        assert res["skinny"][3] == bits, res
        if kernel != "two-rows-up":  # one row in the kernel too: the same arithmetic as many
            assert res["rows_apart"] == 0.0, res
        # The setting is the kernel's (a name it does not know would leave the default).
        if kernel in ("nta", "t1"):
            assert res["prefetch"] == kernel, res
        elif kernel == "t0-sleeping":
            assert res["prefetch"] == "t0", res
        else:
            assert res["prefetch"] == "t1", res
        assert res["ahead"] == (512 if kernel == "pausing" else 1024), res


STORED_CHECK = r"""
import ctypes, json
import mlx.core as mx, numpy as np
from specstream_mlx.platform_info import _symbol, skinny_kernel
from specstream_mlx.runtime.stored_weights import _kernel, _pointer, served

register, unregister = _kernel()
most = skinny_kernel()[1]
rng = np.random.default_rng(0)
repacked = _symbol("specstream_stored_repacked")
held = _symbol("specstream_stored_bytes")
held.restype, held.argtypes = ctypes.c_longlong, [ctypes.c_void_p]
out = {"cases": 0, "apart": [], "served": [], "expected": [], "refused": [], "repacked": []}
out.update(held=[], want_held=[])


def expanded(k, n, bits, group, f16):
    q, s, b = mx.quantize(mx.array(rng.standard_normal((n, k)).astype(np.float32)), group_size=group, bits=bits)
    if f16:  # scales (and, unless f16 == "scales", biases) as a float16 file stores them
        s = s.astype(mx.float16).astype(mx.float32)
        b = b if f16 == "scales" else b.astype(mx.float16).astype(mx.float32)
    w = mx.dequantize(q, s, b, group, bits)
    mx.eval(q, s, b, w)
    return w, (q, s, b)


def reg(w, form, bits, group):
    q, s, b = form
    return register(_pointer(w), w.shape[0], w.shape[1], _pointer(q), bits, group, _pointer(s), _pointer(b))


# Widths, groups, depths whole (576) and in blocks (1536, with the kernel's 512-column
# blocks), and columns not a multiple of the tile; every row count a tile takes, and more
# (49 and 80 rows: these weights are small, so the kernel takes them in blocks of rows).
# Scales as float16 (every code times a scale exact: one multiply-add expands; the kernel then
# holds them and the biases as float16) and as float32 (two roundings); float16 scales with
# float32 biases (both held as float32).
for bits, group, k, n, f16 in [
    (4, 32, 576, 197, True), (8, 32, 1536, 70, True), (4, 64, 1536, 133, False), (8, 128, 640, 64, False),
    (4, 32, 160, 35, True), (4, 32, 576, 64, "scales")]:
    w, form = expanded(k, n, bits, group, f16)
    rows = [rng.standard_normal((m, k)).astype(np.float32) for m in (1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 32, 48, 49, 80)]
    plain = [np.array(mx.array(a) @ w.T) for a in rows]  # not registered: the float32 kernel
    assert reg(w, form, bits, group) == 1, (bits, group, k, n)
    out["repacked"].append(repacked())
    out["held"].append(held(_pointer(w)))
    out["want_held"].append(n * k * bits // 8 + 2 * n * (k // group) * (2 if f16 is True else 4))
    before = served()
    for a, want in zip(rows, plain):
        got = np.array(mx.array(a) @ w.T)
        out["cases"] += 1
        if not np.array_equal(got.view(np.uint32), want.view(np.uint32)):
            out["apart"].append([bits, group, k, n, a.shape[0], float(np.abs(got - want).max())])
    out["served"].append(served() - before)
    out["expected"] += [sum(-(-a.shape[0] // most) for a in rows), 0]  # one per product, or per block of rows
    unregister(_pointer(w))
    before = served()
    mx.eval(mx.array(rows[0]) @ w.T)
    out["served"].append(served() - before)  # unregistered: read as float32 again
# Refused: a form whose values are not the weight's, a depth of 128 or less, a group that is
# not a power of two, a width the kernel does not take.
w, (q, s, b) = expanded(576, 64, 4, 32, True)
off = mx.array(np.array(w) + np.float32(1e-3))
mx.eval(off)
out["refused"] = [reg(off, (q, s, b), 4, 32)]
w2, form2 = expanded(128, 64, 4, 32, True)
out["refused"].append(reg(w2, form2, 4, 32))
out["refused"].append(reg(w, (q, s, b), 4, 48))
out["refused"].append(reg(w, (q, s, b), 3, 32))
print(json.dumps(out))
"""


@pytest.mark.parametrize("isa", ["avx512", "avx2", "avx512-buffer", "avx512-blocks"])
def test_weights_read_as_stored_give_the_float32_products_bits(isa):
    """The kernel reading a quantized weight's stored form (4 and 8 bits, groups of 32 to
    128, depths whole and in blocks, every row count its tiles take, more rows in blocks;
    2-9 rows expanded in registers, and through the buffer with
    ``SPECSTREAM_SKINNY_FUSED_ROWS=1``; depth blocks that are not whole steps of the
    register loops, ``SPECSTREAM_SKINNY_KBLOCK=400``) gives the bits the float32 weight
    gives, an unregistered weight is read as float32 again, and a form whose values are not
    the weight's (or a shape the kernel does not take) is refused. Scales and biases that are
    all exactly float16 are held (and read) as float16: the bytes the kernel reports."""
    import json
    import os
    import subprocess
    import sys

    from specstream_mlx import platform_info as P

    choice = P.choose_blas("openblas")
    assert choice.forwarder is not None, "the forwarder did not build (no C compiler?)"
    if not {"avx2", "fma"} <= _cpu_flags():
        pytest.fail("the kernel needs AVX2 and FMA: this CPU cannot run the product kernel at all")
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD" and not k.startswith("SPECSTREAM_SKINNY")}
    env.update(choice.env())
    env["SPECSTREAM_PRODUCTS"] = "exact"  # the float32 products (the default takes 16-bit activations)
    if isa == "avx2":
        env["SPECSTREAM_SKINNY_ISA"] = "avx2"
    if isa == "avx512-buffer":  # 2-9 rows through the buffer, as from 10 rows on
        env["SPECSTREAM_SKINNY_FUSED_ROWS"] = "1"
    if isa == "avx512-blocks":  # 1536 deep in blocks of 400: not whole steps of 32
        env["SPECSTREAM_SKINNY_KBLOCK"] = "400"
    out = subprocess.run([sys.executable, "-c", STORED_CHECK], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["cases"] == 84 and res["apart"] == [], res
    assert res["held"] == res["want_held"], res
    # One row reads four-bit codes repacked where the kernel runs AVX-512.
    avx512 = isa != "avx2" and "avx512f" in _cpu_flags()
    assert res["repacked"] == [int(avx512), 0, int(avx512), 0, int(avx512), int(avx512)], res
    # Every product served (in blocks of rows beyond the tiles' most); none once unregistered.
    assert res["served"] == res["expected"] and res["served"][0] >= 14, res
    assert res["refused"] == [0, 0, 0, 0], res


FORK_CHECK = r"""
import ctypes, os, time
import numpy as np
# MLX itself does not survive a fork (its stream threads stay behind), so the products
# are called through the preloaded cblas_sgemm directly, as MLX calls it.
sgemm = ctypes.CDLL(None).cblas_sgemm
P = ctypes.POINTER(ctypes.c_float)
w = np.random.default_rng(0).standard_normal((4096, 576)).astype(np.float32)
x = np.ones((3, 576), np.float32)


def product():
    c = np.zeros((3, 4096), np.float32)
    f, i = ctypes.c_float, ctypes.c_int
    sgemm(i(101), i(111), i(112), i(3), i(4096), i(576), f(1.0), x.ctypes.data_as(P), i(576),
          w.ctypes.data_as(P), i(576), f(0.0), c.ctypes.data_as(P), i(4096))
    return float(np.abs(c - x @ w.T).max())


assert product() < 1e-3  # the pool's workers start in this process
pid = os.fork()
if pid == 0:  # the child has no workers: its products must still finish, and be right
    os._exit(0 if product() < 1e-3 else 3)
for _ in range(300):  # 30 s; a child that hangs is killed, never left spinning
    done, status = os.waitpid(pid, os.WNOHANG)
    if done:
        print(os.waitstatus_to_exitcode(status))
        break
    time.sleep(0.1)
else:
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    print("hung")
"""


def test_forwarded_products_in_a_forked_child():
    """A child forked after the kernel's threads started has none of them; its products
    run on its own thread instead of waiting forever for workers that do not exist."""
    import os
    import subprocess
    import sys

    from specstream_mlx import platform_info as P

    choice = P.choose_blas("openblas")
    assert choice.forwarder is not None, "the forwarder did not build (no C compiler?)"
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD" and not k.startswith("SPECSTREAM_SKINNY")}
    env.update(choice.env())
    out = subprocess.run([sys.executable, "-c", FORK_CHECK], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip().splitlines()[-1] == "0", (out.stdout, out.stderr)


# The product kernel's last-level cache size as it reckons it: the largest sysfs reports (else
# 32 MiB). Scripts that stream weights through the kernel make them outgrow it.
_LLC = r"""
llc = 32 << 20
for j in range(8):
    try:
        text = open(f"/sys/devices/system/cpu/cpu0/cache/index{j}/size").read().strip()
    except OSError:
        break
    llc = max(llc, int(text.rstrip("KM")) << {"K": 10, "M": 20}.get(text[-1], 0))
"""

REGIME_CHECK = (
    r"""
import ctypes, os, time
import numpy as np
lib = ctypes.CDLL(None)
sgemm, streaming = lib.cblas_sgemm, lib.specstream_skinny_streaming
P = ctypes.POINTER(ctypes.c_float)
f, i = ctypes.c_float, ctypes.c_int
"""
    + _LLC
    + r"""


def product(w):
    n, k = w.shape
    x, c = np.ones((1, k), np.float32), np.zeros((1, n), np.float32)
    sgemm(i(101), i(111), i(112), i(1), i(n), i(k), f(1.0), x.ctypes.data_as(P), i(k),
          w.ctypes.data_as(P), i(k), f(0.0), c.ctypes.data_as(P), i(n))
    assert abs(float(c.max()) - k) < 1e-3 and abs(float(c.min()) - k) < 1e-3


verdicts = [streaming()]
small = [np.ones((256, 256), np.float32) for _ in range(2)]  # 256 KB each: cached
for _ in range(100):
    product(small[_ % 2])
verdicts.append(streaming())
big = [np.ones((1024, 1024), np.float32) for _ in range(2 * llc // (4 << 20) + 16)]  # twice the cache
for w in big:
    product(w)
verdicts.append(streaming())
# Streamed in the same order again, a waiting worker reads the next weight ahead, and a
# product whose rows it read still computes every output (an item left out stays 0).
set_ahead, ahead_read = lib.specstream_skinny_set_ahead_kb, lib.specstream_skinny_ahead_read
ahead_read.restype = ctypes.c_longlong
set_ahead(ctypes.c_long(1024))
before = ahead_read()
for w in big:
    product(w)
set_ahead(ctypes.c_long(0))
product(big[0])  # a read under way stops at the next product and is then counted
product(big[1])
time.sleep(0.05)
after = ahead_read()
for w in big:
    product(w)
print("read ahead", after > before, ahead_read() == after)
del big
for _ in range(2 * 4096 + 100):  # a whole window of the small ones only: cached again
    product(small[_ % 2])
verdicts.append(streaming())
print(verdicts)
"""
)


def test_the_kernel_tells_weights_in_the_cache_from_weights_streamed():
    """Products split between the threads from a lower size once the weights seen outgrow
    the last-level cache; the verdict follows the recent products only, so a process that
    moves to small weights (or frees many buffers) is taken as cached again. While the
    weights stream, the kernel's waiting worker reads the weight that came next last time
    ahead (and not once that is set to 0), and every output is still computed."""
    import os
    import subprocess
    import sys

    from specstream_mlx import platform_info as P

    if not {"avx2", "fma"} <= _cpu_flags():
        pytest.skip("the kernel needs AVX2 and FMA (CI's machines have both)")
    choice = P.choose_blas("openblas")
    assert choice.forwarder is not None, "the forwarder did not build (no C compiler?)"
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD" and not k.startswith("SPECSTREAM_SKINNY")}
    env.update(choice.env())
    out = subprocess.run([sys.executable, "-c", REGIME_CHECK], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert lines[-1] == "[0, 0, 1, 0]", out.stdout
    if (os.cpu_count() or 1) > 1:  # a worker to read ahead (CI's machines have two cores)
        assert lines[-2] == "read ahead True True", out.stdout


STORED_AHEAD_CHECK = (
    r"""
import ctypes, json, time
import mlx.core as mx, numpy as np
from specstream_mlx.runtime.stored_weights import _kernel, _pointer
lib = ctypes.CDLL(None)
set_ahead, ahead_read = lib.specstream_skinny_set_ahead_kb, lib.specstream_skinny_ahead_read
ahead_read.restype = ctypes.c_longlong
register, unregister = _kernel()
"""
    + _LLC
    + r"""
N = K = 1024
held = []
for _ in range(2 * llc // (4 << 20) + 16):  # their float32 bytes twice the cache: streamed
    q, s, b = mx.quantize(mx.random.normal((N, K)), group_size=32, bits=4)
    w = mx.dequantize(q, s, b, 32, 4)
    mx.eval(q, s, b, w)
    assert register(_pointer(w), N, K, _pointer(q), 4, 32, _pointer(s), _pointer(b)) == 1
    held.append((w, q, s, b))
x = mx.random.normal((1, K))
mx.eval(x)


def products():
    return [np.array(x @ w.T) for w, *_ in held]


set_ahead(ctypes.c_long(0))
want = products()
products()  # the order the weights follow each other in, noted
half = (N // 2) * (K // 2 + 2 * (K // 32) * 4)  # codes, scales and biases of the first half
read, most, same = 0, 0, True
for attempt in range(3):  # a worker that got no core between products reads nothing: again
    set_ahead(ctypes.c_long(1024))
    before = ahead_read()
    got = products()
    set_ahead(ctypes.c_long(0))
    products()  # a read under way stops at the next product and is then counted
    time.sleep(0.05)
    read += ahead_read() - before
    most += len(held) * half
    same = same and all(np.array_equal(a.view(np.uint32), b.view(np.uint32)) for a, b in zip(got, want))
    if read:
        break
print(json.dumps({"read": read, "most": most, "same": same}))
"""
)


def test_a_waiting_worker_reads_the_next_weights_stored_bytes_ahead():
    """Weights read as stored stream from memory as their codes, scales and biases: the
    waiting worker reads those of the next weight's first half ahead (never more: not its
    float32 bytes, which no product reads), and every output keeps its bits."""
    import json
    import os
    import subprocess
    import sys

    from specstream_mlx import platform_info as P

    if not {"avx2", "fma"} <= _cpu_flags():
        pytest.skip("the kernel needs AVX2 and FMA (CI's machines have both)")
    if (os.cpu_count() or 1) < 2:
        pytest.skip("no worker to read ahead on one CPU (CI's machines have two)")
    choice = P.choose_blas("openblas")
    assert choice.forwarder is not None, "the forwarder did not build (no C compiler?)"
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD" and not k.startswith("SPECSTREAM_SKINNY")}
    env.update(choice.env())
    script = [sys.executable, "-c", STORED_AHEAD_CHECK]
    out = subprocess.run(script, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["same"], res
    assert 0 < res["read"] <= res["most"], res


_IN_PROCESS = """
import sys
if sys.argv[1] == "mlx-first":
    import mlx.core  # too early: the library can no longer put a BLAS in front of MLX's
import specstream_mlx
from specstream_mlx import load
from specstream_mlx.platform_info import blas_in_use, gemv_forwarding
load(sys.argv[2], warn=True)
load(sys.argv[2], warn=True)
print(blas_in_use().split()[0], gemv_forwarding())
"""


def test_importing_the_library_loads_the_fast_blas_in_process(tiny_model_dir):
    """A script that imports the library without the CLI's re-exec ran 3.7x slower on the
    reference BLAS without a word. Importing specstream_mlx first now loads the chosen BLAS
    (and the forwarder) in-process; importing mlx first warns once, with the fix."""
    import os

    from specstream_mlx.platform_info import _uses_mlx_cpu_wheel, choose_blas

    if not _uses_mlx_cpu_wheel() or choose_blas(None).path is None:
        pytest.skip("needs MLX's Linux CPU wheel and a system BLAS (CI installs both)")
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "SPECSTREAM_BLAS", "SPECSTREAM_BLAS_REEXEC")}
    fast = subprocess.run(
        [sys.executable, "-c", _IN_PROCESS, "library-first", str(tiny_model_dir)],
        capture_output=True,
        text=True,
        env=env,
    )
    assert fast.returncode == 0, fast.stderr
    library, forwarding = fast.stdout.split()
    assert library in ("openblas", "blis") and forwarding == "True" and "reference BLAS" not in fast.stderr
    slow = subprocess.run(
        [sys.executable, "-c", _IN_PROCESS, "mlx-first", str(tiny_model_dir)], capture_output=True, text=True, env=env
    )
    assert slow.returncode == 0 and slow.stdout.split()[0] == "reference", slow.stderr
    assert slow.stderr.count("reference BLAS") == 1 and "import specstream_mlx before mlx" in slow.stderr


def test_openblas_threads_sleep_after_their_products_unless_set_by_hand():
    """OpenBLAS's threads spun ~90 ms after a prompt's products, taking the cores from the
    first decoding steps. A process that loads it in-process gets OPENBLAS_THREAD_TIMEOUT=4
    (they sleep at once); a value set by hand is kept."""
    import os

    from specstream_mlx.platform_info import _uses_mlx_cpu_wheel, choose_blas

    choice = choose_blas(None)
    if not _uses_mlx_cpu_wheel() or choice.library is None or choice.library.name != "openblas":
        pytest.fail("needs MLX's Linux CPU wheel and OpenBLAS (CI installs both)")
    drop = ("LD_PRELOAD", "SPECSTREAM_BLAS", "SPECSTREAM_BLAS_REEXEC", "OPENBLAS_THREAD_TIMEOUT")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    code = "import os, specstream_mlx; print(os.environ.get('OPENBLAS_THREAD_TIMEOUT'))"
    for extra, want in (({}, "4"), ({"OPENBLAS_THREAD_TIMEOUT": "20"}, "20")):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**env, **extra})
        assert out.returncode == 0 and out.stdout.split() == [want], out.stderr


def test_benchmark_headers_name_the_cpus_family_and_model():
    """A VM shows a bare "AMD EPYC" for hosts whose memory differs twofold: the name carries
    the first processor's x86 family and model, and only what /proc/cpuinfo gives."""
    from specstream_mlx.platform_info import cpu_name_from

    two = "processor\t: 0\ncpu family\t: 25\nmodel\t\t: 17\nmodel name\t: AMD EPYC\n\n"
    two += "processor\t: 1\nmodel name\t: Other\n"
    assert cpu_name_from(two) == "AMD EPYC, family 25 model 17"
    assert cpu_name_from("model name : Apple M2\n") == "Apple M2"
    assert cpu_name_from("processor : 0\ncpu family : 25\n") is None


def test_openblas_is_told_its_best_kernels_only_where_it_took_the_cpu_for_an_unknown_one():
    """Debian's OpenBLAS 0.3.21 did not know an Intel Xeon of model 207 and ran its generic
    SSE3 kernels ("Prescott") on an AVX-512 CPU: prompts took 2.6x as long. Only that
    fallback is replaced, by what the CPU's flags allow; any choice of its own stands."""
    from specstream_mlx.openblas_core import AVX2, AVX512, core_for, coretype_setting

    sse = frozenset({"sse2", "sse3", "avx"})
    assert coretype_setting("Prescott", AVX512 | AVX2 | sse) == "SkylakeX"
    assert coretype_setting("PRESCOTT\n", AVX2 | sse) == "Haswell"
    assert coretype_setting("Prescott", sse) is None  # nothing better to name
    assert coretype_setting("Prescott", AVX512 - {"avx512vl"} | AVX2) == "Haswell"  # all five or none
    for own in ("Haswell", "Zen", "SkylakeX", "Cooperlake", None):
        assert coretype_setting(own, AVX512 | AVX2) is None
    assert core_for(frozenset()) is None


def test_openblas_kernels_are_asked_once_per_library_and_cpu(tmp_path, monkeypatch):
    from specstream_mlx import openblas_core
    from specstream_mlx.platform_info import find_blas

    path = find_blas("openblas")
    if path is None:
        pytest.fail("needs OpenBLAS (CI installs it)")
    flags = openblas_core.cpu_flags()
    name = openblas_core.detected_core(path, tmp_path, flags)
    assert name and name.isprintable(), name
    assert [p.read_text().strip() for p in (tmp_path / "native").iterdir()] == [name]

    children = []

    def no_child(*args, **kwargs):
        children.append(args)
        raise OSError("no child process here")

    monkeypatch.setattr(openblas_core.subprocess, "run", no_child)
    assert openblas_core.detected_core(path, tmp_path, flags) == name and not children  # from the record
    # Another CPU (other flags) is another record: asked anew, and here the child cannot run.
    assert openblas_core.detected_core(path, tmp_path, flags | {"made-up-flag"}) is None and len(children) == 1
    assert len(list((tmp_path / "native").iterdir())) == 1  # nothing half-written


def test_processes_run_openblas_on_kernels_this_cpu_can_use():
    """What a test, a script importing the library and the CLI's re-exec all get: OpenBLAS on
    its own choice of kernels, or the one named for it where it fell back to the generic ones;
    a setting made by hand is kept (and passed on by blas_env)."""
    import os

    from specstream_mlx.openblas_core import CORETYPE_ENV, core_for, cpu_flags
    from specstream_mlx.platform_info import _uses_mlx_cpu_wheel, choose_blas

    choice = choose_blas(None)
    if not _uses_mlx_cpu_wheel() or choice.library is None or choice.library.name != "openblas":
        pytest.fail("needs MLX's Linux CPU wheel and OpenBLAS (CI installs both)")
    drop = ("LD_PRELOAD", "SPECSTREAM_BLAS", "SPECSTREAM_BLAS_REEXEC", CORETYPE_ENV)
    env = {k: v for k, v in os.environ.items() if k not in drop}
    code = "import specstream_mlx; from specstream_mlx.platform_info import blas_core; print(blas_core())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    core = out.stdout.strip()
    assert core and core != "None"
    if core_for(cpu_flags()) is not None:
        assert core.lower() != "prescott", "OpenBLAS runs its generic kernels on a CPU with AVX2"
    by_hand = {**env, CORETYPE_ENV: "Haswell"}
    printed = subprocess.run(
        [sys.executable, "-m", "specstream_mlx.blas_env"],
        capture_output=True,
        text=True,
        env=by_hand,
    )
    assert printed.returncode == 0 and f"{CORETYPE_ENV}=Haswell" in printed.stdout.split(), printed.stderr
    hand = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=by_hand)
    assert hand.returncode == 0 and hand.stdout.strip() == "Haswell", hand.stderr


def test_the_kernel_compiler_adds_its_flags_only_where_the_cpu_has_them(tmp_path, monkeypatch):
    from specstream_mlx import cpu_jit

    fake = tmp_path / "bin" / "g++"
    fake.parent.mkdir()
    fake.write_text('#!/bin/sh\necho "$@"\n')
    fake.chmod(0o755)
    wrapper = cpu_jit.write_wrapper(tmp_path / "jit", str(fake))
    out = subprocess.run([str(wrapper), "-O3", "a b.cpp"], capture_output=True, text=True, check=True).stdout
    assert out.split() == [*cpu_jit.FLAGS, "-O3", "a", "b.cpp"]
    assert cpu_jit.FLAGS[:4] == ("-mavx2", "-mfma", "-mf16c", "-ffp-contract=off")

    monkeypatch.setattr(cpu_jit, "_enabled", None)
    for key in cpu_jit._RECORD:  # this process's own record, put back afterwards
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("PATH", str(fake.parent))
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    monkeypatch.setattr(cpu_jit, "uses_mlx_cpu_wheel", lambda: True)
    old_cpu = tmp_path / "cpuinfo-sse"
    old_cpu.write_text("flags\t\t: fpu sse sse2 avx\n")
    assert cpu_jit.enable(tmp_path / "cache", str(old_cpu)) is None
    assert cpu_jit.jit_words() == "MLX's own build flags"
    cpu = tmp_path / "cpuinfo"
    cpu.write_text("flags\t\t: fpu sse avx avx2 fma f16c\n")
    monkeypatch.setenv("SPECSTREAM_JIT_AVX2", "0")
    assert cpu_jit.enable(tmp_path / "cache", str(cpu)) is None
    monkeypatch.delenv("SPECSTREAM_JIT_AVX2")
    kernels = cpu_jit.enable(tmp_path / "cache", str(cpu))
    assert kernels.parent == tmp_path / "cache" and kernels.name.startswith("jit-tmp-") and kernels.is_dir()
    import os

    first = os.environ["PATH"].split(os.pathsep)[0]
    text = (Path(first) / "g++").read_text()
    assert text.startswith("#!/bin/sh\n") and f"\nexec '{fake}' -mavx2" in text
    assert os.environ["TMPDIR"] == str(kernels) and "-mfma" in cpu_jit.jit_words()
    # A child process that turns it off gets the environment as it was before.
    monkeypatch.setattr(cpu_jit, "_enabled", None)
    monkeypatch.setenv("SPECSTREAM_JIT_AVX2", "0")
    assert cpu_jit.enable(tmp_path / "cache", str(cpu)) is None
    assert os.environ["PATH"] == str(fake.parent) and os.environ["TMPDIR"] == str(tmp_path / "tmp")


def test_kernels_build_against_a_preamble_precompiled_once(tmp_path):
    """The wrapper precompiles the header every MLX kernel includes, once per cache (two
    processes, one build), and GCC loads it for every kernel MLX builds: ``-H`` marks a
    precompiled header it used with ``!`` and a header it parsed with ``.``. A header GCC
    rejected would leave kernels building from the text, correctly and slowly."""
    import os
    import shutil

    from specstream_mlx import cpu_jit
    from specstream_mlx.platform_info import _uses_mlx_cpu_wheel

    # The compiler itself, not this process's own wrapper (first on PATH since the import).
    ours = os.environ.get("SPECSTREAM_JIT_BIN")
    gxx = shutil.which("g++", path=os.pathsep.join(d for d in os.environ["PATH"].split(os.pathsep) if d != ours))
    if not _uses_mlx_cpu_wheel() or not cpu_jit.cpu_supports() or gxx is None or cpu_jit.mlx_include_dir() is None:
        pytest.skip("needs MLX's Linux CPU wheel on an AVX2 CPU and g++ (CI has all three)")
    shim = tmp_path / "bin" / "g++"  # the compiler the wrapper runs: logs, and has kernel builds list headers
    shim.parent.mkdir()
    log = tmp_path / "log"
    shim.write_text(
        "#!/bin/sh\n"
        f'echo "$*" >> {log}.commands\n'
        f'case "$*" in *-shared*) exec {gxx} "$@" -H 2>> {log}.headers;; esac\n'
        f'exec {gxx} "$@"\n'
    )
    shim.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "SPECSTREAM_JIT_AVX2"}
    env.update(SPECSTREAM_MLX_CACHE=str(tmp_path / "cache"), PATH=f"{shim.parent}{os.pathsep}{env['PATH']}")
    for i in range(2):
        out = subprocess.run([sys.executable, "-c", JIT_CHECK, str(tmp_path / f"out{i}")], env=env, capture_output=True)
        assert out.returncode == 0, out.stderr.decode()[-2000:]
    commands = (tmp_path / "log.commands").read_text().splitlines()
    kernels = [c for c in commands if "-shared" in c]
    assert sum("c++-header" in c for c in commands) == 1 and len(kernels) >= 3, commands
    built = list(tmp_path.glob(f"cache/native/jit-bin-*/pch/{cpu_jit.PREAMBLE}.gch"))
    assert len(built) == 1, built
    headers = (tmp_path / "log.headers").read_text().splitlines()
    used = [h for h in headers if h.startswith("! ") and h.endswith(str(built[0]))]
    assert len(used) == len(kernels), headers[:20]
    assert not [h for h in headers if h.startswith(". ") and h.endswith("compiled_preamble.h")], headers[:20]
    assert (tmp_path / "out0").read_bytes() == (tmp_path / "out1").read_bytes()


JIT_CHECK = r"""
import sys
import specstream_mlx
import mlx.core as mx, mlx.nn as nn
from specstream_mlx.models.base import swiglu
mx.random.seed(3)
g, u = mx.random.normal((9, 1536)) * 4, mx.random.normal((9, 1536))
# Where exp saturates, overflows and propagates: the vectorised loop must agree there too.
edge = mx.array([100.0, -100.0, 88.5, -88.5, 88.0, -88.0, float("inf"), float("-inf"), float("nan"), 0.0, -0.0])
g = mx.concatenate([g, mx.concatenate([edge, mx.zeros(1536 - edge.size)])[None]])
u = mx.concatenate([u, mx.ones((1, 1536))])
norm = nn.RMSNorm(1536)
f = mx.compile(lambda a, b: (swiglu(a, b), mx.softmax(a * 0.3, axis=-1), norm(a + b)))
# Strided kernels: halves of one array (unit inner strides, the rewritten loop), a weight that
# broadcasts over the rows (stride 0), and transposed inputs (MLX's own loop).
halves = mx.compile(lambda a, b: swiglu(*mx.split(mx.concatenate([a, b], axis=-1), 2, axis=-1)))
outs = [*f(g, u), halves(g, u), swiglu(g.T, u.T), norm(g[:, :1536] * 0.1)]
mx.eval(outs)
open(sys.argv[1], "wb").write(b"".join(bytes(memoryview(o)) for o in outs))
"""


def test_cpu_kernels_built_with_fma_compute_the_same_bits(tmp_path):
    """The compiled element-wise kernels built with AVX2/FMA (what ``import specstream_mlx``
    arranges on Linux's CPU wheel) have their fused multiply-adds inline where MLX's own
    flags call libm's ``fmaf``, their strided loops vectorised where the inputs' inner
    strides are 0 or 1, and give the same bytes, also through MLX's loop for other strides."""
    import os
    import shutil

    from specstream_mlx import cpu_jit
    from specstream_mlx.platform_info import _uses_mlx_cpu_wheel

    if not _uses_mlx_cpu_wheel() or not cpu_jit.cpu_supports() or shutil.which("objdump") is None:
        pytest.skip("needs MLX's Linux CPU wheel on an AVX2 CPU (CI has both)")
    env = {k: v for k, v in os.environ.items() if k != "SPECSTREAM_JIT_AVX2"}
    env["SPECSTREAM_MLX_CACHE"] = str(tmp_path / "cache")
    run = [sys.executable, "-c", JIT_CHECK]
    fast = subprocess.run([*run, str(tmp_path / "fast")], env=env, capture_output=True)
    assert fast.returncode == 0, fast.stderr.decode()[-2000:]
    # Turned off in a child of a process that turned it on (this one): MLX's own flags.
    scalar_tmp = tmp_path / "scalar-tmp"
    scalar_tmp.mkdir()
    env_off = {**env, "SPECSTREAM_JIT_AVX2": "0", "TMPDIR": str(scalar_tmp)}
    slow = subprocess.run([*run, str(tmp_path / "slow")], env=env_off, capture_output=True)
    assert slow.returncode == 0, slow.stderr.decode()[-2000:]
    built = {p.name: p for p in (tmp_path / "cache").glob("jit-tmp-*/**/*Sigmoid*.so")}
    plain = {p.name: p for p in scalar_tmp.rglob("*Sigmoid*.so")}
    assert built and set(built) == set(plain)

    def code(lib):
        return subprocess.run(["objdump", "-d", str(lib)], capture_output=True, text=True).stdout

    for name in built:
        assert "vfmadd" in code(built[name]) and "fmaf" not in code(built[name])
        assert "fmaf" in code(plain[name])
        # exp inlined and the loop vectorised, 8 lanes at a time: contiguous kernels, and
        # strided ones in their rewritten loop (specstream_mlx/jit_strided.py)
        assert "ymm" in code(built[name]) and "ymm" not in code(plain[name])
    assert any("strided" in name for name in built), sorted(built)
    assert (tmp_path / "fast").read_bytes() == (tmp_path / "slow").read_bytes()


STRIDED_KERNEL = """extern "C"  {
void K_strided_2(int* shape, int64_t** strides, void** args) {
  float* A = (float*)args[0];
  const int64_t* A_strides = strides[1];
  float* B = (float*)args[1];
  const int64_t* B_strides = strides[2];
  float* C = (float*)args[2];
  for (int i0 = 0; i0 < shape[0]; ++i0) {
  for (int i1 = 0; i1 < shape[1]; ++i1) {
  float tmp_A = *A;
  float tmp_B = *B;
  float tmp_D = 2.0;
  float tmp_C = Multiply()(Add()(tmp_A, tmp_D), tmp_B);
  *C++ = tmp_C;
  A += A_strides[1];
  B += B_strides[1];
  }
  A += A_strides[0];
  A -= A_strides[1] * shape[1];
  B += B_strides[0];
  B -= B_strides[1] * shape[1];
  }
}
}"""


def test_strided_kernels_get_a_loop_for_unit_and_zero_strides(tmp_path):
    """The rewriter keeps MLX's loop for other strides, adds one over plain arrays (a broadcast
    input from a buffer of its value) where every inner stride is 0 or 1, steps the pointers
    as MLX's loop would, and leaves alone what it does not recognise; built and run, the two
    loops give the same numbers for every stride pattern."""
    import shutil

    from specstream_mlx import jit_strided

    out = jit_strided.rewrite(STRIDED_KERNEL)
    assert out is not None and STRIDED_KERNEL.split("for (int i1")[1].split("A += A_strides[0]")[0] in out
    assert "(s_A == 0 || s_A == 1) && (s_B == 0 || s_B == 1)) {" in out and "p_C[i_] = tmp_C;" in out
    assert "A += s_A * n_;" in out and "C += n_;" in out
    contiguous = STRIDED_KERNEL.replace("_strided_2", "_contiguous")
    contiguous = contiguous.replace("const int64_t* A_strides = strides[1];\n", "")
    assert jit_strided.rewrite(contiguous) is None
    odd = STRIDED_KERNEL.replace("float tmp_B = *B;", "float tmp_B = B[1];")
    assert jit_strided.rewrite(odd) is None
    # Another read of an input's pointer, or another step of it, inside the loop: left alone.
    for line in ("  float tmp_E = Add()(*A, tmp_D);", "  B += 2;"):
        assert jit_strided.rewrite(STRIDED_KERNEL.replace("  float tmp_D = 2.0;", line)) is None
    src = tmp_path / "k.cpp"
    src.write_text(odd)
    assert jit_strided.main([str(src), str(tmp_path / "missing.cpp")]) == 0 and src.read_text() == odd

    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("no g++ to build the kernels with (CI has one)")
    prelude = "#include <cstdint>\nstruct Multiply { float operator()(float a, float b) { return a * b; } };\n"
    prelude += "struct Add { float operator()(float a, float b) { return a + b; } };\n"
    driver = r"""
#include <cstdio>
int main() {
  float a[3 * 600], b[3 * 600], c[3 * 600];
  for (int i = 0; i < 3 * 600; ++i) { a[i] = i * 0.37f - 11; b[i] = 1.5f - i * 0.01f; }
  int shape[2] = {3, 600};
  // b broadcast over the rows (stride 0) or along them; a transposed (stride 3: MLX's loop).
  int64_t patterns[4][2][2] = {{{600, 1}, {0, 1}}, {{600, 1}, {1, 0}}, {{1, 3}, {600, 1}}, {{600, 1}, {600, 1}}};
  for (auto& p : patterns) {
    int64_t out_strides[2] = {600, 1};
    int64_t* strides[3] = {out_strides, p[0], p[1]};
    void* args[3] = {a, b, c};
    K_strided_2(shape, strides, args);
    double sum = 0;
    for (int i = 0; i < 3 * 600; ++i) sum += c[i] * (i % 7 + 1);
    printf("%.6f\n", sum);
  }
}
"""
    runs = []
    for name, text in (("mlx", STRIDED_KERNEL), ("rewritten", out)):
        path = tmp_path / f"{name}.cpp"
        path.write_text(prelude + text + driver)
        subprocess.run([gxx, "-O2", str(path), "-o", str(tmp_path / name)], check=True)
        runs.append(subprocess.run([str(tmp_path / name)], capture_output=True, text=True, check=True).stdout)
    assert runs[0] == runs[1] and len(runs[0].split()) == 4


def test_a_model_that_decoded_is_freed_once_dropped(tiny_model_dir, tmp_path):
    """Decoding keeps per-model state (the compiled plain step, passes): none of it may keep
    the model alive after the caller drops it, or a process that loads another model keeps
    every one it loaded before (SmolLM2: ~1 GB each)."""
    import gc
    import weakref

    from specstream_mlx.convert import ConvertOptions, convert
    from specstream_mlx.method.tree import TreeSpec
    from specstream_mlx.runtime.loaded_model import load
    from specstream_mlx.runtime.sampling import SamplingParams
    from specstream_mlx.runtime.speculative import ss_steps
    from specstream_mlx.runtime.steps import ar_steps

    with_streams = convert(str(tiny_model_dir), str(tmp_path / "ss"), ConvertOptions(num_streams=2, stream_layers=1))
    model, _ = load(str(with_streams), warn=False)
    prompt = mx.array([5, 9, 33, 70])
    steps = ar_steps(model.base, prompt, SamplingParams())
    for _ in range(4):
        next(steps)
    tree = TreeSpec("dynamic", budget=4, depth=2)
    passes = ss_steps(model.base, prompt, SamplingParams(), streams=model.streams, tree=tree)
    for _ in range(3):
        next(passes)
    base = weakref.ref(model.base)
    del model, steps, passes
    gc.collect()
    assert base() is None, [type(r).__name__ for r in gc.get_referrers(base())]
