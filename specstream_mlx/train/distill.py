"""``specstream-mlx distill``: the model's own replies as training data.

Lossless streams are judged by how often they predict what *this* model will
say, so they train best on the model's own replies (self-distillation data)
rather than on human text. This module reads prompts in any format ``train``
reads (plus ``{"prompt": ...}`` alone), generates the base model's replies in
batches with mlx-lm's batched generation (the base of a model directory is an
mlx-lm model) or, with ``backend="torch"``, with its PyTorch copy, and writes a
data directory ``train`` reads, replacing any existing completions; in a
conversation every assistant turn is regenerated, turn by turn, so the context of
each reply is the model's own. It is resumable: replies already written are kept
and their prompts skipped.

Real prompt sets are long and uneven (ShareGPT: median 730 tokens), so the
valid split is written first (``train`` needs it), the test split only when
asked, prompts are capped in number and length, batches are formed from
length-sorted prompts (a batch pads to its longest prompt), replies caught in a
repetition loop are cut after the loop's first round, and a time budget stops
cleanly between batches.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional

import mlx.core as mx

from ..io.limits import outside_vocabulary
from ..io.loading import (
    cast_floating,
    compute_dtype_for_device,
    dequantize_model,
    dequantize_on_cpu,
    resolve_model_path,
)
from ..io.prompts import PromptRow, read_prompt_rows
from .data import DataError

SPLITS = ("train", "valid", "test")
DEFAULT_SPLITS = ("valid", "train")  # valid first: a run stopped during train still has it


@dataclass
class DistillOptions:
    """How replies are generated.

    Args:
        max_tokens: most tokens per reply. Default 256.
        temperature: 0 for greedy replies. Default 0.
        top_p: nucleus mass when sampling. Default 1.
        samples_per_prompt: replies per prompt (sampled ones differ). Default 1.
        batch_size: prompts generated together. Default 8.
        seed: sampling seed. Default 0.
        max_prompts: at most this many prompts per split (the first ones). Default all.
        max_prompt_tokens: prompts longer than this (rendered) are skipped, counted. Default: the context.
        splits: which splits, in this order. Default valid then train (test only when asked).
        time_budget: seconds; stop between batches once spent (run again to continue). Default none.
        cut_loops: cut a reply caught in a repetition loop after the loop's first round. Default True.
        backend: ``mlx`` (mlx-lm's batched generation) or ``torch`` (the model's PyTorch copy,
            several times faster on a CPU; needs the ``torch`` extra). Default mlx.
    """

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    samples_per_prompt: int = 1
    batch_size: int = 8
    seed: int = 0
    max_prompts: Optional[int] = None
    max_prompt_tokens: Optional[int] = None
    splits: tuple = DEFAULT_SPLITS
    time_budget: Optional[float] = None
    cut_loops: bool = True
    backend: str = "mlx"

    def check(self) -> None:
        if self.max_tokens < 1 or self.samples_per_prompt < 1 or self.batch_size < 1:
            raise ValueError("--max-tokens, --samples-per-prompt and --batch-size must be at least 1")
        if not self.temperature >= 0 or not 0 < self.top_p <= 1:
            raise ValueError("--temp must be >= 0 and --top-p in (0, 1]")
        for name, v in (("--max-prompts", self.max_prompts), ("--max-prompt-tokens", self.max_prompt_tokens)):
            if v is not None and v < 1:
                raise ValueError(f"{name} must be at least 1, got {v}")
        if self.time_budget is not None and not self.time_budget > 0:
            raise ValueError(f"--time-budget must be positive, got {self.time_budget}")
        if self.backend not in ("mlx", "torch"):
            raise ValueError(f"--backend must be mlx or torch, got {self.backend}")
        bad = [x for x in self.splits if x not in SPLITS]
        if bad or not self.splits or len(set(self.splits)) < len(self.splits):
            raise ValueError(f"--splits must name some of {', '.join(SPLITS)} once each, got {','.join(self.splits)}")


@dataclass
class SplitStats:
    """What one split's run did (printed, and returned by :func:`distill`)."""

    written: int = 0
    skipped_long: int = 0
    cut_loops: int = 0
    tokens: int = 0
    seconds: float = 0.0
    stopped: bool = False  # the time budget ran out in this split
    limit: int = 0  # longest prompt answered, in tokens
    notes: List[str] = field(default_factory=list)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


