"""The product kernel's integer activations (``SPECSTREAM_PRODUCTS=q8``: 8-bit; ``q16``: 16-bit as
two planes of 8-bit codes; docs/DESIGN.md decision 46).

The kernel reads its settings once, when it first serves a product, and builds a weight's
8-bit-activation layout when the weight is registered: each check runs in a fresh process
under the product environment with the setting given.
"""

import json
import os
import subprocess
import sys

import pytest

from tests.test_fast_paths import _cpu_flags

Q8_CHECK = r"""
import ctypes, hashlib, json, os
import mlx.core as mx, numpy as np
from specstream_mlx.platform_info import _symbol, forwarder_words, q8_products, set_q8_products
from specstream_mlx.runtime.stored_weights import _kernel, _pointer

register, unregister = _kernel()
q8_served = _symbol("specstream_q8_served")
q8_served.restype = ctypes.c_longlong
rng = np.random.default_rng(0)
out = {"state": q8_products(), "words": forwarder_words(), "cases": []}


def form(k, n, bits, group, f16):
    q, s, b = mx.quantize(mx.array(rng.standard_normal((n, k)).astype(np.float32) * 0.05), group_size=group, bits=bits)
    if f16:  # as a float16 file stores them: the kernel holds them as float16
        s, b = s.astype(mx.float16).astype(mx.float32), b.astype(mx.float16).astype(mx.float32)
    w = mx.dequantize(q, s, b, group, bits)
    mx.eval(q, s, b, w)
    return w, q, s, b


PLANES = 2 if os.environ["SPECSTREAM_PRODUCTS"] == "q16" else 1
TOP = np.float32(127 * 256 + 127 if PLANES == 2 else 127)


def scheme(x, w, q, s, b, bits, group):
    # What the kernel computes, in float64: each row quantized per block of 32 (scale
    # max|x| / TOP, codes rounded to even; with two planes each code is its high and low byte,
    # multiplied apart, which sums to the same integers), then per block
    # scale * d * sum(codes * q) + bias * d * sum(codes).
    m, k = x.shape
    blocks = x.reshape(m, k // 32, 32)
    amax = np.abs(blocks).max(-1, keepdims=True)
    d = (amax / TOP).astype(np.float64)
    inv = np.where(amax > 0, TOP / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    codes = np.rint(blocks * inv).astype(np.float64)
    n = w.shape[0]
    codes_w = mx.dequantize(q, mx.ones_like(s), mx.zeros_like(b), group, bits)
    qw = np.array(codes_w, dtype=np.float64).reshape(n, k // 32, 32)
    sb = np.repeat(np.array(s, dtype=np.float64), group // 32, axis=1)
    bb = np.repeat(np.array(b, dtype=np.float64), group // 32, axis=1)
    ints = np.einsum("ibe,jbe->ijb", codes, qw)
    return np.einsum("ijb,jb,ib->ij", ints, sb, d[..., 0]) + np.einsum("jb,ib->ij", bb, d[..., 0] * codes.sum(-1))


# 4 and 8 bits, groups of 32 to 128, widths not a multiple of the 16-row blocks, a width
# the two threads split (3,072); one row, the tiles' row counts, a tree pass's, more rows
# than the kernel's tiles take (49, 80) and a prompt's (300). Scales and biases float16, and
# float32 (held as float32).
SHAPES = [(4, 32, 576, 197, 1), (8, 32, 1536, 70, 1), (4, 64, 1536, 133, 1), (8, 128, 640, 64, 1)]
SHAPES += [(4, 32, 576, 3072, 1), (4, 32, 576, 197, 0), (8, 32, 640, 70, 0)]
for bits, group, k, n, f16 in SHAPES:
    w, q, s, b = form(k, n, bits, group, f16)
    x = rng.standard_normal((300, k)).astype(np.float32)
    x[7, 5] = 40.0  # an outlier: only its own block's scale grows
    x[11, 32:64] = 0.0  # a block of zeros
    exact = np.array(mx.array(x) @ w.T)  # not registered: the float32 kernel or the library
    exact9 = np.array(mx.array(x[:9]) @ w.T)  # the kernel's float32 tiles
    assert register(_pointer(w), n, k, _pointer(q), bits, group, _pointer(s), _pointer(b)) == 1
    before = q8_served()
    whole = np.array(mx.array(x) @ w.T)
    by_rows = {}
    for m in (1, 2, 3, 7, 8, 9, 13, 48, 49, 80):
        got = np.concatenate([np.array(mx.array(x[i : i + m]) @ w.T) for i in range(0, 80, m)])[:80]
        by_rows[m] = bool(np.array_equal(got.view(np.uint32), whole[:80].view(np.uint32)))
    served = q8_served() - before
    ref = scheme(x, w, q, s, b, bits, group)
    case = {
        "shape": [bits, group, k, n],
        "same_bits_by_rows": by_rows,
        "served": served,
        "vs_scheme": float(np.abs(whole - ref).max() / np.abs(ref).max()),
        "vs_exact": float(np.abs(whole - exact).max() / np.abs(exact).max()),
        "digest": hashlib.sha256(whole.tobytes()).hexdigest(),
    }
    # Turned off in the process: the stored form's exact products, the float32 weight's bits.
    set_q8_products(0)
    off = np.array(mx.array(x[:9]) @ w.T)
    case["off_exact_bits"] = bool(np.array_equal(off.view(np.uint32), exact9.view(np.uint32)))
    case["off_served"] = q8_served() - before - served
    set_q8_products(PLANES)
    unregister(_pointer(w))
    out["cases"].append(case)
print(json.dumps(out))
"""


