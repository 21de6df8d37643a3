"""``specstream-mlx bench``: every decoding method on the same prompts, in one run.

Methods: ``ar`` (this runtime, plain), ``mlx_lm`` (mlx-lm's decoding of the same
weights), ``mlx_lm-draft`` (mlx-lm speculative decoding with the draft model),
``lookup``, ``ss`` (greedy) and ``ss@T`` with ``ar@T`` (sampling at temperature
T). Each method decodes every prompt after one warm-up; one harness clock times
all of them: tokens/s counts the tokens after the first, divided by the time
after the first token; time to first token is measured separately. Speedups are
ratios to ``ar`` (``ar@T`` for ``ss@T``) within the run.
"""

from __future__ import annotations

import datetime
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional

import mlx.core as mx

from ..io.loading import (
    ModelLoadError,
    cast_floating,
    compute_dtype_for_device,
    dequantize_model,
    dequantize_on_cpu,
    load_config,
    resolve_model_path,
)
from ..io.prompts import read_prompt_rows
from ..method.tree import TreeSpec
from ..platform_info import cond_spin_paused, runtime_info
from ..runtime.attention_choice import attention_form
from ..runtime.generation import encode_prompt, stream_generate
from ..runtime.loaded_model import load
from ..runtime.sampling import SamplingParams
from ..runtime.stored_rows import limits_words


@dataclass
class Run:
    tokens: List[int]
    text: str
    ttft: float
    tps: float
    passes: int
    peak_gb: float
    eos: bool = False
    first: int = 0  # tokens of the first response (the prefill pass's)


@dataclass
class MethodResult:
    method: str
    temperature: float
    tokens_per_second_median: float
    tokens_per_second_min: float
    tokens_per_second_max: float
    speedup_vs_ar: Optional[float]
    tokens_per_pass: float
    ttft_ms: float
    peak_memory_gb: float
    matches_ar: Optional[bool]
    exact_match: Optional[float] = None
    # Greedy runs whose reply parts from ar's at a tie of the two best logits within float32
    # rounding (runtime.ties): the rounding's choice, where any other difference is a defect.
    ties_with_ar: int = 0
    differs_from_ar: int = 0  # greedy runs whose reply differs from ar's, ties included
    generated_tokens: int = 0
    note: str = ""


def _timed(stream: Iterator, tokens_of: Callable, is_pass: Callable) -> Run:
    mx.reset_peak_memory()
    t0 = time.perf_counter()
    first = last = None
    toks, text, passes, after_first, first_n = [], [], 0, 0, 0
    for r in stream:
        now = time.perf_counter()
        new = tokens_of(r)
        passes += is_pass(r)
        if first is None:
            first = now
            first_n = len(new)
        else:
            after_first += len(new)
            last = now
        toks.extend(new)
        text.append(r.text)
    tps = after_first / (last - first) if last and last > first else 0.0
    eos = getattr(r, "finish_reason", None) == "stop" if first is not None else False
    return Run(toks, "".join(text), (first or t0) - t0, tps, passes, mx.get_peak_memory() / 1e9, eos, first_n)


@dataclass
class DecodeTotals:
    """Greedy decoding of several prompts, summed over them; every figure leaves out each
    prompt's first step (prompt processing). For sweeps that compare trees with ``ar``."""

    seconds: float
    tokens: int
    steps: int
    draft_nodes: int
    pruned_nodes: int

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds

    @property
    def tokens_per_step(self) -> float:
        return self.tokens / max(self.steps, 1)

    @property
    def seconds_per_step(self) -> float:
        return self.seconds / max(self.steps, 1)

    @property
    def pruned_share(self) -> float:
        return self.pruned_nodes / max(self.draft_nodes, 1)


def decode_prompts(
    model, tok, ids: List[List[int]], mode: str = "ar", tree=None, pruning_threshold=None, max_tokens: int = 64
) -> DecodeTotals:
    """Decode every prompt of ``ids`` greedily (stopping at EOS) and sum the figures."""
    totals = DecodeTotals(0.0, 0, 0, 0, 0)
    for i in ids:
        first = r = None
        for r in stream_generate(
            model,
            tok,
            i,
            max_tokens=max_tokens,
            sampling=SamplingParams(),
            mode=mode,
            use_chat_template=False,
            tree=tree,
            pruning_threshold=pruning_threshold,
        ):
            if first is None:
                first = time.perf_counter()
                continue
            totals.tokens += len(r.tokens)
            totals.steps += 1
        totals.seconds += time.perf_counter() - first
        totals.draft_nodes += r.stats.draft_nodes
        totals.pruned_nodes += r.stats.pruned_nodes
    return totals