def find_loop(tokens: List[int], max_period: int = 32, min_repeats: int = 3, min_span: int = 16):
    """A reply's repetition loop as (start, period), or None: its tail repeats one period
    p (≤ ``max_period``) at least ``min_repeats`` times over ≥ ``min_span`` tokens — the
    "Cloud Computing, Cloud Computing, …" a small model falls into at temperature 0.
    ``start`` is the loop's first token (the earliest start of a periodic tail)."""
    n = len(tokens)
    best = None
    for p in range(1, max_period + 1):
        if n < max(min_repeats * p, min_span):
            break
        i = n - 1
        while i - p >= 0 and tokens[i] == tokens[i - p]:
            i -= 1
        start = i - p + 1  # tokens[start:] is periodic with period p
        if n - start >= max(min_repeats * p, min_span) and (best is None or start < best[0]):
            best = (start, p)
    return best


def loop_start(tokens: List[int], **kw) -> Optional[int]:
    """Where a reply's repetition loop starts (see :func:`find_loop`), or None."""
    loop = find_loop(tokens, **kw)
    return None if loop is None else loop[0]


def read_prompts(path: Path, splits=SPLITS) -> Dict[str, List[PromptRow]]:
    """Prompts per split: a directory's train/valid/test.jsonl, or one file as the train
    split; only the files of ``splits`` are read."""
    path = Path(path)
    files = {s: path / f"{s}.jsonl" for s in SPLITS if (path / f"{s}.jsonl").exists()} if path.is_dir() else {}
    if path.is_file():
        files = {"train": path}
    if not files:
        raise DataError(f"{path}: no prompts (a .jsonl file, or a directory with train.jsonl)")
    return {split: read_prompt_rows(f) for split, f in files.items() if split in splits}


def _encode(tokenizer, messages: List[Dict[str, str]]) -> List[int]:
    # The same rendering as generation (chat template when the tokenizer has one).
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return list(tokenizer.encode(text, add_special_tokens=False))
    return list(tokenizer.encode("\n".join(m["content"] for m in messages)))


def _done_lines(f: Path) -> int:
    """Complete lines already in ``f``; a partial last line (a killed run) is cut off."""
    if not f.exists():
        return 0
    data = f.read_bytes()
    end = data.rfind(b"\n") + 1
    if end < len(data):
        with open(f, "r+b") as fh:
            fh.truncate(end)
    return data[:end].count(b"\n")


def _plan(row: PromptRow) -> "tuple[list, list]":
    """(leading messages kept as they are, e.g. a system prompt; the user turns in order).

    Every assistant turn of a conversation is the model's own: earlier ones are dropped
    here and regenerated turn by turn, each answering the conversation so far."""
    msgs = row.messages
    first_user = next(i for i, m in enumerate(msgs) if m.get("role") == "user")
    users = [m for m in msgs[first_user:] if m.get("role") == "user"]
    return [dict(m) for m in msgs[:first_user]], [dict(m) for m in users]


def _record(row: PromptRow, conversation: List[Dict[str, str]]) -> dict:
    if row.as_prompt:
        return {"prompt": row.messages[-1]["content"], "completion": conversation[-1]["content"]}
    return {"messages": conversation}


def _cut_loop(tokenizer, text: str, stats: SplitStats, cut: bool) -> str:
    """``text`` (a reply) without the repeats of a repetition loop, counting tokens and cuts."""
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    stats.tokens += len(ids)
    loop = find_loop(ids) if cut else None
    if loop is None:
        return text
    start, period = loop
    stats.cut_loops += 1
    return tokenizer.decode(ids[: start + period])