def _product_env(**settings) -> dict:
    from specstream_mlx import platform_info as P

    choice = P.choose_blas("openblas")
    assert choice.forwarder is not None, "the forwarder did not build (no C compiler?)"
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD" and not k.startswith("SPECSTREAM_SKINNY")}
    env.pop("SPECSTREAM_PRODUCTS", None)
    env.update(choice.env())
    env.update(settings)
    return env


def _q8_capable() -> bool:
    return {"avx2", "fma"} <= _cpu_flags()


# setting: the kernel's state, its words, and how far from the float32 product its outputs are
# (relative to the largest): 8-bit codes about 1% of a block's largest value, 16-bit ones 2^8
# times finer.
SETTINGS = {"q8": (1, "8-bit activations", (1e-4, 2e-2)), "q16": (2, "16-bit activations", (1e-6, 2e-4))}


@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_integer_activations_give_a_row_the_same_bits_in_any_product(setting):
    """With ``SPECSTREAM_PRODUCTS=q8`` (or ``q16``) on an x86-64 CPU with AVX2, every product by
    a registered weight (4 and 8 bits, groups of 32 to 128, any width, 1 to 300 rows) is
    computed from 8-bit activations (16-bit ones as two planes of 8-bit codes): each row's
    outputs are the same bits whichever product carries it (what keeps greedy speculative
    decoding equal to plain decoding), they are what the scheme computes in float64 to
    float32's rounding, and within the scheme's error of the float32 product; turned off in the
    process, the same weight's products are exact again. The AVX2 tiles (forced with
    ``SPECSTREAM_SKINNY_ISA=avx2``) give the same bits as the AVX512-VNNI ones where the CPU has
    them. Where the CPU cannot, the setting leaves every product exact and the kernel says so."""
    state, words, (least, most) = SETTINGS[setting]
    runs = {}
    for isa in ("native", "avx2"):
        settings = {"SPECSTREAM_PRODUCTS": setting}
        if isa == "avx2":
            settings["SPECSTREAM_SKINNY_ISA"] = "avx2"
        out = subprocess.run(
            [sys.executable, "-c", Q8_CHECK],
            env=_product_env(**settings),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert out.returncode == 0, out.stderr
        runs[isa] = res = json.loads(out.stdout.strip().splitlines()[-1])
        if not _q8_capable():
            assert res["state"] is None and "-bit activations" not in res["words"], res
            assert all(c["served"] == 0 and c["vs_exact"] < 1e-5 for c in res["cases"]), res
            continue
        assert res["state"] == state and words in res["words"], res
        for case in res["cases"]:
            assert all(case["same_bits_by_rows"].values()), case
            # one product for the whole, one per block of rows for each row count
            assert case["served"] == 1 + sum(-(-80 // m) for m in (1, 2, 3, 7, 8, 9, 13, 48, 49, 80)), case
            assert case["vs_scheme"] < 2e-6, case
            assert least < case["vs_exact"] < most, case  # close, and not exact
            assert case["off_served"] == 0 and case["off_exact_bits"], case
    assert [c["digest"] for c in runs["avx2"]["cases"]] == [c["digest"] for c in runs["native"]["cases"]]


MODEL_CHECK = r"""
import json, sys
import mlx.core as mx, numpy as np
from specstream_mlx.method.tree import TreeSpec
from specstream_mlx.platform_info import _symbol
from specstream_mlx.runtime.loaded_model import load
from specstream_mlx.runtime.sampling import SamplingParams
from specstream_mlx.runtime.speculative import ss_steps
from specstream_mlx.runtime.steps import ar_steps
import ctypes

served = _symbol("specstream_q8_served")
served.restype = ctypes.c_longlong


def take(steps, n):
    out = []
    while len(out) < n:
        out += next(steps).tokens
    return out[:n]


model, _ = load(sys.argv[1], warn=False)
prompt = mx.array([5, 9, 33, 70, 12, 8, 41])
before = served()
logits = np.array(model.base(prompt[None])[0, -1])
ar = take(ar_steps(model.base, prompt, SamplingParams()), 24)
trees = {}
for spec in (TreeSpec("dynamic", budget=4, depth=3), TreeSpec("dynamic", budget=8, depth=4)):
    trees[spec.describe()] = take(ss_steps(model.base, prompt, SamplingParams(), streams=model.streams, tree=spec), 24)
print(json.dumps({"served": served() - before, "logits": logits.tolist(), "ar": ar, "ss": trees}))
"""


def test_a_quantized_model_decodes_with_integer_activations_and_ss_still_equals_ar(quantized_dir):
    """A quantized model loaded with ``SPECSTREAM_PRODUCTS=q8`` (or ``q16``, the default): its
    products take 8-bit (16-bit) activations (on a CPU with AVX2), its logits stay near the exact
    products', and greedy speculative decoding gives plain decoding's tokens with trees of 5 and
    9 nodes: a pass's main rows are a step's bits, so their integer codes are the step's too."""
    runs = {}
    for setting in ("exact", "q8", "q16", "default"):
        settings = {} if setting == "default" else {"SPECSTREAM_PRODUCTS": setting}
        out = subprocess.run(
            [sys.executable, "-c", MODEL_CHECK, str(quantized_dir)],
            env=_product_env(**settings),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert out.returncode == 0, out.stderr
        runs[setting] = json.loads(out.stdout.strip().splitlines()[-1])
    import numpy as np

    exact = runs["exact"]
    assert exact["served"] == 0
    for run in runs.values():
        assert all(tokens == run["ar"] for tokens in run["ss"].values()), run
    want = np.array(exact["logits"])
    scale = np.abs(want).max()
    errors = {}
    for setting in ("q8", "q16"):
        got = np.array(runs[setting]["logits"])
        if not _q8_capable():
            assert runs[setting]["served"] == 0 and np.array_equal(got, want)
            continue
        assert runs[setting]["served"] > 0
        assert not np.array_equal(got, want)
        errors[setting] = np.abs(got - want).max() / scale
    if not _q8_capable():
        return
    # A random tiny model: 8-bit activations move its logits by a few per cent of their range
    # (the products themselves are checked against the scheme above), 16-bit ones by far less.
    assert errors["q8"] < 0.15 and np.abs(np.array(runs["q8"]["logits"]) - want).mean() < 0.05 * scale
    assert errors["q16"] < 1e-3 and errors["q16"] < errors["q8"] / 30, errors
    # Unset, the setting is q16: the same logits and tokens.
    assert runs["default"] == runs["q16"]
