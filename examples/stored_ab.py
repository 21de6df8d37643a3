"""What the product kernel's stored-weight reading costs against the float32 weights, per product.

    env $(.venv/bin/python -m specstream_mlx.blas_env) .venv/bin/python examples/stored_ab.py [ROWS ...]

Forty distinct 3,072 × 576 weights (SmolLM2's fused gate/up shape; 283 MB in float32, more
than most caches) are quantized as a GGUF file stores them (MLX affine, groups of 32, float16
scales and biases) at 4 and 8 bits and expanded to float32. At each row count (default 1
and 9), products of a row block by every weight in turn, medians of 7 repetitions: the
float32 weights as MLX passes them to the kernel; the same weights registered with their
4-bit and their 8-bit stored forms (what ``load`` does for a quantized model); and MLX's own
``quantized_matmul`` on the 4-bit arrays. Every stored product is checked to be the float32
product's bits. ``SPECSTREAM_SKINNY_FUSED_ROWS=1`` in the environment expands the stored values
of products of two rows or more into a buffer for the float32 tiles instead of in registers
(the kernel's choice for more than 9 rows, or 7 at eight bits).
"""

from __future__ import annotations

import sys

import mlx.core as mx
import numpy as np

from specstream_mlx.bench.machine import median_ms
from specstream_mlx.platform_info import blas_words, skinny_kernel
from specstream_mlx.runtime.stored_weights import _kernel, _pointer

N, K, WEIGHTS, GROUP = 3072, 576, 40, 32


def median_us(run, reps: int = 7) -> float:
    """Microseconds a product: the median of ``reps`` runs over every weight, per weight."""
    return median_ms(run, reps) / WEIGHTS * 1e3


def main() -> int:
    if skinny_kernel() is None:
        print("the product kernel is not loaded: run under env $(python -m specstream_mlx.blas_env)", file=sys.stderr)
        return 1
    try:
        rows = [int(r) for r in sys.argv[1:]] or [1, 9]
    except ValueError:
        rows = []
    if not rows or not all(1 <= r <= 48 for r in rows):
        print(f"rows: whole numbers from 1 to 48 (the kernel's tiles), got {' '.join(sys.argv[1:])!r}", file=sys.stderr)
        return 2
    register, unregister = _kernel()
    forms = {}
    for bits in (4, 8):
        forms[bits] = []
        for _ in range(WEIGHTS):
            q, s, b = mx.quantize(mx.random.normal((N, K)) * 0.05, group_size=GROUP, bits=bits)
            s, b = s.astype(mx.float16).astype(mx.float32), b.astype(mx.float16).astype(mx.float32)
            w = mx.dequantize(q, s, b, GROUP, bits)
            mx.eval(q, s, b, w)
            forms[bits].append((w, q, s, b))
    print(f"{WEIGHTS} weights of {N} x {K}; {blas_words()}")
    for m in rows:
        x = mx.random.normal((m, K))
        mx.eval(x)
        line = {}
        for bits in (4, 8):
            ws = [f[0] for f in forms[bits]]
            want = [np.array(x @ w.T) for w in ws]
            products = lambda x=x, ws=ws: mx.eval([x @ w.T for w in ws])  # noqa: E731
            line[f"float32 ({bits}-bit values)"] = median_us(products)
            for w, q, s, b in forms[bits]:
                assert register(_pointer(w), N, K, _pointer(q), bits, GROUP, _pointer(s), _pointer(b)) == 1
            line[f"{bits}-bit stored"] = median_us(products)
            got = [np.array(x @ w.T) for w in ws]
            assert all(np.array_equal(g.view(np.uint32), h.view(np.uint32)) for g, h in zip(got, want))
            for w in ws:
                unregister(_pointer(w))
        q4 = forms[4]
        line["MLX quantized_matmul, 4-bit"] = median_us(
            lambda x=x, q4=q4: mx.eval([mx.quantized_matmul(x, q, s, b, True, GROUP, 4) for _, q, s, b in q4])
        )
        print(f"{m} row(s): " + ", ".join(f"{k} {v:.0f} us" for k, v in line.items()) + " a product")
    return 0


if __name__ == "__main__":
    sys.exit(main())
