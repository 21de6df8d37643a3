"""Training settings and results."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional

from ..io.limits import SEED_MAX


class TrainError(RuntimeError):
    pass


@dataclass
class TrainConfig:
    """Training settings; defaults follow the paper where it gives them.

    Args:
        mode: "lossless" (frozen base) or "shared" (LoRA shared by main and streams).
        num_streams: γ. Default 4.
        stream_layers: N_s. Default 4.
        lora_rank: LoRA rank. Default 32.
        iters / epochs: length of training (iters wins; default 1 epoch).
        batch_size: sequences per step. Default 8.
        max_seq_len: longer sequences are truncated (and counted). Default 512.
        learning_rate: peak learning rate, decayed linearly to 0. Default 5e-4.
        alpha_main / alpha_stream: α0 and αj. Defaults 1.0 and 0.1 (α0 = 0 in lossless).
        distill: lossless only: add KL to the frozen main distribution at t+j. Default True.
        stream_positions: completion positions per sequence that host streams. Default 64.
        segment: stream positions per segment of the stream pass. Default 32.
        backend: "mlx", or "torch" to optimise in PyTorch on the transformers model
            (several processes under ``accelerate launch``).
        stream_embedding_rms: draw fresh stream embeddings with this RMS relative to the
            RMS of the hidden state they are added to (measured on the train split at the
            stream layer); None: 1.0 in shared mode, the fixed 0.02 draw in lossless mode
            (docs/DESIGN.md decision 27).
        embedding_lr: the stream embeddings' learning rate as a multiple of
            ``learning_rate``; None: the hidden state's RMS where they were drawn at its
            scale (Adam's steps are about ``lr`` in absolute size, so this is the rate of
            ``RMS · P'`` with ``P'`` at unit scale), else 1.
        isolate_streams: shared mode: the stream losses train only what the stream rows
            compute with (their embeddings, the stream layers' shared LoRA as applied to
            them), not the main pass they read (its hidden state and keys/values are held
            fixed for them); the main loss alone trains the main rows.
        pruning_keep: calibrate the early-exit pruning threshold on the valid split so that
            this share of would-be-accepted children survives (0: keep ``pruning_threshold``).
        cached_features: lossless, torch backend: compute the frozen features (the hidden
            state entering the stream layers and the teacher's top ``teacher_top_k``
            tokens) once per sequence and train on them (train/feature_cache.py).
        feature_cache: where cached features live (default: the user cache's ``features/``).
    """

    mode: str = "lossless"
    num_streams: int = 4
    stream_layers: int = 4
    lora_rank: int = 32
    lora_scale: float = 2.0
    lora_targets: Optional[List[str]] = None
    iters: Optional[int] = None
    epochs: Optional[float] = None
    batch_size: int = 8
    max_seq_len: int = 512
    learning_rate: float = 5e-4
    warmup: int = 0
    alpha_main: float = 1.0
    alpha_stream: float = 0.1
    distill: bool = True
    distill_weight: float = 1.0
    stream_positions: int = 64
    stream_embedding_rms: Optional[float] = None
    embedding_lr: Optional[float] = None
    segment: int = 32
    # "float32", "bfloat16" (torch backend, frozen base: the frozen weights are held in
    # bfloat16 and the matmuls run in it; trained weights and softmaxes stay float32), or
    # "auto": bfloat16 where the torch device multiplies it natively, float32 elsewhere.
    precision: str = "float32"
    # Rows of a vocabulary-wide loss computed at once (torch backend): bounds (rows × V) tensors.
    loss_chunk: int = 64
    seed: int = 0
    steps_per_report: int = 10
    steps_per_eval: int = 200
    save_every: int = 100
    val_batches: int = 8
    pruning_threshold: float = 0.0
    # Calibrate the pruning threshold on the valid split at the end (see train/calibrate.py):
    # keep this share of the children greedy verification would accept; 0 leaves the threshold as set.
    pruning_keep: float = 0.98
    isolate_streams: bool = False
    compile: bool = True
    # Shared mode only: train every base weight (from-scratch demo models) instead of a LoRA.
    full: bool = False
    # False: a next-token-only baseline (no streams, no stream losses, no stream files).
    streams: bool = True
    # Start from fresh streams even when the model already has some.
    new_streams: bool = False
    # Allow the output directory to be the model's own.
    force: bool = False
    # "mlx" or "torch" (PyTorch + transformers, see train/torch_backend.py).
    backend: str = "mlx"
    cached_features: bool = False
    teacher_top_k: int = 64
    feature_cache: Optional[str] = None

    def __post_init__(self):
        # Counts and rates no run could use, refused before anything loads: a batch of 0 or
        # a checkpoint every 0 steps had ended in a division by zero, a 1-token sequence in a
        # crash inside MLX, a negative learning rate or stream count had trained on.
        least = {
            "num_streams": 1,
            "stream_layers": 1,
            "lora_rank": 0,
            "batch_size": 1,
            "max_seq_len": 2,
            "warmup": 0,
            "stream_positions": 1,
            "steps_per_report": 1,
            "steps_per_eval": 1,
            "save_every": 1,
            "val_batches": 1,
        }
        if self.iters is not None:
            least["iters"] = 1
        for name, low in least.items():
            if getattr(self, name) < low:
                raise ValueError(f"{name} must be >= {low}, got {getattr(self, name)}")
        # A sequence of max_seq_len tokens has at most max_seq_len - 1 positions to host
        # streams; more are padding rows through the stream layers and the head (1,000,000
        # had run the machine out of memory on a 3-token sequence).
        self.stream_positions = min(self.stream_positions, self.max_seq_len - 1)
        from ..method.streams import MAX_STREAMS

        if self.num_streams > MAX_STREAMS:
            raise ValueError(f"num_streams must be <= {MAX_STREAMS}, got {self.num_streams}")
        for name in ("learning_rate", "epochs"):
            value = getattr(self, name)
            if value is not None and not 0 < value < math.inf:
                raise ValueError(f"{name} must be a finite number > 0, got {value}")
        for name in ("alpha_main", "alpha_stream", "distill_weight", "lora_scale"):
            if not 0 <= getattr(self, name) < math.inf:
                raise ValueError(f"{name} must be a finite number >= 0, got {getattr(self, name)}")
        if not 0 <= self.seed <= SEED_MAX:  # MLX's, numpy's and PyTorch's generators all take these
            raise ValueError(f"seed must be an integer from 0 to {SEED_MAX}, got {self.seed}")
        if not 0 <= self.pruning_keep <= 1:
            raise ValueError(f"pruning_keep must be in [0, 1] (0: keep the threshold), got {self.pruning_keep}")
        if self.mode not in ("lossless", "shared"):
            raise ValueError(f"mode must be lossless or shared, got {self.mode!r}")
        if self.full and self.mode != "shared":
            raise ValueError("full training of the base is only meaningful in shared mode")
        if self.isolate_streams and self.mode != "shared":
            raise ValueError("--isolate-streams is for shared mode (in lossless mode the main pass is frozen)")
        if self.precision not in ("float32", "bfloat16", "auto"):
            raise ValueError(f"precision must be float32, bfloat16 or auto, got {self.precision!r}")
        if self.precision == "bfloat16" and (self.backend != "torch" or self.full):
            raise ValueError("--precision bfloat16 needs --backend torch and a frozen base (not --full)")
        if self.stream_embedding_rms is not None and not self.stream_embedding_rms > 0:
            raise ValueError(f"stream_embedding_rms must be > 0, got {self.stream_embedding_rms}")
        if self.embedding_lr is not None and not self.embedding_lr > 0:
            raise ValueError(f"embedding_lr must be > 0, got {self.embedding_lr}")
        if self.loss_chunk < 1:
            raise ValueError(f"loss_chunk must be >= 1, got {self.loss_chunk}")
        if self.segment < 1:
            raise ValueError(f"segment must be >= 1, got {self.segment}")
        if self.backend not in ("mlx", "torch"):
            raise ValueError(f"backend must be mlx or torch, got {self.backend!r}")
        if self.cached_features and (self.backend != "torch" or self.mode != "lossless"):
            raise ValueError("--cached-features needs --backend torch and lossless mode (a frozen base)")
        if self.teacher_top_k < 1:
            raise ValueError(f"teacher_top_k must be >= 1, got {self.teacher_top_k}")
        if not self.streams and self.mode != "shared":
            raise ValueError("a no-streams baseline trains the base: use shared mode")


@dataclass
class TrainResult:
    out_dir: Path
    steps: int
    interrupted: bool = False
    history: List[dict] = field(default_factory=list)
    val: Optional[dict] = None
    tokens_per_second: float = 0.0
    peak_memory_gb: float = 0.0
    trainable_parameters: int = 0
    # False in the processes of a multi-process run that do not write.
    written: bool = False
