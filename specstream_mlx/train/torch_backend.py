"""`train --backend torch`: the training loop in PyTorch, one or several processes.

Everything around the loop is the MLX trainer's: the model directory is
loaded and checked by MLX, the streams are initialised (or adopted) there,
batches come from the same bucketed iterator, validation, pruning calibration
and the output directory are MLX's. Only the optimisation runs in PyTorch,
on the ``transformers`` version of the same model, built from the loaded
weights (:func:`hf_model_from_mlx`), with the objective of
:mod:`.torch_objective`. Trained weights are copied back by name.

Several processes (``accelerate launch --num_processes N -m specstream_mlx
train --backend torch ...``) each take every N-th sequence of a batch; their
gradients are averaged (one all-reduce per step) before the identical
optimizer step on every process; only the main process logs, validates and
writes. Run as a plain command it is one process.
"""

from __future__ import annotations

import resource
import sys
import time
from pathlib import Path
from typing import Dict

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from .config import TrainConfig, TrainError

try:
    import torch
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise TrainError(
        "--backend torch needs PyTorch, transformers and accelerate: pip install 'specstream-mlx[torch]'"
    ) from e

from . import torch_objective as tobj
from .loop import after_step, mean_metrics, run_epochs

_DROP_KEYS = ("quantization", "quantization_config", "architectures", "transformers_version", "torch_dtype", "dtype")


def make_accelerator():
    """An ``accelerate.Accelerator`` (multi-process when launched so), or None without accelerate.

    Launched as several processes on a machine without a GPU (``accelerate launch
    --multi_gpu`` or ``torchrun``, which start one process per rank), the processes
    form a CPU group (gloo) instead of each training alone."""
    import os

    try:
        from accelerate import Accelerator
    except ImportError:
        return None
    # Imported before the group forms: this module binds the default group into ten
    # functions' default arguments when it is imported, and transformers imports it while
    # the backend builds its model. Bound there, the group outlives destroy_process_group,
    # and so do gloo's threads, which then abort the process now and then in the
    # interpreter's teardown ("terminate called without an active exception").
    import torch.distributed.nn.functional  # noqa: F401

    world = int(os.environ.get("WORLD_SIZE", "1"))
    no_gpu = not torch.cuda.is_available()
    return Accelerator(cpu=no_gpu and world > 1)


def hf_model_from_mlx(model, config: dict):
    """The ``transformers`` model of ``config`` holding ``model``'s weights (float32, frozen)."""
    import transformers

    from ..io.loading import dequantize_model

    dequantize_model(model)  # a quantized base trains streams on its dequantized weights
    fields = {k: v for k, v in config.items() if k not in _DROP_KEYS}
    try:
        hf_cfg = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
        hf = transformers.AutoModelForCausalLM.from_config(hf_cfg, trust_remote_code=False)
    except (KeyError, ValueError) as e:
        raise TrainError(f"--backend torch: transformers cannot build this model ({e})") from e
    try:
        tobj.check_architecture(hf)
    except ValueError as e:
        raise TrainError(f"--backend torch: {e}") from e
    weights = {k: torch.from_numpy(np.array(v.astype(mx.float32))) for k, v in tree_flatten(model.parameters())}
    missing, unexpected = hf.load_state_dict(weights, strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and hf_cfg.tie_word_embeddings)]
    if missing or unexpected:
        raise TrainError(
            f"--backend torch: weights do not match transformers' {hf_cfg.model_type} ({missing or unexpected})"
        )
    if hf_cfg.tie_word_embeddings:
        hf.tie_weights()
    hf.float().eval()
    for p in hf.parameters():
        p.requires_grad_(False)
    return hf


