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
import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional

import mlx.core as mx


@dataclass
class Run:
    tokens: List[int]
    text: str
    ttft: float
    tps: float
    passes: int
    peak_gb: float
    eos: bool = False


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
    generated_tokens: int = 0
    note: str = ""


def _timed(stream: Iterator, tokens_of: Callable, is_pass: Callable) -> Run:
    mx.reset_peak_memory()
    t0 = time.perf_counter()
    first = last = None
    toks, text, passes, after_first = [], [], 0, 0
    for r in stream:
        now = time.perf_counter()
        new = tokens_of(r)
        passes += is_pass(r)
        if first is None:
            first = now
        else:
            after_first += len(new)
            last = now
        toks.extend(new)
        text.append(r.text)
    tps = after_first / (last - first) if last and last > first else 0.0
    eos = getattr(r, "finish_reason", None) == "stop" if first is not None else False
    return Run(toks, "".join(text), (first or t0) - t0, tps, passes, mx.get_peak_memory() / 1e9, eos)


def load_bench_prompts(model_dir: Path, n: int) -> List[dict]:
    """The first ``n`` held-out prompts shipped with a model (generic ones if none)."""
    f = model_dir / "bench_prompts.jsonl"
    if not f.exists():
        return [{"prompt": p} for p in (
            "Explain speculative decoding in one paragraph.", "Write a haiku about the sea.",
            "What is the capital of France?", "List three uses of a paperclip.",
            "Summarize the plot of Hamlet.", "How do I boil an egg?", "Tell me a joke.",
            "What is machine learning?")][:n]
    rows = [json.loads(l) for l in f.read_text().splitlines() if l.strip()]
    return rows[:n]


def _f32(model):
    from .loading import cast_floating, compute_dtype_for_device

    dt = compute_dtype_for_device()
    if dt is not None:
        cast_floating(model, dt)
    return model


def run_bench(model: str, draft: Optional[str] = None, baseline: Optional[str] = None, n_prompts: int = 16,
              max_tokens: int = 64, temperature: float = 0.7, tree: str = "auto", num_draft_tokens: int = 3,
              seed: int = 0, progress: bool = True, log=print, rounds: int = 3) -> dict:
    import mlx_lm

    from .generation import encode_prompt, stream_generate
    from .loading import load, resolve_model_path
    from .platform_info import runtime_info
    from .sampling import SamplingParams
    from .tree import TreeSpec

    path = resolve_model_path(model)
    m, tok = load(str(path), warn=False)
    prompts = load_bench_prompts(path, n_prompts)
    ids = [encode_prompt(tok, p["prompt"], use_chat_template=True) for p in prompts]
    theirs, ttok = mlx_lm.load(str(path))
    _f32(theirs)
    draft_path = None
    if draft is None:
        cand = path.parent / f"{path.name}-draft"
        draft_path = cand if cand.is_dir() else None
    elif draft:
        draft_path = resolve_model_path(draft)
    d_model = _f32(mlx_lm.load(str(draft_path))[0]) if draft_path else None
    greedy = SamplingParams()
    hot = lambda i: SamplingParams(temperature=temperature, seed=seed + i)
    tree_arg = tree if tree == "auto" else TreeSpec.parse(tree)

    def ours(mode, sampling, i, **kw):
        return _timed(stream_generate(m, tok, ids[i], max_tokens=max_tokens, sampling=sampling, mode=mode,
                                      use_chat_template=False, **kw),
                      lambda r: r.tokens, lambda r: 1)

    def mlxlm(i, with_draft):
        from mlx_lm.sample_utils import make_sampler

        kw = dict(draft_model=d_model, num_draft_tokens=num_draft_tokens) if with_draft else {}
        return _timed(mlx_lm.stream_generate(theirs, ttok, ids[i], max_tokens=max_tokens,
                                             sampler=make_sampler(0.0), **kw),
                      lambda r: [] if r.token in ttok.eos_token_ids else [r.token],
                      lambda r: 0 if getattr(r, "from_draft", False) else 1)

    methods: Dict[str, Callable[[int], Run]] = {
        "ar": lambda i: ours("ar", greedy, i),
        "mlx_lm": lambda i: mlxlm(i, False),
    }
    if d_model is not None:
        methods["mlx_lm-draft"] = lambda i: mlxlm(i, True)
    methods["lookup"] = lambda i: ours("lookup", greedy, i)
    has_streams = m.streams is not None
    if has_streams:
        methods["ss"] = lambda i: ours("ss", greedy, i, tree=tree_arg)
    methods[f"ar@{temperature}"] = lambda i: ours("ar", hot(i), i)
    if has_streams:
        methods[f"ss@{temperature}"] = lambda i: ours("ss", hot(i), i, tree=tree_arg)
    if baseline:
        b_model, b_tok = load(str(resolve_model_path(baseline)), warn=False)
        methods["baseline-ar"] = lambda i: _timed(
            stream_generate(b_model, b_tok, ids[i], max_tokens=max_tokens, sampling=greedy, mode="ar",
                            use_chat_template=False), lambda r: r.tokens, lambda r: 1)

    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(methods) * (rounds * len(prompts) + 1), desc="bench", unit="run")
    runs: Dict[str, List[Run]] = {name: [] for name in methods}
    for name, fn in methods.items():
        fn(0)  # warm-up (also measures --tree auto step costs once)
        if bar:
            bar.update(1)
    # Round-robin over methods for each prompt, so slow drifts of the machine
    # (frequency, other load) hit every method alike.
    # Every prompt is decoded ``rounds`` times per method; short replies (SQL
    # answers are ~20 tokens) give noisy single timings.
    for _ in range(rounds):
        for i in range(len(prompts)):
            for name, fn in methods.items():
                runs[name].append(fn(i))
                if bar:
                    bar.update(1)
    if bar:
        bar.close()

    def strip(toks):
        eos = set(tok.eos_token_ids)
        out = []
        for t in toks:
            if t in eos:
                break
            out.append(t)
        return out

    ar_tps = statistics.median(r.tps for r in runs["ar"])
    hot_tps = statistics.median(r.tps for r in runs[f"ar@{temperature}"])
    results = []
    for name, rs in runs.items():
        temp = temperature if "@" in name else 0.0
        tps = [r.tps for r in rs]
        med = statistics.median(tps)
        ref = hot_tps if temp else ar_tps
        matches = None
        if temp == 0 and name != "baseline-ar":
            matches = all(strip(a.tokens) == strip(b.tokens) for a, b in zip(rs, runs["ar"]))
        exact = None
        if "completion" in prompts[0] and name in ("ss", "ar", "baseline-ar"):
            # Runs are ordered round by round: run k decoded prompt k mod len(prompts).
            exact = sum(r.text.strip() == prompts[k % len(prompts)]["completion"].strip()
                        for k, r in enumerate(rs)) / len(rs)
        total = sum(len(strip(r.tokens)) for r in rs)
        # τ counts every token a pass decided, the EOS that ends a reply included.
        decided = sum(len(strip(r.tokens)) + (len(strip(r.tokens)) < len(r.tokens) or r.eos) for r in rs)
        passes = sum(r.passes for r in rs)
        results.append(MethodResult(
            method=name, temperature=temp, tokens_per_second_median=med, tokens_per_second_min=min(tps),
            tokens_per_second_max=max(tps), speedup_vs_ar=(med / ref if ref else None),
            tokens_per_pass=decided / passes if passes else 0.0,
            ttft_ms=1000 * statistics.median(r.ttft for r in rs),
            peak_memory_gb=max(r.peak_gb for r in rs), matches_ar=matches, exact_match=exact,
            generated_tokens=total,
            note=("baseline model (next-token only)" if name == "baseline-ar" else ""),
        ))
    info = runtime_info()
    return {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": {k: info[k] for k in ("cpu", "cores", "os", "machine", "mlx", "mlx_lm", "device", "blas")},
        "model": str(path.name),
        "draft_model": draft_path.name if draft_path else None,
        "baseline_model": baseline,
        "settings": {"prompts": len(prompts), "rounds": rounds, "max_tokens": max_tokens, "temperature": temperature, "tree": tree,
                     "num_draft_tokens": num_draft_tokens, "seed": seed},
        "results": [asdict(r) for r in results],
    }


