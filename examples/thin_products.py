"""Attention's products by the KV cache, through the preloaded ``cblas_sgemm``, from memory.

    env $(.venv/bin/python -m specstream_mlx.blas_env) \\
        .venv/bin/python examples/thin_products.py [--buffers 1200] [--keys 1024] [--rows 3,27]

A plain step's attention multiplies a key/value head's query rows (3 for SmolLM2's one row,
27 for a 9-node tree) by the head's keys (scores: rows x keys x 64, the keys transposed) and
its probabilities by the head's values (rows x 64 x keys, stored keys x 64). At long contexts
those operands come from memory, not the cache: each product here reads the next of
``--buffers`` distinct key or value blocks (1,200 of 256 KB at 1,024 keys: 300 MB, more than
the last-level cache). Prints µs a product (the fastest of three passes over every block)
and the largest difference from NumPy's product. Run it in two checkouts (each under its own
``blas_env``) to compare their product kernels.
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import time

import numpy as np

ROW_MAJOR, NO_TRANS, TRANS = 101, 111, 112
HEAD_DIM = 64


def product(sgemm, tb: int, a: np.ndarray, b: np.ndarray, c: np.ndarray) -> None:
    """c = a @ b.T (``tb`` TRANS: b is a key block) or a @ b (NO_TRANS: a value block)."""
    m, k = a.shape
    n = c.shape[1]
    sgemm(ROW_MAJOR, NO_TRANS, tb, m, n, k, 1.0, a.ctypes.data, k, b.ctypes.data, HEAD_DIM, 0.0, c.ctypes.data, n)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--buffers", type=int, default=1200, help="distinct key and value blocks")
    ap.add_argument("--keys", type=int, default=1024)
    ap.add_argument("--rows", default="3,27", help="comma-separated query rows of a key/value head")
    args = ap.parse_args()
    if args.buffers < 1 or args.keys < 1:
        print("thin_products.py: --buffers and --keys must be at least 1", file=sys.stderr)
        return 2
    sgemm = ctypes.CDLL(None).cblas_sgemm
    ptr = ctypes.c_void_p
    sgemm.restype = None
    sgemm.argtypes = [ctypes.c_int] * 6 + [ctypes.c_float, ptr, ctypes.c_int, ptr, ctypes.c_int]
    sgemm.argtypes += [ctypes.c_float, ptr, ctypes.c_int]
    rng = np.random.default_rng(0)
    n_keys = args.keys
    blocks = [rng.random((n_keys, HEAD_DIM), dtype=np.float32) for _ in range(args.buffers)]
    print(f"{args.buffers} blocks of {n_keys} keys x {HEAD_DIM} ({blocks[0].nbytes >> 10} KB each)")
    for m in (int(r) for r in args.rows.split(",")):
        for what, tb in (("scores (by the keys)", TRANS), ("by the values", NO_TRANS)):
            k, n = (HEAD_DIM, n_keys) if tb == TRANS else (n_keys, HEAD_DIM)
            a = rng.random((m, k), dtype=np.float32)
            c = np.zeros((m, n), np.float32)
            best = float("inf")
            for _ in range(3):
                t0 = time.perf_counter()
                for b in blocks:
                    product(sgemm, tb, a, b, c)
                best = min(best, (time.perf_counter() - t0) / len(blocks))
            product(sgemm, tb, a, blocks[0], c)
            want = a @ (blocks[0].T if tb == TRANS else blocks[0])
            err = float(np.abs(c - want).max() / np.abs(want).max())
            print(f"{m:3d} rows, {what:21s} {best * 1e6:8.2f} us a product  (largest relative difference {err:.1e})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
