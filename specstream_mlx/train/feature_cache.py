"""Cached frozen features for lossless training (torch backend).

In lossless mode nothing below the first stream layer ever changes, so the hidden state
entering it (``h_s0``) is the same in every epoch, and so is the teacher: the frozen main
stream's next-token distribution at every position. Stored the first time a sequence is
trained on, they leave every later step on it only the top ``N_s`` layers' main rows (no
gradient), the stream rows through them and the head.

What is stored, per position of every training sequence (flat files of fixed-width rows,
read and written at offsets, so a step reads only its batch's rows and the cache may
exceed RAM):

* ``hidden.bin`` — ``h_s0`` in the training precision (bfloat16 as raw 16-bit words, or
  float32): what the uncached main pass computes there, bit for bit in that precision.
* ``teacher_ids.bin`` / ``teacher_logq.bin`` — the teacher's ``k`` most likely tokens and
  their log-probabilities (int32, float32). The KL term is then taken over the kept mass
  (:class:`.torch_objective.Teacher`); ``k`` equal to the vocabulary is the exact objective.

The keys and values of the stream layers' main rows are recomputed from ``h_s0`` at each
step instead of stored: at SmolLM2's shape they would be 2.7x the bytes of ``h_s0`` per
position, and the four frozen layers cost a small part of a step (docs/DESIGN.md).

Filling is lazy and resumable: a batch's sequences without features get one full main
pass (the cost of an uncached step, so a first epoch is not slower than training without
the cache), their rows are flushed to disk, and only then are they marked in
``filled.npy`` (written atomically); a killed run loses at most the rows it had not
marked. The directory's name is a digest of what the features depend on (the base's
fingerprint, the stream layer, precision, k and every sequence's tokens): a changed input
gets a new directory, never stale rows.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from . import torch_objective as tobj
from .config import TrainError

FORMAT = 1


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
    """The features of ``examples`` under ``root/<digest of spec and examples>``; the rows of
    sequence ``i`` are ``offsets[i]:offsets[i + 1]``. Opening creates the (sparse) files
    and reads which sequences are filled; nothing is computed until :meth:`fill`."""

    def __init__(self, hf_model, examples: Sequence, spec: CacheSpec, root: Path):
        self.hf, self.examples, self.spec = hf_model, examples, spec
        self.root = Path(root) / spec.digest(examples)
        self.k = min(spec.top_k, hf_model.lm_head.weight.shape[0])
        self.hidden = hf_model.config.hidden_size
        self.precision = spec.precision
        self.lengths = np.array([len(ex.tokens) for ex in examples], dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(self.lengths)])
        n = max(int(self.offsets[-1]), 1)
        total = n * bytes_per_position(self.hidden, self.k, self.precision)
        self.root.mkdir(parents=True, exist_ok=True)
        meta = dict(format=FORMAT, spec=spec.__dict__, k=self.k, hidden=self.hidden, sequences=len(examples))
        state = self.root / "meta.json"
        fresh = not state.exists() or _read_json(state) != meta
        if fresh:  # a new cache, or one whose files this version cannot vouch for
            free = shutil.disk_usage(self.root).free
            if total > free:
                raise TrainError(
                    f"the feature cache needs {total / 1e9:.2f} GB at {self.root} and {free / 1e9:.2f} GB are "
                    "free (--feature-cache DIR puts it elsewhere; --no-cached-features trains without it)"
                )
            for f in ("filled.npy", *FILES):
                (self.root / f).unlink(missing_ok=True)
            _write_json(state, meta)
        word = 2 if self.precision == "bfloat16" else 4
        for f, width in zip(FILES, (self.hidden * word, self.k * 4, self.k * 4)):
            with open(self.root / f, "ab") as fh:  # sized once (sparse); filled rows are kept
                fh.truncate(n * width)
        self.h = RowFile(self.root / FILES[0], np.uint16 if word == 2 else np.float32, self.hidden)
        self.ids = RowFile(self.root / FILES[1], np.int32, self.k)
        self.logq = RowFile(self.root / FILES[2], np.float32, self.k)
        self.filled = np.zeros(len(examples), dtype=bool)
        try:
            marked = np.load(self.root / "filled.npy")
        except (OSError, ValueError):  # none yet, or unreadable: every row is computed again
            marked = None
        if marked is not None and marked.shape == self.filled.shape and marked.dtype == bool:
            self.filled = marked
        self.total_bytes = total

    def describe(self) -> str:
        done = int(self.lengths[self.filled].sum())
        return (
            f"feature cache {self.root}: {len(self.examples)} sequences, {int(self.offsets[-1]):,} positions, "
            f"{self.total_bytes / 1e9:.2f} GB when full (teacher top-{self.k}), {done:,} positions filled"
        )

    def fill(self, index) -> int:
        """Compute and store the features of the sequences in ``index`` that have none
        (one main pass over them, right-padded: a causal pass leaves the real rows alone);
        returns how many were computed."""
        todo = [int(i) for i in dict.fromkeys(int(i) for i in index) if not self.filled[int(i)]]
        if not todo:
            return 0
        hf, bf16 = self.hf, self.precision == "bfloat16"
        dev = hf.lm_head.weight.device
        width = int(self.lengths[todo].max())
        tokens = torch.zeros(len(todo), width, dtype=torch.long)
        for b, i in enumerate(todo):
            tokens[b, : self.lengths[i]] = torch.as_tensor(self.examples[i].tokens, dtype=torch.long)
        with torch.no_grad(), torch.autocast(dev.type, torch.bfloat16, enabled=bf16):
            main = tobj.main_pass(hf, tobj.TorchTrainable({}, 1.0), tokens.to(dev), self.spec.first_layer)
            for b, i in enumerate(todo):
                lo, n = int(self.offsets[i]), int(self.lengths[i])
                h = main.h_s0[b, :n].cpu()
                if bf16:
                    self.h.write(lo, h.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16))
                else:
                    self.h.write(lo, h.float().numpy())
                ids, logq = teacher_top_k(hf, main.h_final[b, :n], self.k)
                self.ids.write(lo, ids.cpu().numpy())
                self.logq.write(lo, logq.cpu().numpy())
        for a in (self.h, self.ids, self.logq):
            a.sync()
        self.filled[todo] = True  # marked only once the rows are on disk
        tmp = self.root / ".filled.tmp.npy"
        np.save(tmp, self.filled)
        os.replace(tmp, self.root / "filled.npy")
        return len(todo)

    def _hidden(self, rows: np.ndarray) -> torch.Tensor:
        if self.precision == "bfloat16":
            return torch.from_numpy(rows.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(rows)

    def batch(self, index, width: int, device="cpu") -> dict:
        """The features of the sequences ``index`` (filled first where missing) padded to
        ``width`` positions: ``h_s0`` (B, width, hidden) and the teacher over the B·width
        flattened (sequence, position) rows (padding rows keep no mass)."""
        self.fill(index)
        B = len(index)
        dtype = torch.bfloat16 if self.precision == "bfloat16" else torch.float32
        h = torch.zeros(B, width, self.hidden, dtype=dtype)
        ids = torch.zeros(B, width, self.k, dtype=torch.long)
        logq = torch.full((B, width, self.k), -float("inf"))
        for b, i in enumerate(index):
            lo, hi = int(self.offsets[i]), int(self.offsets[i + 1])
            n = min(hi - lo, width)
            h[b, :n] = self._hidden(self.h.read(lo, n))
            ids[b, :n] = torch.from_numpy(self.ids.read(lo, n))
            logq[b, :n] = torch.from_numpy(self.logq.read(lo, n))
        teacher = tobj.Teacher.from_top_logprobs(ids.view(B * width, -1), logq.view(B * width, -1))
        return {"h_s0": h.to(device), "teacher": _to(teacher, device)}


FILES = ("hidden.bin", "teacher_ids.bin", "teacher_logq.bin")


class RowFile:
    """A file of fixed-width rows of one dtype, read and written at offsets (``pread`` /
    ``pwrite``) rather than through a memory map: a map counts every page a run has
    touched in the process's resident set (SmolLM2's 800-step build: 5.96 GB, about 4 GB
    of it the cache's pages), where the kernel's page cache holds them outside it and
    drops them under memory pressure."""

    def __init__(self, path: Path, dtype, width: int):
        self.path, self.dtype, self.width = Path(path), np.dtype(dtype), width
        self.row_bytes = self.dtype.itemsize * width
        self.fd = os.open(self.path, os.O_RDWR)

    def __len__(self) -> int:
        return os.fstat(self.fd).st_size // self.row_bytes

    def write(self, lo: int, rows: np.ndarray) -> None:
        data = memoryview(np.ascontiguousarray(rows, dtype=self.dtype)).cast("B")
        offset = lo * self.row_bytes
        while len(data):  # pwrite may write less than asked
            done = os.pwrite(self.fd, data, offset)
            data, offset = data[done:], offset + done

    def read(self, lo: int, n: int) -> np.ndarray:
        """Rows ``lo:lo + n`` as a new (n, width) array."""
        raw = os.pread(self.fd, n * self.row_bytes, lo * self.row_bytes)
        return np.frombuffer(bytearray(raw), dtype=self.dtype).reshape(-1, self.width)

    def rows(self) -> np.ndarray:
        return self.read(0, len(self))

    def sync(self) -> None:
        """On disk, not only in the page cache: rows are marked filled only after this."""
        os.fsync(self.fd)

    def __del__(self):
        fd = getattr(self, "fd", None)
        if fd is not None:
            os.close(fd)


def _to(t: tobj.Teacher, device) -> tobj.Teacher:
    return tobj.Teacher(t.probs.to(device), t.neg_entropy.to(device), t.ids.to(device), t.mass.to(device))


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


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
            ids.append(torch.arange(lp.shape[-1]).expand(lp.shape[0], -1))
            logq.append(lp)
        else:
            v, i = lp.topk(k, dim=-1)
            ids.append(i)
            logq.append(v)
    return torch.cat(ids).to(torch.int32), torch.cat(logq)
