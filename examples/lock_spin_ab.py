"""What mutexes that spin before they sleep, condition waits that poll before they sleep, a
product worker that reads the next weight ahead,
MLX's strided element-wise kernels with vectorised loops, and the size from which a product by
a thin operand (attention's) is split between the threads are worth, in one process; up to
how many rows a quantized weight is read as stored; and integer activations.

    env $(.venv/bin/python -m specstream_mlx.blas_env) \\
        .venv/bin/python examples/lock_spin_ab.py [--model smollm2] [--tries 100,0] [--rounds 12]
    env $(.venv/bin/python -m specstream_mlx.blas_env) \\
        .venv/bin/python examples/lock_spin_ab.py --setting cond-spin [--tries 0,200] [--prompts 6]
    env $(.venv/bin/python -m specstream_mlx.blas_env) \\
        .venv/bin/python examples/lock_spin_ab.py --setting ahead [--tries 0,1024,2048]
    env $(.venv/bin/python -m specstream_mlx.blas_env) \\
        .venv/bin/python examples/lock_spin_ab.py --setting strided [--tries 0,1]
    env $(.venv/bin/python -m specstream_mlx.blas_env) \\
        .venv/bin/python examples/lock_spin_ab.py --setting thin-min [--tries 1073741824,-1] [--context 1000]
    env $(.venv/bin/python -m specstream_mlx.blas_env) \\
        .venv/bin/python examples/lock_spin_ab.py --setting stored-rows [--tries 48,-1]
    SPECSTREAM_PRODUCTS=q8 env $(.venv/bin/python -m specstream_mlx.blas_env) \\
        .venv/bin/python examples/lock_spin_ab.py --setting q8 [--tries 0,1,2]

The forwarder's library (``native/lock_spin.c``), preloaded, makes a contended
``pthread_mutex_lock`` try a number of times before it sleeps and a ``pthread_cond_wait``
poll for a number of microseconds (``SPECSTREAM_COND_SPIN_US``); its product kernel's
waiting worker prefetches the first KB of the weight that came next last time
(``native/gemv_forward.c``, ``SPECSTREAM_SKINNY_AHEAD_KB``); MLX's strided kernels, as
``specstream_mlx/jit_strided.py`` rewrites them, run a vectorised loop unless switched off;
the kernel splits a product by a thin operand (one head's keys) between its threads from a
number of its elements on; a registered quantized weight is read as stored up to a number of
rows (``runtime/stored_rows.py``); with ``SPECSTREAM_PRODUCTS=q8`` or ``q16`` (at load: the
weights' integer-activation layout) the kernel multiplies them by 8-bit activations (1) or by
16-bit ones as two 8-bit planes (2) while switched on. This
script sets one of them (``--setting lock-spin``, tries;
``cond-spin``, microseconds; ``ahead``, KB; ``strided``, 1 on or 0 off; ``thin-min``, elements,
-1 the default, 1073741824 never; ``stored-rows``, rows, -1 the limits measured at load; ``q8``,
0 off, 1 or 2 planes) to each of
``--tries`` in turn (the first is the reference) within one process, round by round, and
times under each: plain decoding as ``ar`` runs it (ms a token, the engine's pipelined loop
over the compiled step, 40 tokens after a ``--context``-token prompt, default 128), and
op-by-op speculative passes over a 9-node tree with streams at two hosts and at every node
after the same context, as greedy decoding runs them (the verdict's stream logits evaluated
with them); with ``--prompts N``, also whole greedy generations of the model's first N held-out
bench prompts with ``ar`` and ``ss --tree auto``. Prints the medians and the median ratio to
the first setting, pair by pair; each round starts with the next setting in turn and runs the
settings there and back.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys

import numpy as np


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument(
        "--setting",
        choices=("lock-spin", "cond-spin", "ahead", "strided", "thin-min", "stored-rows", "q8"),
        default="lock-spin",
    )
    ap.add_argument(
        "--tries",
        default=None,
        help="comma-separated values (tries, microseconds, KB read ahead, or elements); the first is the "
        "reference (default: 100,0 tries; 0,200 us; 0,1024 KB; 0,1 strided loops off/on; 1073741824,-1 elements: "
        "none split, the default)",
    )
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--context", type=int, default=128, help="prompt tokens before the timed steps and passes")
    ap.add_argument(
        "--prompts",
        type=int,
        default=0,
        help="also decode this many held-out bench prompts greedily per setting and round, 64 tokens each: "
        "ar and ss --tree auto (tokens/s after each prompt's first token)",
    )
    args = ap.parse_args()

    import specstream_mlx  # noqa: F401  (first: the BLAS before mlx.core)

    # isort: split
    import mlx.core as mx

    from specstream_mlx import load
    from specstream_mlx.bench.machine import median_ms, plain_step_ms, timing_prompt
    from specstream_mlx.method.msa import ss_forward, stream_logits
    from specstream_mlx.method.tree import Tree
    from specstream_mlx.platform_info import blas_words, cond_spin_us, lock_spins, skinny_kernel
    from specstream_mlx.runtime.cache import make_cache
    from specstream_mlx.runtime.steps import prefill

    off = {"lock-spin": (lock_spins, "the mutexes are not spinning", "SPECSTREAM_LOCK_SPIN")}
    off["cond-spin"] = (cond_spin_us, "the condition waits are not polling", "SPECSTREAM_COND_SPIN_US")
    if args.setting in off and off[args.setting][0]() == 0:
        _, what, name = off[args.setting]
        print(
            f"lock_spin_ab.py: {what} here; start under "
            f"env $(.venv/bin/python -m specstream_mlx.blas_env) without {name}=0",
            file=sys.stderr,
        )
        return 2
    if args.setting in ("ahead", "thin-min", "stored-rows", "q8") and skinny_kernel() is None:
        print(
            "lock_spin_ab.py: the product kernel does not serve this process; start under "
            "env $(.venv/bin/python -m specstream_mlx.blas_env)",
            file=sys.stderr,
        )
        return 2
    lib = ctypes.CDLL(None)
    lib.specstream_skinny_set_thin_min.argtypes = [ctypes.c_long]
    lib.specstream_cond_spin_set.argtypes = [ctypes.c_long]
    setter = {
        "lock-spin": lib.specstream_lock_spin_set,
        "cond-spin": lib.specstream_cond_spin_set,
        "ahead": lib.specstream_skinny_set_ahead_kb,
        "strided": lib.specstream_jit_strided_set,
        "thin-min": lib.specstream_skinny_set_thin_min,
    }.get(args.setting)
    defaults = {"lock-spin": "100,0", "ahead": "0,1024", "strided": "0,1", "thin-min": "1073741824,-1"}
    defaults["cond-spin"] = "0,200"
    defaults["stored-rows"] = "48,-1"
    defaults["q8"] = "0,1"
    text = args.tries or defaults[args.setting]
    tries = [int(t) for t in text.split(",")]

    sm, tok = load(args.model, warn=False)
    base, streams = sm.base, sm.streams
    generations = generation_rates(sm, tok, args.model, args.prompts) if args.prompts else None
    rates = {t: [] for t in tries}
    if args.setting == "stored-rows":
        from specstream_mlx.runtime.stored_rows import apply, row_limits
        from specstream_mlx.runtime.stored_weights import registration

        measured = row_limits(base).by_bits
        if not measured:
            print(f"lock_spin_ab.py: {args.model} has no weights read as stored here", file=sys.stderr)
            return 2

        def setter(rows):
            apply(registration(base), measured if rows < 0 else {bits: rows for bits in measured})

    if args.setting == "q8":
        from specstream_mlx.platform_info import q8_products, set_q8_products

        if not q8_products():
            print(
                "lock_spin_ab.py: integer activations are not on here: start with SPECSTREAM_PRODUCTS=q8 (or q16) "
                "where the product kernel serves products (x86-64 Linux, AVX2)",
                file=sys.stderr,
            )
            return 2

        def setter(planes):
            set_q8_products(planes)

    cache = make_cache(sm)
    prefill(base, timing_prompt(base, args.context), cache, 512)
    offset = cache[0].offset
    tree = Tree(tuple(range(300, 309)), (-1, 0, 0, 1, 1, 2, 3, 4, 5))
    hosts = np.array([0, 1])

    def one_pass(node_hosts):
        def run():
            out = ss_forward(base, streams, tree, offset, cache, 0.0, None, node_hosts)
            mx.eval(out.main_logits, stream_logits(base, streams, out, 0))
            for c in cache:  # roll back: every repetition sees the same prefix
                c.commit([0])
                c.offset = offset

        return run

    two_hosts, every_node = one_pass(hosts), one_pass(None)
    step = {t: [] for t in tries}
    passes = {t: [] for t in tries}
    all_hosts = {t: [] for t in tries}
    print(f"{args.model}; {args.context}-token context; {args.rounds} rounds; BLAS {blas_words()}")
    for r in range(args.rounds):
        # Each round starts with the next setting and runs them there and back (A B B A): a
        # setting that always ran first (or second) was measured slower (or faster) by its
        # place alone.
        order = tries[r % len(tries) :] + tries[: r % len(tries)]
        for t in order + order[::-1]:
            setter(t)
            step[t].append(statistics.median(plain_step_ms(base, 40, args.context)))
            passes[t].append(median_ms(two_hosts, 3))
            all_hosts[t].append(median_ms(every_node, 3))
            if generations:
                rates[t].append(generations())
    setter(tries[0])
    what = {"lock-spin": "tries", "ahead": "KB ahead", "strided": "strided loops on", "thin-min": "thin split from"}
    what["cond-spin"] = "condition waits poll, us"
    what["stored-rows"] = "stored up to rows (-1: measured)"
    what["q8"] = "activation planes (0: float32, 1: 8-bit, 2: 16-bit)"
    what = what[args.setting]
    print_tables(what, tries, {"step": step, "passes": passes, "all_hosts": all_hosts}, rates, args.prompts)
    return 0


def print_tables(what: str, tries, series: dict, rates: dict, prompts: int) -> None:
    """The medians under each setting and the median per-round ratio to the first (the
    reference): the step and the passes, then the generations where there were any."""
    ref = tries[0]
    print(f"| {what} | plain step, ms | × ref. | 9-node pass, 2 hosts, ms | × ref. | every node hosting, ms | × ref. |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for t in tries:
        cells = []
        for times in series.values():
            ratio = statistics.median(a / b for a, b in zip(times[t], times[ref]))
            cells.append(f"{statistics.median(times[t]):.2f} | {ratio:.3f}")
        print(f"| {t} | " + " | ".join(cells) + " |")
    if not prompts:
        return
    print(f"\n{prompts} held-out prompts x 64 tokens, greedy, tokens/s (× ref.: the median per-round ratio)\n")
    print(f"| {what} | ar | × ref. | ss (auto) | × ref. |")
    print("| --- | --- | --- | --- | --- |")
    for t in tries:
        cells = []
        for m in (0, 1):
            ratio = statistics.median(a[m] / b[m] for a, b in zip(rates[t], rates[ref]))
            cells.append(f"{statistics.median(r[m] for r in rates[t]):.1f} | {ratio:.3f}")
        print(f"| {t} | " + " | ".join(cells) + " |")


def generation_rates(sm, tok, name: str, n: int):
    """A function that decodes the model's first ``n`` held-out bench prompts with ``ar`` and
    with ``ss --tree auto`` (greedy, 64 tokens) and returns their tokens/s (after each prompt's
    first token), in that order."""
    from specstream_mlx.bench import decode_prompts, load_bench_prompts
    from specstream_mlx.io.loading import resolve_model_path
    from specstream_mlx.runtime.generation import encode_prompt

    ids = [encode_prompt(tok, r["prompt"]) for r in load_bench_prompts(resolve_model_path(name), n)]

    def rates():
        out = []
        for mode, tree in (("ar", None), ("ss", "auto")):
            totals = decode_prompts(sm, tok, ids, mode=mode, tree=tree)
            out.append(totals.tokens / totals.seconds)
        return tuple(out)

    return rates


if __name__ == "__main__":
    sys.exit(main())