def read_prompts_file(path: Path, n: int) -> List[dict]:
    """The first ``n`` prompts of a JSONL file in any format ``train`` reads, as bench
    rows ``{"prompt": text or messages, "completion": reference (when there is one)}``."""
    rows = read_prompt_rows(path, n)
    if not rows:
        raise ValueError(f"{path}: no prompts")
    out = []
    for r in rows:
        row = {"prompt": r.messages[-1]["content"] if r.as_prompt else r.messages}
        if r.reference is not None:
            row["completion"] = r.reference
        out.append(row)
    return out


def load_bench_prompts(model_dir: Path, n: int, prompts_file: Optional[Path] = None) -> List[dict]:
    """The first ``n`` prompts of ``prompts_file``, else the held-out prompts shipped
    with a model (generic ones if none)."""
    if prompts_file is not None:
        return read_prompts_file(prompts_file, n)
    f = model_dir / "bench_prompts.jsonl"
    if not f.exists():
        return [
            {"prompt": p}
            for p in (
                "Explain speculative decoding in one paragraph.",
                "Write a haiku about the sea.",
                "What is the capital of France?",
                "List three uses of a paperclip.",
                "Summarize the plot of Hamlet.",
                "How do I boil an egg?",
                "Tell me a joke.",
                "What is machine learning?",
            )
        ][:n]
    return read_prompts_file(f, n)


def _prompt_set_rows(path: Path, prompt_set: str, n: int, max_tokens: int) -> List[dict]:
    """A named prompt set's rows; second turns follow the model's own greedy first answer
    (``max_tokens`` long at most, decoded plainly)."""
    from .mtbench import prompt_rows

    first_answer = None
    if prompt_set == "mtbench-2":
        from ..runtime.generation import generate

        model, tok = load(str(path), warn=False)

        def first_answer(question: str) -> str:
            return generate(model, tok, question, max_tokens=max_tokens, mode="ar").text

    return prompt_rows(prompt_set, n, first_answer)


def _f32(model):
    """mlx-lm's model on the weights and dtype ours runs: quantized layers expanded where our
    loader expands them (the CPU backend), floats in the compute dtype."""
    if dequantize_on_cpu():
        dequantize_model(model)
    dt = compute_dtype_for_device()
    if dt is not None:
        cast_floating(model, dt)
    return model


@dataclass
class BenchSetup:
    """What every method of one bench run shares."""

    prompts: List[dict]
    ids: List[List[int]]
    max_tokens: int
    temperature: float
    seed: int


def _ours(model, tok, setup: BenchSetup, mode: str, sampling: SamplingParams, tree=None) -> Callable[[int], Run]:
    def run(i: int) -> Run:
        gen = stream_generate(
            model,
            tok,
            setup.ids[i],
            max_tokens=setup.max_tokens,
            sampling=sampling(i),
            mode=mode,
            use_chat_template=False,
            tree=tree,
        )
        return _timed(gen, lambda r: r.tokens, lambda r: 1)

    return run


def _mlx_lm(theirs, ttok, setup: BenchSetup, draft_model=None, num_draft_tokens: int = 3) -> Callable[[int], Run]:
    import mlx_lm
    from mlx_lm.sample_utils import make_sampler

    kw = dict(draft_model=draft_model, num_draft_tokens=num_draft_tokens) if draft_model is not None else {}

    def run(i: int) -> Run:
        gen = mlx_lm.stream_generate(
            theirs, ttok, setup.ids[i], max_tokens=setup.max_tokens, sampler=make_sampler(0.0), **kw
        )
        # The peer as it runs without this project's library: its condition waits sleep at once
        # (platform_info.cond_spin_paused; polling ones had slowed mlx_lm's steps on a Xeon).
        with cond_spin_paused():
            return _timed(
                gen,
                lambda r: [] if r.token in ttok.eos_token_ids else [r.token],
                lambda r: 0 if getattr(r, "from_draft", False) else 1,
            )

    return run


def _draft_path(path: Path, draft: Optional[str]) -> Optional[Path]:
    """The draft model for mlx_lm's speculative decoding: ``--draft``, else MODEL-draft beside it."""
    if draft is None:
        cand = path.parent / f"{path.name}-draft"
        return cand if cand.is_dir() else None
    if not draft:
        return None
    try:
        found = resolve_model_path(draft)
        if not (found / "config.json").is_file():  # had been a bare errno, after the model loaded
            raise ValueError(f"--draft {draft}: not a model directory (no config.json)")
        # mlx-lm verifies the draft's token ids as the model's own: another vocabulary is nonsense.
        theirs, ours = (load_config(p).get("vocab_size") for p in (found, path))
    except ModelLoadError as e:
        raise ValueError(f"--draft {e}") from None
    if theirs != ours:
        raise ValueError(f"--draft {draft}: a vocabulary of {theirs} tokens, the model's has {ours}")
    return found


