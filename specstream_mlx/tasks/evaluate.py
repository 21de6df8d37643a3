"""`eval-bfcl`: task accuracy and decoding speed of a model on BFCL's test split.

Every item is decoded greedily by each requested mode, in alternating order (ar first on
even items, ss first on odd ones) so that a drift in machine speed falls on both. Greedy
speculative decoding must reproduce plain decoding token for token; a difference is
counted and reported (it would be a defect). Accuracy is :mod:`.ast_check`'s rule on the
first mode's reply; τ and tokens/s count decoding passes only, the prefill apart.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

from ..io.jsonl import read_jsonl
from .ast_check import check_calls
from .tool_calls import may_be_call, parse_tool_calls


@dataclass
class ModeTotals:
    """One decoding mode over the whole run."""

    decoded_tokens: int = 0  # tokens decided by decoding passes (prefill's first token left out)
    decoding_passes: int = 0
    decoding_seconds: float = 0.0
    prompt_tokens: int = 0
    prefill_seconds: float = 0.0

    @property
    def tau(self) -> float:
        return self.decoded_tokens / self.decoding_passes if self.decoding_passes else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.decoded_tokens / self.decoding_seconds if self.decoding_seconds else 0.0

    def to_json(self) -> dict:
        return dict(asdict(self), tau=self.tau, tokens_per_second=self.tokens_per_second)


@dataclass
class ItemResult:
    id: str
    category: str
    correct: bool
    error: str
    reply: str
    calls: Optional[List[dict]]


@dataclass
class EvalReport:
    model: str
    modes: List[str]
    tree: Optional[str]
    items: List[ItemResult] = field(default_factory=list)
    totals: Dict[str, ModeTotals] = field(default_factory=dict)
    mismatches: int = 0  # items where greedy ss and ar replies differ
    # ... of which part at a tie of the two best logits within float32 rounding (runtime.ties):
    # the rounding's choice, not the chain's; any other mismatch is a defect.
    mismatch_ties: int = 0
    cut: int = 0  # replies stopped at a first character that no call starts with
    seconds: float = 0.0
    extra_parameters: int = 0  # the streams' parameters (the fine-tune itself is fused)

    @property
    def accuracy(self) -> float:
        return sum(r.correct for r in self.items) / len(self.items) if self.items else 0.0

    def by_category(self) -> Dict[str, tuple]:
        out: Dict[str, list] = {}
        for r in self.items:
            c = out.setdefault(r.category, [0, 0])
            c[0] += r.correct
            c[1] += 1
        return {k: (v[0], v[1]) for k, v in sorted(out.items())}

    def speedup(self) -> Optional[float]:
        if "ar" in self.totals and "ss" in self.totals and self.totals["ar"].tokens_per_second:
            return self.totals["ss"].tokens_per_second / self.totals["ar"].tokens_per_second
        return None

    def to_json(self) -> dict:
        return {
            "model": self.model,
            "modes": self.modes,
            "tree": self.tree,
            "n": len(self.items),
            "accuracy": self.accuracy,
            "by_category": {k: {"correct": a, "n": n} for k, (a, n) in self.by_category().items()},
            "totals": {k: v.to_json() for k, v in self.totals.items()},
            "speedup": self.speedup(),
            "ss_ar_mismatches": self.mismatches,
            "ss_ar_mismatches_at_ties": self.mismatch_ties,
            "cut_replies": self.cut,
            "extra_parameters": self.extra_parameters,
            "seconds": self.seconds,
            "items": [asdict(r) for r in self.items],
        }


def read_test_rows(path: Path) -> List[dict]:
    """The rows of a prepared ``test.jsonl`` (``prepare-bfcl``), the target turn dropped."""
    rows = []
    for n, r in read_jsonl(path):
        try:
            msgs = r["messages"]
            if msgs and msgs[-1]["role"] == "assistant":
                msgs = msgs[:-1]
            rows.append(dict(r, messages=msgs))
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}:{n}: not a prepare-bfcl row ({e})") from None
    return rows


def bfcl_test_rows() -> List[dict]:
    """The test split straight from the installed bfcl-eval package (no prepared directory)."""
    from .bfcl import chat_row, read_bfcl, split_of

    return [chat_row(it, with_target=False) for it in read_bfcl().items if split_of(it.id) == "test"]


def _account(t: ModeTotals, stats) -> None:
    passes = max(stats.forward_passes - 1, 0)
    t.decoding_passes += passes
    t.decoded_tokens += round(stats.tokens_per_pass * passes)
    t.decoding_seconds += stats.generation_seconds
    t.prompt_tokens += stats.prompt_tokens
    t.prefill_seconds += stats.prompt_seconds


def decode_reply(model, tokenizer, messages, mode: str, tree, max_tokens: int):
    """(text, tokens, stats) of one greedy reply, stopped as soon as it cannot be a call."""
    from ..runtime.generation import stream_generate

    kw = {"tree": tree} if mode == "ss" and tree else {}
    text, tokens, stats, cut = "", [], None, False
    gen = stream_generate(model, tokenizer, messages, max_tokens=max_tokens, mode=mode, **kw)
    for r in gen:
        text += r.text
        tokens += r.tokens
        stats = r.stats
        if r.finish_reason is None and not may_be_call(text):
            cut = True
            gen.close()
            break
    return text, tokens, stats, cut


def evaluate(
    model,
    tokenizer,
    rows: Sequence[dict],
    modes: Sequence[str] = ("ar", "ss"),
    tree: Optional[str] = None,
    max_tokens: int = 256,
    name: str = "",
    progress: Optional[Callable[[int, int, "EvalReport"], None]] = None,
) -> EvalReport:
    """Decode every row in every mode and check the first mode's reply. A reply whose first
    visible character shows it is prose is cut there (it fails either way); such replies
    are counted in ``cut``."""
    report = EvalReport(name, list(modes), tree, totals={m: ModeTotals() for m in modes})
    t0 = time.perf_counter()
    for i, row in enumerate(rows):
        order = list(modes) if i % 2 == 0 else list(reversed(modes))
        texts, tokens, cut = {}, {}, False
        for mode in order:
            texts[mode], tokens[mode], stats, cut = decode_reply(
                model, tokenizer, row["messages"], mode, tree, max_tokens
            )
            _account(report.totals[mode], stats)
        report.cut += cut
        if "ar" in tokens and "ss" in tokens and tokens["ar"] != tokens["ss"]:
            report.mismatches += 1
            report.mismatch_ties += _parts_at_a_tie(model, tokenizer, row["messages"], tokens["ar"], tokens["ss"])
        reply = texts[modes[0]]
        calls = parse_tool_calls(reply, [t["name"] for t in row["tools"]])
        verdict = check_calls(calls, row["ground_truth"], row["tools"], row["category"])
        calls_json = [c.to_json() for c in calls] if calls else None
        report.items.append(ItemResult(row["id"], row["category"], verdict.valid, verdict.error, reply, calls_json))
        if progress:
            progress(i + 1, len(rows), report)
    report.seconds = time.perf_counter() - t0
    return report


def _parts_at_a_tie(model, tokenizer, messages, ar: Sequence[int], ss: Sequence[int]) -> bool:
    """Whether greedy replies ``ar`` and ``ss`` to ``messages`` part at a tie within float32
    rounding (:func:`~specstream_mlx.runtime.ties.parts_at_a_tie`)."""
    from ..runtime import ties
    from ..runtime.generation import encode_prompt

    return ties.parts_at_a_tie(model, encode_prompt(tokenizer, messages), ar, ss)


def _mismatch_cell(r: "EvalReport") -> str:
    return f"{r.mismatches} ({r.mismatch_ties} at ties)" if r.mismatch_ties else str(r.mismatches)


def spread(rows: Sequence[dict], n: Optional[int]) -> List[dict]:
    """``n`` rows evenly spaced over ``rows`` (every category represented), or all of them."""
    if not n or n >= len(rows):
        return list(rows)
    return [rows[(k * len(rows)) // n] for k in range(n)]


def format_table(reports: Sequence[EvalReport]) -> str:
    """One Markdown row per model: accuracy, τ, decoding rates, speedup, extra parameters."""
    head = "| model | accuracy | τ (ss) | ar tok/s | ss tok/s | ss / ar | extra parameters | ss ≠ ar |"
    lines = [head, "|" + "---|" * 8]
    for r in reports:
        ar, ss = r.totals.get("ar"), r.totals.get("ss")
        cells = [
            r.model,
            f"{r.accuracy:.1%} ({sum(x.correct for x in r.items)}/{len(r.items)})",
            f"{ss.tau:.2f}" if ss else "–",
            f"{ar.tokens_per_second:.1f}" if ar else "–",
            f"{ss.tokens_per_second:.1f}" if ss else "–",
            f"{r.speedup():.2f}x" if r.speedup() else "–",
            f"{r.extra_parameters:,}",
            _mismatch_cell(r) if ss and ar else "–",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_report(r: EvalReport) -> str:
    lines = [f"model {r.model}: {len(r.items)} test items, accuracy {r.accuracy:.1%} (BFCL AST rule)"]
    for cat, (a, n) in r.by_category().items():
        lines.append(f"  {cat:24s} {a:4d}/{n:<4d} {a / n:6.1%}")
    for m, t in r.totals.items():
        lines.append(
            f"  [{m}] decoding {t.tokens_per_second:6.1f} tok/s, τ {t.tau:.2f} tokens/pass "
            f"({t.decoded_tokens} tokens, {t.decoding_passes} passes); prefill {t.prompt_tokens:,} tokens in "
            f"{t.prefill_seconds:.1f} s"
        )
    if r.speedup() is not None:
        lines.append(f"  ss / ar decoding speed: {r.speedup():.2f}x" + (f" (tree {r.tree})" if r.tree else ""))
    if "ss" in r.totals and "ar" in r.totals:
        lines.append(f"  greedy ss replies that differ from ar: {r.mismatches}")
        if r.mismatch_ties:
            lines.append(
                f"    {r.mismatch_ties} of them part where the two best logits are tied within float32 rounding"
                " (which is larger depends on the order of the additions: a pass's rows or a step's row)"
            )
    if r.cut:
        lines.append(f"  replies stopped at a first character no call starts with: {r.cut}")
    return "\n".join(lines)
