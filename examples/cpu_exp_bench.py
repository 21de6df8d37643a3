"""Micro-benchmark behind bench/README.md's note on MLX's CPU `exp`.

    .venv/bin/python examples/cpu_exp_bench.py

Times exp, softmax and the attention score matmul on the shape of one tree
attention call (14 heads x 65 rows x 365 keys) in MLX, and exp in NumPy.
"""

import time

import mlx.core as mx
import numpy as np


def timed(f, n=20):
    mx.eval(f())
    t = time.perf_counter()
    for _ in range(n):
        mx.eval(f())
    return (time.perf_counter() - t) / n * 1000


q = mx.random.normal((1, 14, 65, 64))
k = mx.random.normal((1, 14, 64, 365))
s = q @ k
mx.eval(q, k, s)
sn = np.array(s)
t = time.perf_counter()
for _ in range(20):
    np.exp(sn)
numpy_ms = (time.perf_counter() - t) / 20 * 1000
mlx_ms = timed(lambda: mx.exp(s))
print(f"scores matmul: {timed(lambda: q @ k):.2f} ms")
print(f"mx.softmax:    {timed(lambda: mx.softmax(s, axis=-1)):.2f} ms")
print(f"mx.exp:        {mlx_ms:.2f} ms")
print(f"np.exp:        {numpy_ms:.2f} ms  (MLX/NumPy: {mlx_ms / numpy_ms:.0f}x)")