def _answer_batch(replies, tokenizer, rows: List[PromptRow], opts: "DistillOptions", stats) -> List[list]:
    """One conversation per row and sample, every assistant turn generated by the model."""
    plans = [_plan(r) for r in rows for _ in range(opts.samples_per_prompt)]
    convs = [list(head) for head, _ in plans]
    for turn in range(max(len(users) for _, users in plans)):
        active = [k for k, (_, users) in enumerate(plans) if turn < len(users)]
        for k in active:
            convs[k].append(plans[k][1][turn])
        texts = replies([_encode(tokenizer, convs[k]) for k in active])
        for k, text in zip(active, texts):
            convs[k].append({"role": "assistant", "content": _cut_loop(tokenizer, text, stats, opts.cut_loops)})
    return convs


class MlxReplies:
    """``replies(prompts) -> texts`` with mlx-lm's batched generation."""

    def __init__(self, model, tokenizer, opts: "DistillOptions"):
        from mlx_lm.sample_utils import make_sampler

        self.model, self.tokenizer, self.max_tokens = model, tokenizer, opts.max_tokens
        self.sampler = make_sampler(opts.temperature, opts.top_p)

    def seed(self, seed: int) -> None:
        mx.random.seed(seed)

    def __call__(self, prompts: List[List[int]]) -> List[str]:
        from mlx_lm.generate import batch_generate

        res = batch_generate(self.model, self.tokenizer, prompts, max_tokens=self.max_tokens, sampler=self.sampler)
        return res.texts


def _replies(model, tokenizer, config: dict, opts: "DistillOptions"):
    if opts.backend == "torch":
        from .torch_generate import TorchReplies

        return TorchReplies(model, config, tokenizer, opts.max_tokens, opts.temperature, opts.top_p)
    return MlxReplies(model, tokenizer, opts)


def distill(
    model_path: str,
    prompts: str,
    out_dir: str,
    opts: DistillOptions,
    log: Callable[[str], None] = print,
    progress: bool = True,
) -> Dict[str, int]:
    """Write the model's replies to ``prompts`` into ``out_dir``; returns records per split
    (finished ones; fewer when the time budget ran out)."""
    import mlx_lm

    opts.check()
    given, into = Path(prompts).expanduser().resolve(), Path(out_dir).expanduser().resolve()
    if into == given or (given.is_file() and into == given.parent):
        # Its train/valid.jsonl would be taken for replies already written (a run resumes):
        # the run "finished" at once, or added the model's replies to the prompts themselves.
        raise DataError(f"{out_dir}: is where the prompts are; write the replies to another folder")
    found = read_prompts(Path(prompts), opts.splits)
    splits = {s: found[s] for s in opts.splits if s in found}
    if not splits:
        raise DataError(f"{prompts}: none of the splits {', '.join(opts.splits)}")
    path = resolve_model_path(model_path)
    model, tokenizer = mlx_lm.load(str(path))
    if dequantize_on_cpu():  # the weights and dtype decoding runs on: its own greedy replies
        dequantize_model(model)
    dtype = compute_dtype_for_device()
    if dtype is not None:
        cast_floating(model, dtype)
    config = json.loads((path / "config.json").read_text())
    context = _context(config)
    limit = context - opts.max_tokens
    if limit <= 0:
        raise DataError(
            f"--max-tokens {opts.max_tokens} leaves no room for a prompt in the model's context of {context} tokens"
        )
    vocab_size = config.get("vocab_size")
    # Every split's prompts encoded and checked before anything is written.
    chosen = {}
    for split, rows in splits.items():
        stats = SplitStats()
        chosen[split] = (_selected(rows, tokenizer, limit, opts, stats, vocab_size, f"{prompts} ({split})"), stats)
    replies = _replies(model, tokenizer, config, opts)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    counts, t0 = {}, time.perf_counter()
    for split, (rows, stats) in chosen.items():
        counts[split] = _distill_split(
            replies, tokenizer, rows, out / f"{split}.jsonl", split, opts, stats, t0, log, progress
        )
        log(_summary(split, stats))
        if stats.stopped:
            log(f"[distill] time budget of {opts.time_budget:g} s spent; run again to continue")
            break
    return counts


