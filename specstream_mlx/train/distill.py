"""``specstream-mlx distill``: the model's own replies as training data.

Lossless streams are judged by how often they predict what *this* model will
say, so they train best on the model's own replies (self-distillation data)
rather than on human text. This module reads prompts in any format ``train``
reads (plus ``{"prompt": ...}`` alone), generates the base model's replies in
batches with mlx-lm's batched generation (the base of a model directory is an
mlx-lm model), and writes a data directory ``train`` reads, replacing any
existing completions. It is resumable: replies already written are kept and
their prompts skipped.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional

import mlx.core as mx

from ..io.loading import cast_floating, compute_dtype_for_device, resolve_model_path
from ..io.prompts import PromptRow, read_prompt_rows
from .data import DataError

SPLITS = ("train", "valid", "test")


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
    """

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    samples_per_prompt: int = 1
    batch_size: int = 8
    seed: int = 0

    def check(self) -> None:
        if self.max_tokens < 1 or self.samples_per_prompt < 1 or self.batch_size < 1:
            raise ValueError("--max-tokens, --samples-per-prompt and --batch-size must be at least 1")
        if not self.temperature >= 0 or not 0 < self.top_p <= 1:
            raise ValueError("--temp must be >= 0 and --top-p in (0, 1]")


def read_prompts(path: Path) -> Dict[str, List[PromptRow]]:
    """Prompts per split: a directory's train/valid/test.jsonl, or one file as the train split."""
    path = Path(path)
    files = {s: path / f"{s}.jsonl" for s in SPLITS if (path / f"{s}.jsonl").exists()} if path.is_dir() else {}
    if path.is_file():
        files = {"train": path}
    if not files:
        raise DataError(f"{path}: no prompts (a .jsonl file, or a directory with train.jsonl)")
    return {split: read_prompt_rows(f) for split, f in files.items()}


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


def _record(row: PromptRow, reply: str) -> dict:
    if row.as_prompt:
        return {"prompt": row.messages[-1]["content"], "completion": reply}
    return {"messages": row.messages + [{"role": "assistant", "content": reply}]}


def distill(
    model_path: str,
    prompts: str,
    out_dir: str,
    opts: DistillOptions,
    log: Callable[[str], None] = print,
    progress: bool = True,
) -> Dict[str, int]:
    """Write the model's replies to ``prompts`` into ``out_dir``; returns records per split."""
    import mlx_lm
    from mlx_lm.generate import batch_generate
    from mlx_lm.sample_utils import make_sampler

    opts.check()
    splits = read_prompts(Path(prompts))
    path = resolve_model_path(model_path)
    model, tokenizer = mlx_lm.load(str(path))
    dtype = compute_dtype_for_device()
    if dtype is not None:
        cast_floating(model, dtype)
    sampler = make_sampler(opts.temperature, opts.top_p)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    counts = {}
    for split, rows in splits.items():
        f = out / f"{split}.jsonl"
        start = _done_lines(f) // opts.samples_per_prompt
        if start:
            log(f"[distill] {split}: {start} prompts already done, resuming")
        bar = _bar(len(rows), start, split, progress)
        mx.random.seed(opts.seed + start)  # resumed runs do not repeat the same draws
        with open(f, "a", encoding="utf-8") as fh:
            for i in range(start, len(rows), opts.batch_size):
                batch = rows[i : i + opts.batch_size]
                ids = [_encode(tokenizer, r.messages) for r in batch for _ in range(opts.samples_per_prompt)]
                res = batch_generate(model, tokenizer, ids, max_tokens=opts.max_tokens, sampler=sampler)
                for k, text in enumerate(res.texts):
                    fh.write(json.dumps(_record(batch[k // opts.samples_per_prompt], text), ensure_ascii=False))
                    fh.write("\n")
                fh.flush()  # a killed run keeps every finished batch
                if bar:
                    bar.update(len(batch))
        if bar:
            bar.close()
        counts[split] = len(rows) * opts.samples_per_prompt
    return counts


def _bar(total: int, initial: int, split: str, progress: bool) -> Optional[object]:
    if not progress:
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc=f"distill {split}", unit="prompt", file=sys.stderr)
