"""The machine's limits, and the BLAS libraries timed against them.

* **The floor** of a decoding step: a step reads every weight once, so it cannot
  take less than (bytes of weights) ÷ (streaming read bandwidth). The bandwidth is
  measured here, in the same process and run as whatever it is compared with: the
  best of a few reads of a buffer larger than any cache, on one thread and on all.
* **The BLAS sweep** (``specstream-mlx bench-blas``): every library × thread count in
  its own process (a BLAS is chosen at process start), rounds interleaved so that a
  change of load hits every configuration alike. Each process times, per model, the
  matrix products of one step at b rows (every projection with its own weights, q/k/v
  and gate/up one product each where decoding fused them at load, then the LM head: what
  the BLAS does and nothing else) and the model's whole forward pass over b new rows after a 128-token
  prefix, as decoding loads it (q/k/v and gate/up fused, op by op), and the plain
  decoding step as ``ar`` runs it (compiled, the next step queued before a token is
  read). A configuration may name the allocator preloaded with the library
  (``openblas:2+skinny@jemalloc``; ``@glibc``: none); without one, the default.
"""

from __future__ import annotations

import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np

ROWS = (1, 2, 4, 8, 16)
CONTEXT = 128


@dataclass
class Bandwidth:
    """Streaming read bandwidth, bytes per second (best of ``reps`` reads)."""

    one_thread: float
    all_threads: float
    threads: int
    buffer_bytes: int

    @property
    def best(self) -> float:
        return max(self.one_thread, self.all_threads)


