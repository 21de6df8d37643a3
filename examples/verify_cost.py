"""Sampled verification at a real vocabulary: host rejection sampling vs the device's.

    env $(.venv/bin/python -m specstream_mlx.blas_env) \\
        .venv/bin/python examples/verify_cost.py [--vocab 49152] [--widths 2,1,1,1] [--reps 50]

One sampled pass verifies a tree whose children at each depth were drawn from the
stream's proposal q, then draws the next tree's children. Both ways are timed from the
main logits (already computed) to the verdict and the next draws on the host:

* host (how the engine did it before): target and proposal probabilities computed as
  exp(log-probabilities), candidates from a separate softmax, both copied to the host
  ((n, V) and (γ, V) float32), recursive rejection sampling in float64 along the
  accepted path, the bonus and the children drawn with numpy;
* device (how it does it now): ``verification_target`` (rejection sampling for every
  node at once, one softmax per row) and ``stream_candidates`` (candidates and
  inverse-CDF draws from the same softmax); 2n + γ·(2K + w) numbers come back.

Prints milliseconds per pass (median of ``--reps``, interleaved) and the ratio.
"""

import argparse
import time

import mlx.core as mx
import numpy as np

from specstream_mlx.method.tree import cartesian_tree, tree_buffers
from specstream_mlx.platform_info import blas_in_use
from specstream_mlx.runtime.drafting import stream_candidates
from specstream_mlx.runtime.sampling import KeyStream, SamplingParams, target_logprobs, target_probs
from specstream_mlx.runtime.verification import verification_target, verify


def host_pass(logits, stream_logits, tree, b, sampling, rng):
    """What sampled verification and drafting used to do: target and proposal
    probabilities as exp(log-probabilities), top-K from a plain softmax, (n, V) and
    (γ, V) copies to the host, float64 rejection sampling along the accepted path,
    numpy draws."""
    probs = mx.softmax(stream_logits, axis=-1)
    part = mx.argpartition(-probs, kth=7, axis=-1)[..., :8]
    ptop = mx.take_along_axis(probs, part, axis=-1)
    target, q = mx.exp(target_logprobs(logits, sampling)), mx.exp(target_logprobs(stream_logits, sampling))
    mx.eval(target, q, part, ptop)
    target, q = np.array(target).astype(np.float64), np.array(q).astype(np.float64)
    q /= q.sum(axis=-1, keepdims=True)
    cur = 0
    while True:
        p, kids = target[cur], b.children[cur]
        accepted = None
        for c in kids:
            x, qd = tree.tokens[c], q[b.depths[cur]]
            if rng.random() * qd[x] < p[x]:
                accepted = c
                break
            r = np.maximum(p - qd, 0.0)
            if r.sum() > 0:
                p = r / r.sum()
        if accepted is None:
            bonus = int(rng.choice(p.shape[0], p=p / p.sum()))
            break
        cur = accepted
    draws = [rng.choice(q.shape[1], size=2, p=q[g]) for g in range(q.shape[0])]
    return bonus, draws


def device_pass(logits, stream_logits, tree, b, sampling, keys, q_prev, widths):
    dec = verification_target(logits, sampling, tree, b, q_prev, keys.next())
    cand = stream_candidates(stream_logits, 8, sampling, keys.next(), max(widths))
    mx.eval(dec, *cand.arrays())
    verdict = verify(tree, b, sampling, np.array(dec))
    cand = cand.to_host()
    return verdict, cand.top, cand.ptop, cand.drawn


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--widths", default="2,1,1,1", help="the sampled tree (dynamic:8 drafts 2,1,1,1)")
    ap.add_argument("--reps", type=int, default=50)
    a = ap.parse_args()
    if a.vocab < 8:
        ap.error("--vocab must be at least 8 (the candidates are the top 8)")
    widths = tuple(int(w) for w in a.widths.split(","))
    rng = np.random.default_rng(0)
    gamma = len(widths)
    tree = cartesian_tree(1, [rng.integers(a.vocab, size=w) for w in widths], widths)
    b = tree_buffers(tree.parents)
    n = len(tree)
    sampling = SamplingParams(temperature=0.7, seed=0)
    keys = KeyStream(0)
    logits = mx.random.normal((n, a.vocab), key=mx.random.key(1)) * 3
    stream_logits = mx.random.normal((gamma, a.vocab), key=mx.random.key(2)) * 3
    q_prev = target_probs(stream_logits, sampling)
    mx.eval(logits, stream_logits, q_prev)
    times = {"host": [], "device": []}
    for _ in range(a.reps):
        for kind in ("host", "device"):
            t = time.perf_counter()
            if kind == "host":
                host_pass(logits, stream_logits, tree, b, sampling, rng)
            else:
                device_pass(logits, stream_logits, tree, b, sampling, keys, q_prev, widths)
            times[kind].append(time.perf_counter() - t)
    host, dev = (float(np.median(times[k])) * 1e3 for k in ("host", "device"))
    print(f"{n}-node sampled tree {a.widths}, V={a.vocab}, MLX {mx.default_device()}, BLAS {blas_in_use()}")
    print(f"host RRS + host draws: {host:.2f} ms/pass; device RRS + device draws: {dev:.2f} ms/pass; {host / dev:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