def _methods(
    path: Path, setup: BenchSetup, tree: str, draft_path: Optional[Path], baseline: Optional[str], num_draft_tokens: int
) -> "tuple[Dict[str, Callable[[int], Run]], Any]":
    """Every method of the run, in table order, as prompt index -> timed run; and our model."""
    import mlx_lm

    m, tok = load(str(path), warn=False)
    theirs, ttok = mlx_lm.load(str(path))
    _f32(theirs)
    greedy = lambda i: SamplingParams()  # noqa: E731
    hot = lambda i: SamplingParams(temperature=setup.temperature, seed=setup.seed + i)  # noqa: E731
    tree_arg = tree if tree == "auto" else TreeSpec.parse(tree)
    t = setup.temperature
    methods = {"ar": _ours(m, tok, setup, "ar", greedy), "mlx_lm": _mlx_lm(theirs, ttok, setup)}
    if draft_path is not None:
        d_model = _f32(mlx_lm.load(str(draft_path))[0])
        methods["mlx_lm-draft"] = _mlx_lm(theirs, ttok, setup, d_model, num_draft_tokens)
    methods["lookup"] = _ours(m, tok, setup, "lookup", greedy)
    if m.streams is not None:
        methods["ss"] = _ours(m, tok, setup, "ss", greedy, tree_arg)
    methods[f"ar@{t}"] = _ours(m, tok, setup, "ar", hot)
    if m.streams is not None:
        methods[f"ss@{t}"] = _ours(m, tok, setup, "ss", hot, tree_arg)
    if baseline:
        b_model, b_tok = load(str(resolve_model_path(baseline)), warn=False)
        methods["baseline-ar"] = _ours(b_model, b_tok, setup, "ar", greedy)
    return methods, m


def _run_all(methods: Dict[str, Callable[[int], Run]], n_prompts: int, rounds: int, progress: bool):
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(methods) * (rounds * n_prompts + 1), desc="bench", unit="run")
    try:
        return _rounds(methods, n_prompts, rounds, bar)
    finally:  # closed before an error is said, so that the error ends the output
        if bar:
            bar.close()


def _rounds(methods: Dict[str, Callable[[int], Run]], n_prompts: int, rounds: int, bar) -> Dict[str, List[Run]]:
    runs: Dict[str, List[Run]] = {name: [] for name in methods}
    for fn in methods.values():
        fn(0)  # warm-up (also measures --tree auto step costs once)
        if bar:
            bar.update(1)
    # Round-robin over methods for each prompt, so slow drifts of the machine
    # (frequency, other load) hit every method alike, starting each prompt at the next
    # method: a fixed order would always give the same method the same neighbour and
    # position (caches, frequency after the previous run). Every prompt is decoded
    # ``rounds`` times per method; short replies give noisy single timings.
    names = list(methods)
    turn = 0
    for _ in range(rounds):
        for i in range(n_prompts):
            for k in range(len(names)):
                name = names[(turn + k) % len(names)]
                runs[name].append(methods[name](i))
                if bar:
                    bar.update(1)
            turn += 1
    return runs  # per method in (round, prompt) order: the summary pairs runs across methods


def _ties(model, setup: BenchSetup, rs: List[Run], ar: List[Run], strip) -> int:
    """How many of the runs ``rs`` whose replies differ from ``ar``'s part at a tie."""
    from ..runtime import ties

    n = len(setup.ids)
    pairs = [(k, strip(a.tokens), strip(b.tokens)) for k, (a, b) in enumerate(zip(ar, rs))]
    return sum(ties.parts_at_a_tie(model, setup.ids[k % n], a, b) for k, a, b in pairs if a != b)


