"""Cached frozen features for lossless training (torch backend).

In lossless mode nothing below the first stream layer ever changes, so the hidden state
entering it (``h_s0``) is the same in every epoch, and so is the teacher: the frozen main
stream's next-token distribution at every position. Computing them once per sequence
leaves a training step only the top ``N_s`` layers' main rows (no gradient), the stream
rows through them and the head.

What is stored, per position of every training sequence (memory-mapped files, so a step
reads only its batch's rows and the cache may exceed RAM):

* ``hidden.bin`` — ``h_s0`` in the training precision (bfloat16 as raw 16-bit words, or
  float32): what the uncached main pass computes there, bit for bit in that precision.
* ``teacher_ids.bin`` / ``teacher_logq.bin`` — the teacher's ``k`` most likely tokens and
  their log-probabilities (int32, float32). The KL term is then taken over the kept mass
  (:class:`.torch_objective.Teacher`); ``k`` equal to the vocabulary is the exact objective.

The keys and values of the stream layers' main rows are recomputed from ``h_s0`` at each
step instead of stored: at SmolLM2's shape they would be 2.7x the bytes of ``h_s0`` per
position, and the four frozen layers cost a small part of a step (docs/DESIGN.md).

The build is resumable: sequences are computed in length-sorted batches, each batch's rows
flushed to disk before ``progress.json`` records it (written atomically), so a killed build
continues at the first batch it had not recorded. The directory's name is a digest of what
the features depend on (the base's fingerprint, the stream layer, precision, k and every
sequence's tokens): a changed input gets a new directory, never stale rows.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from . import torch_objective as tobj
from .config import TrainError

FORMAT = 1
BUILD_BATCH = 8  # sequences per main pass while building (length-sorted: little padding)


@dataclass(frozen=True)
class CacheSpec:
    """What cached features depend on; its digest names the directory."""

    base: str  # the frozen base's fingerprint
    first_layer: int  # s0: the features enter this layer
    precision: str  # "bfloat16" or "float32"
    top_k: int  # teacher tokens kept per position (>= the vocabulary: all of them)

    def digest(self, examples: Sequence) -> str:
        h = hashlib.sha256(json.dumps([FORMAT, self.base, self.first_layer, self.precision, self.top_k]).encode())
        for ex in examples:
            h.update(np.asarray(ex.tokens, dtype=np.int32).tobytes())
            h.update(b"|")
        return h.hexdigest()[:20]


def bytes_per_position(hidden: int, k: int, precision: str) -> int:
    return hidden * (2 if precision == "bfloat16" else 4) + k * 8


class FeatureCache:
    """An opened cache: the rows of sequence ``i`` are ``offsets[i]:offsets[i + 1]``."""

    def __init__(self, root: Path, offsets: np.ndarray, hidden: int, k: int, precision: str, mode: str = "r"):
        self.root, self.offsets, self.hidden, self.k, self.precision = root, offsets, hidden, k, precision
        n = int(offsets[-1])
        word = np.uint16 if precision == "bfloat16" else np.float32
        self.h = np.memmap(root / "hidden.bin", dtype=word, mode=mode, shape=(max(n, 1), hidden))
        self.ids = np.memmap(root / "teacher_ids.bin", dtype=np.int32, mode=mode, shape=(max(n, 1), k))
        self.logq = np.memmap(root / "teacher_logq.bin", dtype=np.float32, mode=mode, shape=(max(n, 1), k))

    @property
    def size_bytes(self) -> int:
        return sum((self.root / f).stat().st_size for f in ("hidden.bin", "teacher_ids.bin", "teacher_logq.bin"))

    def _hidden(self, rows: np.ndarray) -> torch.Tensor:
        if self.precision == "bfloat16":
            return torch.from_numpy(rows.view(np.int16).copy()).view(torch.bfloat16)
        return torch.from_numpy(np.array(rows))

    def batch(self, index: np.ndarray, width: int, device="cpu") -> dict:
        """The features of the sequences ``index`` padded to ``width`` positions: ``h_s0``
        (B, width, hidden) and the teacher over the B·width flattened (sequence, position)
        rows (padding rows keep no mass)."""
        B = len(index)
        dtype = torch.bfloat16 if self.precision == "bfloat16" else torch.float32
        h = torch.zeros(B, width, self.hidden, dtype=dtype)
        ids = torch.zeros(B, width, self.k, dtype=torch.long)
        logq = torch.full((B, width, self.k), -float("inf"))
        for b, i in enumerate(index):
            lo, hi = int(self.offsets[i]), int(self.offsets[i + 1])
            n = min(hi - lo, width)
            h[b, :n] = self._hidden(self.h[lo : lo + n])
            ids[b, :n] = torch.from_numpy(np.array(self.ids[lo : lo + n]))
            logq[b, :n] = torch.from_numpy(np.array(self.logq[lo : lo + n]))
        teacher = tobj.Teacher.from_top_logprobs(ids.view(B * width, -1), logq.view(B * width, -1))
        return {"h_s0": h.to(device), "teacher": _to(teacher, device)}


def _to(t: tobj.Teacher, device) -> tobj.Teacher:
    return tobj.Teacher(t.probs.to(device), t.neg_entropy.to(device), t.ids.to(device), t.mass.to(device))


def _write_json(path: Path, obj) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


def teacher_top_k(hf_model, h_final: torch.Tensor, k: int, chunk: int = 128):
    """(ids, log-probabilities) of the ``k`` most likely next tokens at each row of
    ``h_final`` (N, hidden), vocabulary-wide tensors for ``chunk`` rows at a time."""
    ids, logq = [], []
    for s in range(0, h_final.shape[0], chunk):
        lp = torch.log_softmax(tobj.lm_logits(hf_model, h_final[s : s + chunk]).float(), dim=-1)
        if k >= lp.shape[-1]:
            i = torch.arange(lp.shape[-1]).expand(lp.shape[0], -1)
            ids.append(i)
            logq.append(lp)
        else:
            v, i = lp.topk(k, dim=-1)
            ids.append(i)
            logq.append(v)
    return torch.cat(ids).to(torch.int32), torch.cat(logq)


def open_or_build(
    hf_model,
    examples: Sequence,
    spec: CacheSpec,
    root: Path,
    log: Callable[[str], None] = print,
    progress: bool = True,
    on_batch: Optional[Callable[[int], None]] = None,
) -> FeatureCache:
    """The cache of ``examples`` under ``root/<digest>``: opened if complete, else built
    (continuing a partial build). ``on_batch(i)`` is called after batch ``i`` is recorded."""
    root = Path(root) / spec.digest(examples)
    vocab = hf_model.lm_head.weight.shape[0]
    k = min(spec.top_k, vocab)
    hidden = hf_model.config.hidden_size
    lengths = np.array([len(ex.tokens) for ex in examples], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    meta = dict(format=FORMAT, spec=spec.__dict__, k=k, hidden=hidden, sequences=len(examples))
    order = np.argsort(lengths, kind="stable")
    batches = [order[i : i + BUILD_BATCH] for i in range(0, len(order), BUILD_BATCH)]
    state = root / "progress.json"
    done = 0
    if state.exists():
        try:
            got = json.loads(state.read_text())
            done = int(got["batches_done"]) if got.get("meta") == meta else 0
        except (ValueError, KeyError, TypeError):
            done = 0
    total_bytes = int(offsets[-1]) * bytes_per_position(hidden, k, spec.precision)
    if done >= len(batches):
        cache = FeatureCache(root, offsets, hidden, k, spec.precision)
        log(f"[train] feature cache: {len(examples)} sequences, {cache.size_bytes / 1e9:.2f} GB at {root}")
        return cache
    root.mkdir(parents=True, exist_ok=True)
    # The files are sized sparse at the start and fill as batches are written: what a
    # resumed build still needs is the share of the batches it has not done.
    needed = total_bytes * (len(batches) - done) // len(batches)
    free = shutil.disk_usage(root).free
    if needed > free:
        raise TrainError(
            f"the feature cache needs {needed / 1e9:.2f} GB more at {root} and {free / 1e9:.2f} GB are free "
            "(--feature-cache DIR puts it elsewhere; --no-cached-features trains without it)"
        )
    if done == 0:
        for f in ("hidden.bin", "teacher_ids.bin", "teacher_logq.bin"):
            (root / f).unlink(missing_ok=True)
        _write_json(state, dict(meta=meta, batches_done=0))
    word = 2 if spec.precision == "bfloat16" else 4
    for f, width in (("hidden.bin", hidden * word), ("teacher_ids.bin", k * 4), ("teacher_logq.bin", k * 4)):
        with open(root / f, "ab") as fh:  # sized once; a resumed build keeps what it had
            fh.truncate(max(int(offsets[-1]), 1) * width)
    cache = FeatureCache(root, offsets, hidden, k, spec.precision, mode="r+")
    what = "continuing" if done else "building"
    log(
        f"[train] {what} the feature cache: {len(examples)} sequences, {int(offsets[-1]):,} positions, "
        f"{total_bytes / 1e9:.2f} GB at {root} (teacher top-{k})"
    )
    bar = None
    if progress:
        import sys

        from tqdm import tqdm

        bar = tqdm(total=len(batches), initial=done, desc="features", unit="batch", dynamic_ncols=True, file=sys.stderr)
    dev = hf_model.lm_head.weight.device
    bf16 = spec.precision == "bfloat16"
    params = tobj.TorchTrainable({}, 1.0)
    try:
        for bi in range(done, len(batches)):
            idx = batches[bi]
            width = int(lengths[idx].max())
            tokens = torch.zeros(len(idx), width, dtype=torch.long)
            for b, i in enumerate(idx):
                tokens[b, : lengths[i]] = torch.as_tensor(examples[i].tokens, dtype=torch.long)
            with torch.no_grad(), torch.autocast(dev.type, torch.bfloat16, enabled=bf16):
                main = tobj.main_pass(hf_model, params, tokens.to(dev), spec.first_layer)
                for b, i in enumerate(idx):  # right padding leaves a causal pass's real rows alone
                    lo, n = int(offsets[i]), int(lengths[i])
                    h = main.h_s0[b, :n].cpu()
                    if bf16:
                        cache.h[lo : lo + n] = h.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
                    else:
                        cache.h[lo : lo + n] = h.float().numpy()
                    ids, logq = teacher_top_k(hf_model, main.h_final[b, :n], k)
                    cache.ids[lo : lo + n] = ids.cpu().numpy()
                    cache.logq[lo : lo + n] = logq.cpu().numpy()
            for a in (cache.h, cache.ids, cache.logq):
                a.flush()
            _write_json(state, dict(meta=meta, batches_done=bi + 1))
            if bar:
                bar.update(1)
            if on_batch:
                on_batch(bi)
    finally:
        if bar:
            bar.close()
    log(f"[train] feature cache complete: {cache.size_bytes / 1e9:.2f} GB")
    return FeatureCache(root, offsets, hidden, k, spec.precision)
