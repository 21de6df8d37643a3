"""`eval-bfcl`: task accuracy and decoding speed of a model on BFCL's test split.

Every item is decoded greedily by each requested mode, in alternating order (ar first on
even items, ss first on odd ones) so that a drift in machine speed falls on both. Greedy
speculative decoding must reproduce plain decoding token for token; a difference is
counted and reported (it would be a defect). Accuracy is :mod:`.ast_check`'s rule on the
first mode's reply; τ and tokens/s count decoding passes only, the prefill apart.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

from .ast_check import check_calls
from .tool_calls import parse_tool_calls


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
    mismatches: int = 0  # items where greedy ss and ar replies differ (must be 0)
    seconds: float = 0.0

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
            "seconds": self.seconds,
            "items": [asdict(r) for r in self.items],
        }


def read_test_rows(path: Path, limit: Optional[int] = None) -> List[dict]:
    """The rows of a prepared ``test.jsonl`` (``prepare-bfcl``), the target turn dropped."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                r = json.loads(line)
                msgs = r["messages"]
                if msgs and msgs[-1]["role"] == "assistant":
                    msgs = msgs[:-1]
                rows.append(dict(r, messages=msgs))
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{n}: not a prepare-bfcl row ({e})") from None
            if limit and len(rows) >= limit:
                break
    return rows


def bfcl_test_rows(limit: Optional[int] = None) -> List[dict]:
    """The test split straight from the installed bfcl-eval package (no prepared directory)."""
    from .bfcl import chat_row, read_bfcl, split_of

    rows = [chat_row(it, with_target=False) for it in read_bfcl().items if split_of(it.id) == "test"]
    return rows[:limit] if limit else rows


def _account(t: ModeTotals, stats) -> None:
    passes = max(stats.forward_passes - 1, 0)
    t.decoding_passes += passes
    t.decoded_tokens += round(stats.tokens_per_pass * passes)
    t.decoding_seconds += stats.generation_seconds
    t.prompt_tokens += stats.prompt_tokens
    t.prefill_seconds += stats.prompt_seconds


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
    from ..runtime.generation import generate

    report = EvalReport(name, list(modes), tree, totals={m: ModeTotals() for m in modes})
    t0 = time.perf_counter()
    for i, row in enumerate(rows):
        order = list(modes) if i % 2 == 0 else list(reversed(modes))
        texts, tokens = {}, {}
        for mode in order:
            kw = {"tree": tree} if mode == "ss" and tree else {}
            res = generate(model, tokenizer, row["messages"], max_tokens=max_tokens, mode=mode, **kw)
            texts[mode], tokens[mode] = res.text, res.tokens
            _account(report.totals[mode], res.stats)
        if "ar" in tokens and "ss" in tokens and tokens["ar"] != tokens["ss"]:
            report.mismatches += 1
        reply = texts[modes[0]]
        names = [t["name"] for t in row["tools"]]
        calls = parse_tool_calls(reply, names)
        verdict = check_calls(calls, row["ground_truth"], row["tools"], row["category"])
        report.items.append(
            ItemResult(
                row["id"],
                row["category"],
                verdict.valid,
                verdict.error,
                reply,
                [c.to_json() for c in calls] if calls else None,
            )
        )
        if progress:
            progress(i + 1, len(rows), report)
    report.seconds = time.perf_counter() - t0
    return report


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
    return "\n".join(lines)