def _summarize(runs: Dict[str, List[Run]], setup: BenchSetup, eos_ids, model=None) -> List[MethodResult]:
    """Each method's figures; with ``model``, greedy replies that differ from ``ar``'s are
    checked for a tie where they part."""
    eos = set(eos_ids)

    def strip(toks):
        out = []
        for t in toks:
            if t in eos:
                break
            out.append(t)
        return out

    temperature, prompts = setup.temperature, setup.prompts
    ar_tps = statistics.median(r.tps for r in runs["ar"])
    hot_tps = statistics.median(r.tps for r in runs[f"ar@{temperature}"])
    results = []
    for name, rs in runs.items():
        temp = temperature if "@" in name else 0.0
        tps = [r.tps for r in rs]
        med = statistics.median(tps)
        ref = hot_tps if temp else ar_tps
        matches, ties, differs = None, 0, 0
        if temp == 0 and name != "baseline-ar":
            differs = sum(strip(a.tokens) != strip(b.tokens) for a, b in zip(rs, runs["ar"]))
            matches = differs == 0
            if differs and model is not None and name in ("ss", "lookup"):
                ties = _ties(model, setup, rs, runs["ar"], strip)
        exact = None
        # Runs are ordered round by round: run k decoded prompt k mod len(prompts).
        refs = [(r, prompts[k % len(prompts)].get("completion")) for k, r in enumerate(rs)]
        refs = [(r, c) for r, c in refs if isinstance(c, str)]
        if refs and name in ("ss", "ar", "baseline-ar"):
            exact = sum(r.text.strip() == c.strip() for r, c in refs) / len(refs)
        total = sum(len(strip(r.tokens)) for r in rs)
        # τ (docs/DESIGN.md §5): every token a decoding pass decided, the EOS that ends a reply
        # included, over the decoding passes: each run's prefill pass and its token left out.
        decided = sum(len(strip(r.tokens)) + (len(strip(r.tokens)) < len(r.tokens) or r.eos) - r.first for r in rs)
        passes = sum(r.passes - 1 for r in rs if r.passes > 1)
        results.append(
            MethodResult(
                method=name,
                temperature=temp,
                tokens_per_second_median=med,
                tokens_per_second_min=min(tps),
                tokens_per_second_max=max(tps),
                speedup_vs_ar=(med / ref if ref else None),
                tokens_per_pass=decided / passes if passes else 0.0,
                ttft_ms=1000 * statistics.median(r.ttft for r in rs),
                peak_memory_gb=max(r.peak_gb for r in rs),
                matches_ar=matches,
                exact_match=exact,
                ties_with_ar=ties,
                differs_from_ar=differs,
                generated_tokens=total,
                note=("baseline model (next-token only)" if name == "baseline-ar" else ""),
            )
        )
    return results


def run_bench(
    model: str,
    draft: Optional[str] = None,
    baseline: Optional[str] = None,
    n_prompts: int = 16,
    max_tokens: int = 64,
    temperature: float = 0.7,
    tree: str = "auto",
    num_draft_tokens: int = 3,
    seed: int = 0,
    progress: bool = True,
    log=print,
    rounds: int = 3,
    prompts_file: Optional[str] = None,
    prompt_set: Optional[str] = None,
) -> dict:
    """Decode the model's held-out prompts (or ``prompts_file``'s, or a named
    ``prompt_set``: ``mtbench``, ``mtbench-2``) with every method; returns the JSON-ready result."""
    path = resolve_model_path(model)
    if prompt_set is not None and prompts_file is not None:
        raise ValueError("give a prompts file or a prompt set, not both")
    if prompt_set is not None:
        prompts = _prompt_set_rows(path, prompt_set, n_prompts, max_tokens)
    else:
        prompts = load_bench_prompts(path, n_prompts, Path(prompts_file) if prompts_file else None)
    draft_path = _draft_path(path, draft)
    sm, tok = load(str(path), warn=False)
    attention = attention_form(sm.base)  # what every method's model attends with (one process)
    stored_rows = limits_words(sm.base) or None
    del sm
    ids = [encode_prompt(tok, p["prompt"], use_chat_template=True) for p in prompts]
    setup = BenchSetup(prompts, ids, max_tokens, temperature, seed)
    methods, ours = _methods(path, setup, tree, draft_path, baseline, num_draft_tokens)
    runs = _run_all(methods, len(prompts), rounds, progress)
    # What --tree auto measured and chose per decoding kind (recorded with the machine).
    ss_passes = {kind: "compiled" if t.compiled else "op by op" for kind, t in ours.tuners.items()}
    results = _summarize(runs, setup, tok.eos_token_ids, ours)
    info = runtime_info()
    return {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": {
            k: info[k]
            for k in (
                "cpu",
                "cores",
                "os",
                "machine",
                "mlx",
                "mlx_lm",
                "device",
                "blas",
                "blas_version",
                "blas_core",
                "blas_threads",
                "blas_gemv_forwarding",
                "blas_forwarder",
                "cpu_kernels",
                "malloc",
            )
        },
        "model": str(path.name),
        "draft_model": draft_path.name if draft_path else None,
        "baseline_model": Path(baseline).name if baseline else None,
        "settings": {
            "prompts": len(prompts),
            "prompts_file": Path(prompts_file).name if prompts_file else None,
            "prompt_set": prompt_set,
            "rounds": rounds,
            "max_tokens": max_tokens,
            "temperature": temperature,
            "tree": tree,
            "num_draft_tokens": num_draft_tokens,
            "seed": seed,
            "ss_passes": ss_passes,
            "attention": attention,
            "stored_rows": stored_rows,
        },
        "results": [asdict(r) for r in results],
    }