def read_bandwidth(buffer_bytes: int = 512 << 20, reps: int = 7, threads: Optional[int] = None) -> Bandwidth:
    """Measure how fast this machine streams memory into the cores.

    A max-reduction over float32 (vectorised, one load per element, nothing written)
    stands for reading weights once; the buffer is far larger than any cache."""
    threads = threads or os.cpu_count() or 1
    a = np.ones(buffer_bytes // 4, dtype=np.float32)
    parts = np.array_split(a, threads)

    def best(run: Callable[[], object]) -> float:
        return a.nbytes / min(timings(run, reps))

    one = best(lambda: a.max())
    with ThreadPoolExecutor(threads) as ex:
        every = best(lambda: list(ex.map(np.max, parts))) if threads > 1 else one
    return Bandwidth(one, every, threads, a.nbytes)


def weight_bytes(model) -> int:
    """Bytes of parameters one decoding step reads: every parameter of the base model
    as it is held for execution (float32 on the CPU backend), the weights the product
    kernel reads as stored counted as stored (:mod:`specstream_mlx.runtime.stored_weights`).
    A tied embedding is read once, as the LM head (the embedding row lookup is negligible)."""
    from mlx.utils import tree_flatten

    from ..runtime.stored_weights import registration

    held = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    stored = registration(model)
    return held - stored.float_bytes + stored.stored_bytes


# A block's projections in the order a step runs them (fused or as stored).
PROJECTIONS = ("qkv_proj", "q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "gate_proj", "up_proj", "down_proj")


def product_weights(model) -> list:
    """The weights of one decoding step's matrix products, in the order the step runs them
    (:func:`product_shapes`' order), as the model holds them: products of these read what a
    step reads (the stored form, where the kernel reads one)."""
    import mlx.nn as nn

    out = []
    for layer in model.layers:
        for block in (layer.self_attn, layer.mlp):
            for name in PROJECTIONS:
                if isinstance(block.get(name), nn.Linear):
                    out.append(block[name].weight)
    head = getattr(model, "lm_head", None)
    out.append(head.weight if head is not None else model.model.embed_tokens.weight)
    return out


def _one_row_per_depth(ws: list) -> dict:
    """A random row (1, k) for each depth k of the weights ``ws``, evaluated."""
    import mlx.core as mx

    xs = {w.shape[1]: mx.random.normal((1, w.shape[1])) for w in ws}
    mx.eval(list(xs.values()))
    return xs


def time_model_products(model, reps: int) -> float:
    """Median ms of one step's matrix products at one row, with the model's own weights."""
    import mlx.core as mx

    ws = product_weights(model)
    xs = _one_row_per_depth(ws)
    return median_ms(lambda: mx.eval([xs[w.shape[1]] @ w.T for w in ws]), reps)


# Products of one weight queued back to back in one evaluation by
# :func:`time_cached_products`: the first brings the weight into the caches, the others read it
# there (where it fits), and the host's cost of an evaluation is shared by all of them.
CACHED_REPEAT = 8


def time_cached_products(model, reps: int, repeat: int = CACHED_REPEAT) -> float:
    """Ms of one step's matrix products at one row, each weight read from the caches: per
    weight, the median of ``reps`` evaluations of ``repeat`` products of that weight in a row,
    divided by ``repeat``; summed over the weights. Against :func:`time_model_products` (each
    weight read once, from memory, as a step reads it) it parts the products' arithmetic from
    their wait on memory. A weight larger than the caches (an LM head) is read from memory
    either way."""
    import mlx.core as mx

    ws = product_weights(model)
    xs = _one_row_per_depth(ws)
    return sum(
        median_ms(lambda x=xs[w.shape[1]], w=w: mx.eval([x @ w.T for _ in range(repeat)]), reps) / repeat for w in ws
    )


# The side of the square float32 product whose rate stands for the machine's arithmetic.
GEMM_SIZE = 1024


def gemm_rate(size: int = GEMM_SIZE, reps: int = 5) -> float:
    """Multiply-adds a second of one ``size`` x ``size`` float32 matrix product, the fastest
    of ``reps``: the rate the arithmetic of a product cannot beat here, whatever its bytes (on
    the CPU backend the BLAS's own, a little below the cores' peak). A product of a few rows is
    bound by its bytes where its multiply-adds take less time than that at this rate, by its
    arithmetic otherwise."""
    import mlx.core as mx

    a, b = mx.random.normal((size, size)), mx.random.normal((size, size))
    mx.eval(a, b)
    return size**3 / min(timings(lambda: mx.eval(a @ b), reps))


def step_multiply_adds(model) -> int:
    """Multiply-adds of one row's matrix products in a step: every weight element once."""
    return sum(i * o for i, o in product_shapes(model))


def kv_bytes(model, rows: float) -> float:
    """Bytes of keys and values one plain step reads with ``rows`` rows in the cache (its
    own included): every layer's rows, a sliding-window layer's at most its window, in the
    dtype the model computes in (its final norm's)."""
    args = model.args
    per_row = 2 * args.num_key_value_heads * args.head_dim * model.model.norm.weight.dtype.size
    windows = [getattr(layer.self_attn, "window", None) for layer in model.layers]
    return per_row * sum(rows if w is None else min(rows, w) for w in windows)


def floor_seconds(model, bandwidth: Bandwidth) -> float:
    """The fastest a plain step of ``model`` can be on this machine."""
    return weight_bytes(model) / bandwidth.best


def product_shapes(model) -> List[tuple]:
    """(in, out) of every matrix product one step of ``model`` runs, in order: per layer
    q, k, v, o, gate, up, down (q|k|v, o, gate|up, down where they are fused,
    :mod:`specstream_mlx.models.fusion`), then the LM head."""
    args = model.args
    d, hd = args.hidden_size, args.head_dim
    q, kv = args.num_attention_heads * hd, args.num_key_value_heads * hd
    inter = args.intermediate_size
    attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
    qkv = [(d, q + 2 * kv)] if getattr(attn, "fused_qkv", False) else [(d, q), (d, kv), (d, kv)]
    gate_up = [(d, 2 * inter)] if getattr(mlp, "fused", False) else [(d, inter), (d, inter)]
    per_layer = qkv + [(q, d)] + gate_up + [(inter, d)]
    return per_layer * args.num_hidden_layers + [(d, args.vocab_size)]


def timings(run: Callable[[], object], reps: int) -> List[float]:
    """Seconds of ``reps`` runs after one warm-up run."""
    run()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        run()
        ts.append(time.perf_counter() - t0)
    return ts


def median_ms(run: Callable[[], None], reps: int) -> float:
    """Milliseconds: the median of ``reps`` runs after one warm-up run."""
    return statistics.median(timings(run, reps)) * 1e3


def time_products(shapes: Sequence[tuple], rows: Sequence[int], reps: int) -> Dict[int, float]:
    """Median ms of all ``shapes``' products at each row count (float32, distinct weights)."""
    import mlx.core as mx

    ws = [mx.random.normal((o, i)) * 0.02 for i, o in shapes]
    mx.eval(ws)
    out = {}
    for r in rows:
        xs = {i: mx.random.normal((r, i)) for i in {s[0] for s in shapes}}
        mx.eval(list(xs.values()))
        out[r] = median_ms(lambda xs=xs: mx.eval([xs[w.shape[1]] @ w.T for w in ws]), reps)
    return out


def time_passes(model, rows: Sequence[int], reps: int, context: int = CONTEXT) -> Dict[int, float]:
    """Median ms of the model's forward over ``b`` new rows after ``context`` cached
    tokens (b = 1 is a plain decoding step, argmax included), at each row count."""
    import mlx.core as mx

    from ..runtime.cache import make_cache, trim_cache

    cache = make_cache(model)
    model(mx.array([[1] * context]), cache=cache)
    mx.eval([c.keys for c in cache])
    out = {}
    for b in rows:

        def run(tokens=mx.array([[5] * b]), b=b):
            mx.eval(mx.argmax(model(tokens, cache=cache), axis=-1))
            trim_cache(cache, b)

        out[b] = median_ms(run, reps)
    return out


def timing_prompt(model, context: int):
    """The prompt timings decode after: ``context`` token ids, 1 then ids from 100 (a tiny
    vocabulary's from 2), wrapped within the model's vocabulary at any length."""
    import mlx.core as mx

    vocab = model.args.vocab_size
    first = 100 if vocab > 200 else 2
    return mx.array([1] + [first + i % (vocab - first) for i in range(context - 1)])


def plain_step_ms(model, tokens: int = 48, context: int = CONTEXT) -> List[float]:
    """Ms per token of plain greedy decoding as ``ar`` runs it (the engine's pipelined
    loop over the compiled step), after ``context`` prompt tokens and one warm-up token."""
    from ..runtime.sampling import SamplingParams
    from ..runtime.steps import ar_steps

    prompt = timing_prompt(model, context)
    t, times = None, []
    for i, _step in enumerate(ar_steps(model, prompt, SamplingParams())):
        now = time.perf_counter()
        if t is not None and i > 1:
            times.append((now - t) * 1e3)
        t = now
        if i >= tokens + 1:
            break
    return times


@dataclass
class FloorReport:
    """A plain decoding step of one model against the machine's floor, in one run.

    Attributes:
        weight_bytes: bytes of weights one step reads.
        bandwidth: the streaming read bandwidth measured in the same run.
        floor_ms: weight_bytes ÷ the best bandwidth.
        step_ms: median ms per generated token of plain decoding (the engine's own
            pipelined loop, greedy, after the first token), per round.
        products_ms: median ms of the step's matrix products alone at one row, per round.
        cached_products_ms: the same products with each weight read from the caches
            (:func:`time_cached_products`), per round: their arithmetic without the wait on
            memory.
        context: prompt tokens before the timed steps.
        kv_bytes: bytes of keys and values a timed step reads, on average (:func:`kv_bytes`).
        kv_floor_ms: kv_bytes ÷ the best bandwidth: what the context adds to the floor.
        multiply_adds: multiply-adds of the step's products (:func:`step_multiply_adds`).
        gemm_rate: multiply-adds a second of a large float32 product (:func:`gemm_rate`), the
            best of the rounds: the products' arithmetic at this rate is their compute floor.
    """

    model: str
    weight_bytes: int
    bandwidth: dict
    floor_ms: float
    step_ms: List[float]
    products_ms: List[float]
    blas: str = ""
    load: List[float] = field(default_factory=list)
    # Weights the product kernel reads as stored, and those bytes in float32.
    stored_weights: int = 0
    stored_float_bytes: int = 0
    stored_rows: str = ""  # up to how many rows they are read so (runtime/stored_rows.py)
    context: int = CONTEXT
    kv_bytes: int = 0
    kv_floor_ms: float = 0.0
    cached_products_ms: List[float] = field(default_factory=list)
    stored_half: int = 0  # of the weights read as stored, those whose scales the kernel reads as float16
    multiply_adds: int = 0
    gemm_rate: float = 0.0

    def summary(self) -> str:
        step, prod = statistics.median(self.step_ms), statistics.median(self.products_ms)
        bw = self.bandwidth
        both = self.floor_ms + self.kv_floor_ms
        return (
            f"{self.model}: {self.weight_bytes / 1e6:.0f} MB of weights per step{self._stored_words()}; streaming read "
            f"{bw['one_thread'] / 1e9:.1f} GB/s (1 thread), {bw['all_threads'] / 1e9:.1f} GB/s "
            f"({bw['threads']} threads): floor {self.floor_ms:.1f} ms\n"
            f"after a {self.context}-token context a step also reads {self.kv_bytes / 1e6:.1f} MB of keys and values "
            f"(+{self.kv_floor_ms:.2f} ms): {both:.1f} ms in all\n"
            f"plain step {step:.1f} ms ({1e3 / step:.1f} tok/s) = {step / self.floor_ms:.2f}x the floor "
            f"({step / both:.2f}x with the keys and values); "
            f"its matrix products alone {prod:.1f} ms ({prod / self.floor_ms:.2f}x){self._cached_words()}, "
            f"everything else {step - prod:.1f} ms\n{self._arithmetic_words()}"
            f"BLAS {self.blas}; 1-min load {min(self.load):.2f}-{max(self.load):.2f}"
        )

    def _arithmetic_words(self) -> str:
        if not (self.multiply_adds and self.gemm_rate):
            return ""
        ms = self.multiply_adds / self.gemm_rate * 1e3
        rows = int(self.floor_ms / ms) + 1  # the fewest rows whose multiply-adds outlast the bytes
        return (
            f"its {self.multiply_adds / 1e6:.0f} M multiply-adds take {ms:.2f} ms at this machine's float32 product "
            f"rate ({self.gemm_rate / 1e9:.0f} G/s, a {GEMM_SIZE} x {GEMM_SIZE} product): products of several rows "
            f"at once (a tree pass's) are bound by their arithmetic, not the bytes, from "
            f"{'one row' if rows == 1 else f'{rows} rows'} on\n"
        )

    def _cached_words(self) -> str:
        if not self.cached_products_ms:
            return ""
        cached = statistics.median(self.cached_products_ms)
        return f", {cached:.1f} ms with each weight read from the caches ({cached / self.floor_ms:.2f}x)"

    def _stored_words(self) -> str:
        if not self.stored_weights:
            return ""
        limits = f", {self.stored_rows}" if self.stored_rows else ""
        mb = self.stored_float_bytes / 1e6
        half = f", {self.stored_half} with float16 scales" if self.stored_half else ""
        return f" ({self.stored_weights} weights read as stored{half}{limits}, {mb:.0f} MB as float32)"


def measure_floor(name: str, tokens: int = 64, rounds: int = 3, reps: int = 9, context: int = CONTEXT) -> FloorReport:
    """Plain decoding of ``name`` after ``context`` prompt tokens against the floor, rounds
    interleaved with the bandwidth and product measurements (each figure is a median of its
    rounds)."""
    from ..platform_info import blas_words
    from ..runtime.loaded_model import load
    from ..runtime.stored_rows import limits_words
    from ..runtime.stored_weights import registration

    m, _ = load(name, warn=False)
    steps, prods, cached, bws, loads, rates = [], [], [], [], [], []
    for _ in range(rounds):
        steps.append(statistics.median(plain_step_ms(m.base, tokens, context)))
        prods.append(time_model_products(m.base, reps))
        cached.append(time_cached_products(m.base, reps))
        bws.append(read_bandwidth())
        rates.append(gemm_rate())
        loads.append(os.getloadavg()[0])
    best = max(bws, key=lambda b: b.best)
    wb = weight_bytes(m.base)
    stored = registration(m.base)
    # The timed steps' rows: the prompt, the first (untimed) tokens, half the timed ones.
    kv = kv_bytes(m.base, context + 2 + tokens / 2)
    return FloorReport(
        name,
        wb,
        asdict(best),
        wb / best.best * 1e3,
        steps,
        prods,
        blas_words(),
        loads,
        stored.weights,
        stored.float_bytes,
        limits_words(m.base),
        context,
        int(kv),
        kv / best.best * 1e3,
        cached,
        stored.half,
        step_multiply_adds(m.base),
        max(rates),
    )


@dataclass
class SweepConfig:
    library: str  # a key of platform_info.LIBRARIES
    threads: int
    # The forwarder in front (platform_info.gemv_forwarder): "" none, "gemv" one-row products
    # to the library's GEMV only, "skinny" its own kernel for 1-48 rows, "skinny2" the kernel
    # for 2-48 rows and one-row products to the GEMV.
    forwarder: str = ""
    malloc: str = ""  # the allocator preloaded with it: a key of platform_info.MALLOCS, "glibc", "" the default

    @property
    def label(self) -> str:
        return (
            f"{self.library}:{self.threads}"
            + (f"+{self.forwarder}" if self.forwarder else "")
            + (f"@{self.malloc}" if self.malloc else "")
        )


@dataclass
class SweepResult:
    """Medians over rounds, per config label, model and row count."""

    date: str
    machine: dict
    floor: Dict[str, dict]
    bandwidth: List[dict]
    products_ms: Dict[str, Dict[str, Dict[int, float]]] = field(default_factory=dict)
    pass_ms: Dict[str, Dict[str, Dict[int, float]]] = field(default_factory=dict)
    # The pipelined plain step (b = 1 only), per config label and model.
    step_ms: Dict[str, Dict[str, float]] = field(default_factory=dict)
    versions: Dict[str, Optional[str]] = field(default_factory=dict)
    load: List[float] = field(default_factory=list)
    settings: dict = field(default_factory=dict)


def _child(models: Sequence[str], rows: Sequence[int], reps: int) -> dict:
    """In a process with one BLAS preloaded: products and passes of each model."""
    from ..platform_info import blas_in_use, blas_threads, blas_version, forwarder_words, malloc_in_use
    from ..runtime.loaded_model import load

    res = {"blas": blas_in_use(), "version": blas_version(), "threads": blas_threads(), "models": {}}
    res["forwarder"] = forwarder_words()
    res["malloc"] = malloc_in_use()
    for name in models:
        m, _ = load(name, warn=False)
        res["models"][name] = {
            "products_ms": time_products(product_shapes(m.base), rows, reps),
            "pass_ms": time_passes(m.base, rows, reps),
            "step_ms": statistics.median(plain_step_ms(m.base)),
            "weight_bytes": weight_bytes(m.base),
        }
    return res


def run_sweep(
    configs: Sequence[SweepConfig],
    models: Sequence[str],
    rows: Sequence[int] = ROWS,
    rounds: int = 3,
    reps: int = 9,
    log: Callable[[str], None] = print,
) -> SweepResult:
    """Time every config on every model, rounds interleaved (each round in a rotated
    order); the floor's bandwidth is measured once per round between them."""
    from ..platform_info import LIBRARIES, MALLOC_ENV, choose_blas, runtime_info

    envs = {}
    for c in configs:
        # Raises if not installed; no allocator named: the default one.
        malloc = c.malloc or os.environ.get(MALLOC_ENV)
        choice = choose_blas(f"{c.library}:{c.threads}", gemv=bool(c.forwarder), malloc=malloc)
        if c.forwarder and choice.forwarder is None:
            raise RuntimeError(f"{c.label}: the forwarder cannot be built here (no C compiler?)")
        env = {
            k: v
            for k, v in os.environ.items()
            if k != "LD_PRELOAD" and not k.endswith("_NUM_THREADS") and not k.startswith("SPECSTREAM_SKINNY")
        }
        env.update(choice.env())
        if not c.forwarder.startswith("skinny"):
            env["SPECSTREAM_SKINNY_ROWS"] = "0"
        if c.forwarder == "skinny2":
            env["SPECSTREAM_SKINNY_MIN_ROWS"] = "2"
        env.update({lib.threads_env: str(c.threads) for lib in LIBRARIES.values()})
        env["OMP_NUM_THREADS"] = str(c.threads)
        envs[c.label] = env
    raw: Dict[str, List[dict]] = {c.label: [] for c in configs}
    bws, loads = [], []
    for r in range(rounds):
        order = list(configs[r % len(configs) :]) + list(configs[: r % len(configs)])
        for c in order:
            log(f"round {r + 1}/{rounds}: {c.label}")
            cmd = [sys.executable, "-m", "specstream_mlx.bench.machine", json.dumps([list(models), list(rows), reps])]
            out = subprocess.run(cmd, env=envs[c.label], capture_output=True, text=True)
            if out.returncode != 0:
                raise RuntimeError(f"{c.label}: the timing process failed: {out.stderr.strip().splitlines()[-1:]}")
            raw[c.label].append(json.loads(out.stdout.strip().splitlines()[-1]))
            loads.append(os.getloadavg()[0])
        bws.append(read_bandwidth())
    info = runtime_info()
    first = next(iter(raw.values()))[0]["models"]
    best_bw = max(b.best for b in bws)
    res = SweepResult(
        date=datetime.datetime.now().isoformat(timespec="seconds"),
        machine={k: info[k] for k in ("cpu", "cores", "os", "mlx", "device")},
        floor={
            m: {"weight_bytes": first[m]["weight_bytes"], "floor_ms": first[m]["weight_bytes"] / best_bw * 1e3}
            for m in models
        },
        bandwidth=[asdict(b) for b in bws],
        load=loads,
        settings={"rounds": rounds, "reps": reps, "rows": list(rows), "context": CONTEXT},
    )
    for label, runs in raw.items():
        res.versions[label] = (
            f"{runs[0]['blas']} {runs[0]['version']}, {runs[0]['threads']} threads"
            + runs[0].get("forwarder", "")
            + f"; allocator {runs[0].get('malloc', 'glibc')}"
        )
        res.step_ms[label] = {m: statistics.median(run["models"][m]["step_ms"] for run in runs) for m in models}
        for kind in ("products_ms", "pass_ms"):
            getattr(res, kind)[label] = {
                m: {int(b): statistics.median(run["models"][m][kind][str(b)] for run in runs) for b in rows}
                for m in models
            }
    return res


def sweep_markdown(res: SweepResult) -> str:
    """Tables: per model, ms per config and row count, and each against the floor."""
    m = res.machine
    bw = max(b["one_thread"] for b in res.bandwidth), max(b["all_threads"] for b in res.bandwidth)
    lines = [
        f"BLAS sweep — {res.date} — {m['cpu']} ({m['cores']} cores), {m['os']}, MLX {m['mlx']} ({m['device']}); "
        f"{res.settings['rounds']} interleaved rounds × {res.settings['reps']} repetitions (medians); "
        f"1-min load during the run {min(res.load):.2f}–{max(res.load):.2f}; "
        f"streaming read {bw[0] / 1e9:.1f} GB/s on one thread, {bw[1] / 1e9:.1f} GB/s on all",
        "",
        "Libraries: " + "; ".join(f"`{k}` = {v}" for k, v in res.versions.items()),
        "",
    ]
    rows = res.settings["rows"]
    for model, fl in res.floor.items():
        lines += [
            f"**{model}** — {fl['weight_bytes'] / 1e6:.0f} MB of weights per step; floor "
            f"{fl['floor_ms']:.1f} ms (weights ÷ best read bandwidth). Cells: ms (× floor).",
            "",
            "| library:threads | what | " + " | ".join(f"b={b}" for b in rows) + " |",
            "| --- | --- | " + " | ".join("---" for _ in rows) + " |",
        ]
        for kind, what in (("products_ms", "products"), ("pass_ms", "forward pass")):
            for label, per_model in getattr(res, kind).items():
                cells = [f"{per_model[model][b]:.1f} ({per_model[model][b] / fl['floor_ms']:.2f}×)" for b in rows]
                lines.append(f"| {label} | {what} | " + " | ".join(cells) + " |")
        for label, per_model in res.step_ms.items():
            ms = per_model[model]
            cells = [f"{ms:.2f} ({ms / fl['floor_ms']:.2f}×)" if b == 1 else "" for b in rows]
            lines.append(f"| {label} | plain step, as `ar` runs it | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":  # the timing process of one configuration
    _models, _rows, _reps = json.loads(sys.argv[1])
    print(json.dumps(_child(_models, _rows, _reps)))