def _distill_split(replies, tokenizer, rows, f: Path, split, opts, stats: SplitStats, t0, log, progress) -> int:
    start = _done_lines(f) // opts.samples_per_prompt
    stats.written = start * opts.samples_per_prompt
    if start:
        log(f"[distill] {split}: {start} prompts already done, resuming")
    bar = _bar(len(rows), start, split, progress)
    replies.seed(opts.seed + start)  # resumed runs do not repeat the same draws
    t_split = time.perf_counter()
    with open(f, "a", encoding="utf-8") as fh:
        for i in range(start, len(rows), opts.batch_size):
            if opts.time_budget is not None and time.perf_counter() - t0 >= opts.time_budget:
                stats.stopped = True
                break
            batch = rows[i : i + opts.batch_size]
            for k, conv in enumerate(_answer_batch(replies, tokenizer, batch, opts, stats)):
                fh.write(json.dumps(_record(batch[k // opts.samples_per_prompt], conv), ensure_ascii=False))
                fh.write("\n")
                stats.written += 1
            fh.flush()  # a killed run keeps every finished batch
            stats.seconds = time.perf_counter() - t_split
            if bar:
                bar.set_postfix_str(f"{stats.tokens_per_second:.1f} tok/s", refresh=False)
                bar.update(len(batch))
    if bar:
        bar.close()
    return stats.written


def _summary(split: str, st: SplitStats) -> str:
    parts = [f"[distill] {split}: {st.written} replies"]
    if st.seconds:
        parts.append(f"{st.tokens} tokens generated in {st.seconds:.0f} s ({st.tokens_per_second:.1f} tok/s)")
    if st.skipped_long:
        parts.append(f"{st.skipped_long} prompts longer than {st.limit} tokens skipped")
    if st.cut_loops:
        parts.append(f"{st.cut_loops} replies cut at a repetition loop")
    return ", ".join(parts)


def _selected(
    rows: List[PromptRow],
    tokenizer,
    limit: int,
    opts: DistillOptions,
    stats: SplitStats,
    vocab_size: Optional[int],
    where: str,
):
    """The prompts to answer, in the order they are generated: those that fit (counted),
    the first ``max_prompts`` of them, sorted by length so a batch pads little.
    Deterministic, so a resumed run skips the same rows. A prompt with a token id outside
    the model's vocabulary (a tokenizer not the model's) is a DataError naming ``where``."""
    if opts.max_prompt_tokens is not None:
        limit = min(limit, opts.max_prompt_tokens)
    stats.limit = limit
    # A conversation's last prompt, rendered with its original turns: the longest one answered.
    sized = []
    for r in rows:
        ids = _encode(tokenizer, r.messages)
        why = outside_vocabulary(ids, vocab_size) if isinstance(vocab_size, int) else None
        if why:
            raise DataError(f"{where}: {why}")
        sized.append((len(ids), r))
    keep = [(n, r) for n, r in sized if n <= limit]
    stats.skipped_long = len(sized) - len(keep)
    keep = keep[: opts.max_prompts]
    return [r for _, r in sorted(keep, key=lambda nr: nr[0])]


def _context(config: dict) -> int:
    """The model's context window (positions), or a large number when config.json names none."""
    n = config.get("max_position_embeddings")
    return n if isinstance(n, int) and n > 0 else 1 << 30


def _bar(total: int, initial: int, split: str, progress: bool) -> Optional[object]:
    if not progress:
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc=f"distill {split}", unit="prompt", file=sys.stderr)