def markdown_table(res: dict) -> str:
    m = res["machine"]
    lines = [
        f"`{res['model']}` — {res['date']} — {m['cpu']} ({m['cores']} cores), {m['os']}, MLX {m['mlx']} "
        f"({m['device']}), BLAS: {m['blas']}; {res['settings']['prompts']} prompts × "
        f"{res['settings']['max_tokens']} tokens × {res['settings'].get('rounds', 1)} rounds",
        "",
        "| method | temp | tok/s (median) | range | speedup vs ar | τ (tokens/pass) | TTFT ms | peak GB | equals ar | exact match |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in res["results"]:
        eq = "—" if r["matches_ar"] is None else ("yes" if r["matches_ar"] else "NO")
        em = "—" if r["exact_match"] is None else f"{r['exact_match']:.2f}"
        sp = "—" if r["speedup_vs_ar"] is None else f"{r['speedup_vs_ar']:.2f}×"
        lines.append(
            f"| {r['method']} | {r['temperature']:g} | {r['tokens_per_second_median']:.1f} | "
            f"{r['tokens_per_second_min']:.1f}–{r['tokens_per_second_max']:.1f} | {sp} | "
            f"{r['tokens_per_pass']:.2f} | {r['ttft_ms']:.0f} | {r['peak_memory_gb']:.2f} | {eq} | {em} |")
    return "\n".join(lines) + "\n"


def write_chart(res: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rs = res["results"]
    names = [r["method"] for r in rs]
    med = [r["tokens_per_second_median"] for r in rs]
    lo = [r["tokens_per_second_median"] - r["tokens_per_second_min"] for r in rs]
    hi = [r["tokens_per_second_max"] - r["tokens_per_second_median"] for r in rs]
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.bar(names, med, yerr=[lo, hi], capsize=4, color=["#777" if "ss" not in n else "#2a7" for n in names])
    ax.set_ylabel("tokens / s (median, min–max)")
    ax.set_title(f"{res['model']} — {res['machine']['device']}, BLAS {res['machine']['blas'].split(' ')[0]}")
    for i, r in enumerate(rs):
        ax.text(i, med[i], f"τ {r['tokens_per_pass']:.2f}", ha="center", va="bottom", fontsize=8)
    plt.xticks(rotation=20)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