def _libc_trim():
    """glibc's ``malloc_trim``, or None (another C library, or not Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


_TRIM = _libc_trim()
# Steps between trims: the heap creeps slowly, and a trim costs the next step page faults
# (trimming every step cost ~9% of tokens/s on SmolLM2 here).
TRIM_EVERY = 4


def release_free_memory() -> None:
    """Give the heap's free pages back to the system (glibc). Each step frees activations of
    a different shape (sequences vary in length); glibc keeps blocks of up to 32 MB in its
    heap once large blocks have been freed, so without this the resident size of a long run
    creeps up step after step."""
    if _TRIM is not None:
        _TRIM(0)


def release_base_weights(model) -> int:
    """Drop the MLX copy of a frozen base's weights; returns the bytes released.

    A lossless torch run reads them once, to build the ``transformers`` copy, and never
    again (validation and calibration run in PyTorch, the output directory copies the
    base's files): kept, they are the process's largest block after the torch copy
    (540 MB for SmolLM2 expanded to float32)."""
    params = tree_flatten(model.parameters())
    released = sum(v.nbytes for _, v in params)
    model.update(tree_unflatten([(k, mx.zeros((0,), v.dtype)) for k, v in params]))
    mx.clear_cache()  # MLX keeps freed buffers for reuse; hand them back
    return released


def native_bfloat16(device) -> bool:
    """Whether ``device`` multiplies bfloat16 in hardware (a CUDA GPU that supports it, or
    an x86 CPU with AMX or AVX512-BF16); elsewhere bfloat16 is emulated and slower."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type != "cpu":
        return False
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def torch_trainable(trainable, lora_scale: float) -> tobj.TorchTrainable:
    """The MLX trainable's streams and LoRAs as torch parameters (full-weight ``base.*``
    tensors stay in the HF model)."""
    flat = {k: v for k, v in tree_flatten(trainable.trainable_parameters()) if not k.startswith("base.")}
    return tobj.TorchTrainable(flat, lora_scale)


def _batch_tensors(b, rank: int, world: int, device="cpu") -> Dict[str, torch.Tensor]:
    """This process's rows of a batch: every ``world``-th sequence from ``rank``."""
    rows = slice(rank, None, world)
    arrays = {
        "tokens": b.tokens[rows].astype(np.int64),
        "loss_mask": b.loss_mask[rows].astype(np.float32),
        "spos": b.stream_pos[rows].astype(np.int64),
        "sweight": b.stream_weight[rows].astype(np.float32),
        "lengths": b.lengths[rows].astype(np.int64),
    }
    return {k: torch.from_numpy(v).to(device) for k, v in arrays.items()}


def peak_rss_gb() -> float:
    """This process's peak resident memory (Linux reports KiB, macOS bytes)."""
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r / 1e9 if sys.platform == "darwin" else r * 1024 / 1e9


class TorchRun:
    """The torch counterpart of the MLX trainer's ``_Run`` (same attributes the trainer reads)."""

    def __init__(self, model, trainable, cfg: TrainConfig, data, ckpt, log, bar, config: dict, acc=None):
        self.model, self.trainable, self.cfg, self.data = model, trainable, cfg, data
        self.ckpt, self.log, self.bar, self.acc = ckpt, log, bar, acc
        self.rank = acc.process_index if acc is not None else 0
        self.world = acc.num_processes if acc is not None else 1
        if cfg.batch_size < self.world:
            raise TrainError(f"--batch-size {cfg.batch_size} is smaller than the {self.world} processes")
        torch.manual_seed(cfg.seed)
        self.device = acc.device if acc is not None else torch.device("cpu")
        self.hf = hf_model_from_mlx(model, config).to(self.device)
        if cfg.precision == "auto":
            cfg.precision = "bfloat16" if native_bfloat16(self.device) and not cfg.full else "float32"
            if self.is_main:
                log(f"[train] precision {cfg.precision} (auto)")
        if cfg.precision == "bfloat16":
            self.hf.to(torch.bfloat16)  # frozen: trained tensors live in self.params, float32
        self.base_names = [k for k, _ in tree_flatten(trainable.trainable_parameters()) if k.startswith("base.")]
        if cfg.mode == "lossless" and not self.base_names:
            release_base_weights(model)  # every later pass runs on the torch copy
        self.params = torch_trainable(trainable, cfg.lora_scale)  # full mode: the HF weights train too
        self.params.to(self.device)
        hf_params = dict(self.hf.named_parameters())
        for k in self.base_names:
            hf_params[k[len("base.") :]].requires_grad_(True)
        self.trained = [p for p in list(self.params.parameters()) + list(self.hf.parameters()) if p.requires_grad]
        # The stream embeddings at their own rate (TrainConfig.embedding_lr), as the MLX backend.
        emb = self.params.get("streams.embeddings") if cfg.streams else None
        groups = [{"params": [p for p in self.trained if p is not emb], "lr_scale": 1.0}]
        if emb is not None:
            groups.append({"params": [emb], "lr_scale": cfg.embedding_lr or 1.0})
        self.optimizer = torch.optim.AdamW(groups, lr=cfg.learning_rate, weight_decay=0.0)
        self.schedule = tobj.lr_lambda(data.total_steps, cfg.warmup)
        self.s0 = len(model.layers) - cfg.stream_layers
        self.features = self._feature_cache() if cfg.cached_features else None
        self.history, self.step, self.tokens_seen = [], 0, 0
        self.t_start = time.perf_counter()

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def _feature_cache(self):
        """The training split's feature cache (filled as batches first use it)."""
        from ..settings import current
        from .feature_cache import CacheSpec, FeatureCache

        cfg = self.cfg
        if self.world > 1:
            raise TrainError("--cached-features runs in one process (its cache has one writer)")
        base = self.trainable.streams.config.base_fingerprint or ""
        spec = CacheSpec(base, self.s0, cfg.precision, cfg.teacher_top_k)
        root = Path(cfg.feature_cache) if cfg.feature_cache else current().cache_dir / "features"
        cache = FeatureCache(self.hf, self.data.train.examples, spec, root)
        self.log(f"[train] {cache.describe()}")
        return cache

    # -- weights between the frameworks ---------------------------------------------------
    def sync_to_mlx(self) -> None:
        """Copy the trained weights back into the MLX trainable (and base, in full mode)."""
        flat = [(k, mx.array(v)) for k, v in self.params.to_numpy().items()]
        hf_params = dict(self.hf.named_parameters())
        for k in self.base_names:
            flat.append((k, mx.array(hf_params[k[len("base.") :]].detach().cpu().numpy())))
        self.trainable.update(tree_unflatten(flat))
        mx.eval(self.trainable.parameters())

    def optimizer_arrays(self) -> Dict[str, mx.array]:
        out = {}
        for i, p in enumerate(self.trained):
            for k, v in self.optimizer.state.get(p, {}).items():
                out[f"torch.{i}.{k}"] = mx.array(np.asarray(v.detach().cpu().numpy(), dtype=np.float32))
        return out

    def load_optimizer_arrays(self, arrays: Dict[str, mx.array]) -> None:
        for i, p in enumerate(self.trained):
            state = {}
            for k in ("step", "exp_avg", "exp_avg_sq"):
                a = arrays.get(f"torch.{i}.{k}")
                if a is None:
                    raise TrainError(
                        "the checkpoint's optimizer state is not the torch backend's (train with --backend mlx)"
                    )
                state[k] = torch.from_numpy(np.array(a)).reshape(p.shape if k != "step" else ())
                if k != "step":
                    state[k] = state[k].to(p.device)
            self.optimizer.state[p] = state
        with torch.no_grad():  # the checkpoint's weights, already loaded into the MLX trainable
            flat = dict(tree_flatten(self.trainable.trainable_parameters()))
            for name in self.params.names:
                self.params.get(name).copy_(torch.from_numpy(np.array(flat[name])).to(self.device))
            hf_params = dict(self.hf.named_parameters())
            for k in self.base_names:
                hf_params[k[len("base.") :]].copy_(torch.from_numpy(np.array(flat[k])).to(self.device))

    # -- the loop --------------------------------------------------------------------------
    def _all_reduce_grads(self) -> None:
        if self.world == 1:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.trained]
        flat = self.acc.reduce(torch.cat([g.flatten() for g in grads]), reduction="mean")
        i = 0
        for p, g in zip(self.trained, grads):
            p.grad = flat[i : i + g.numel()].view_as(p).clone()
            i += g.numel()

    def one_step(self, step: int, batch) -> None:
        cfg = self.cfg
        for p in self.trained:
            p.grad = None
        rows = _batch_tensors(batch, self.rank, self.world, self.device)
        if self.features is not None:
            index = batch.index[self.rank :: self.world]
            rows.update(self.features.batch(index, rows["tokens"].shape[1], self.device))
        metrics = tobj.backward_segments(self.hf, self.params, cfg, rows, self.s0)
        if step % TRIM_EVERY == 0:
            release_free_memory()
        self._all_reduce_grads()
        for g in self.optimizer.param_groups:
            g["lr"] = cfg.learning_rate * g["lr_scale"] * self.schedule(step - 1)
        self.optimizer.step()
        after_step(self, step, metrics["loss"], lambda: metrics, int(batch.lengths.sum()))

    def evaluate(self) -> dict:
        """Mean validation metrics over up to ``val_batches`` batches, computed in torch
        (the process may run without the fast BLAS MLX would need)."""
        cfg, d = self.cfg, self.data

        def metrics_of(b) -> dict:
            rows = _batch_tensors(b, 0, 1, self.device)
            return tobj.backward_segments(self.hf, self.params, cfg, rows, self.s0, train=False)

        return mean_metrics(d.valid, cfg, d.seq_len, cfg.val_batches, metrics_of)

    def calibrate(self):
        """The pruning threshold, from torch's early-exit probabilities."""
        from .calibrate import calibrate_pruning

        def top4(tokens: np.ndarray) -> np.ndarray:
            t = torch.from_numpy(tokens.astype(np.int64)).to(self.device)
            return tobj.calibration_positions(self.hf, self.params, t, self.s0).cpu().numpy()

        return calibrate_pruning(self.model, self.trainable.streams, self.data.valid, self.cfg.pruning_keep, top4=top4)

    def save(self, step: int) -> None:
        """A checkpoint after ``step`` completed steps (main process only)."""
        from .checkpoint import save_checkpoint

        if self.is_main:
            self.sync_to_mlx()
            save_checkpoint(self.ckpt, self.trainable, self.optimizer_arrays(), step, self.cfg)

    def loop(self, step: int) -> None:
        try:
            run_epochs(self, step)
            self.sync_to_mlx()
            if self.world > 1:
                self._check_agreement()
        finally:
            # Every rank ends the processes' group after its last collective (the agreement's
            # barrier; the main process's evaluation and writing need none). A rank that exits
            # with gloo's group alive can abort in the interpreter's teardown ("terminate called
            # without an active exception"), failing the launch after a finished run (nothing
            # else may hold the group: see make_accelerator); a rank that fails ends it too, so
            # the others stop at their next collective instead of waiting out its timeout.
            if self.world > 1:
                self.acc.end_training()

    def _check_agreement(self) -> None:
        """Every process must end with the same weights (the gradients were averaged)."""
        total = torch.stack([p.detach().double().sum() for p in self.trained]).sum().reshape(1)
        sums = self.acc.gather(total)
        if float(sums.max() - sums.min()) > 1e-6 * max(1.0, float(sums.abs().max())):
            raise TrainError(f"the {self.world} processes ended with different weights ({sums.tolist()})")
        self.log(f"[train] the {self.world} processes agree on the trained weights")
        self.acc.wait_for_everyone()

    def peak_memory_gb(self) -> float:
        return peak_rss_gb()


def teacher_forced_stream_logits(model, trainable, config: dict, tokens: np.ndarray) -> np.ndarray:
    """(B, L, γ, V) torch stream logits at every position (the parity tests' torch side)."""
    hf = hf_model_from_mlx(model, config)
    params = torch_trainable(trainable, trainable.streams.config.lora_scale)
    lossless = trainable.streams.config.mode == "lossless"
    s0 = trainable.streams.first_layer
    out = tobj.teacher_forced_stream_logits(hf, params, torch.from_numpy(tokens.astype(np.int64)), s0, lossless)
    return out.numpy()


def backend_metrics(model, trainable, cfg: TrainConfig, config: dict, batch) -> Dict[str, object]:
    """One batch's metrics and gradients from the torch objective (the parity tests' torch side)."""
    hf = hf_model_from_mlx(model, config)
    params = torch_trainable(trainable, cfg.lora_scale)
    s0 = len(model.layers) - cfg.stream_layers
    metrics = tobj.backward_segments(hf, params, cfg, _batch_tensors(batch, 0, 1), s0)
    grads = {n: params.get(n).grad.numpy() for n in params.names if params.get(n).grad is not None}
    return {"metrics": metrics, "grads": grads}
