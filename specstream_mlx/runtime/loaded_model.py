"""A loaded model and everything decoding keeps about it.

:class:`SpeculativeModel` is what :func:`load` returns: the base model, its
speculative streams, the directory it came from, and the ``--tree auto``
tuners that learn across requests. Calling it runs the base model, so it can
be used wherever a plain MLX language model is expected. (A server keeps each
client's own policy over these: :mod:`specstream_mlx.serve.client_policies`.)
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn

from ..io.adapters import fuse_adapter_into
from ..io.loading import ModelLoadError, load_model_dir
from ..method.streams import StreamParams
from ..models.base import ModelArgs
from ..models.fusion import fuse_projections
from ..settings import current as current_settings
from .attention_choice import choose_attention, set_attention_form
from .autotune import AutoPolicy, auto_policy_for
from .compiled_pass import SSPass
from .sampling import SamplingParams
from .stored_rows import limit_stored_rows
from .stored_weights import register as register_stored


@dataclass
class SpeculativeModel:
    """A base model with (optionally) its speculative streams.

    Attributes:
        base: the causal LM (main stream); its logits never depend on the streams.
        streams: stream embeddings, stream LoRA and pruning adapter; None for a plain model.
        path: the model directory, when loaded from one.
        tuners: ``--tree auto`` policies per decoding kind ("greedy", "sampled"):
            greedy and sampled passes draft different trees and cost differently.
        compiled: run speculative passes as compiled graphs where possible
            (:mod:`.compiled_pass`); default from :mod:`specstream_mlx.settings`
            (``SPECSTREAM_COMPILE=1``; op by op otherwise).
    """

    base: nn.Module
    streams: Optional[StreamParams] = None
    path: Optional[Path] = None
    tuners: Dict[str, AutoPolicy] = field(default_factory=dict)
    compiled: bool = field(default_factory=lambda: current_settings().compile_passes)
    _passes: Dict[bool, SSPass] = field(default_factory=dict, repr=False)

    def __call__(self, *args, **kwargs):
        return self.base(*args, **kwargs)

    @property
    def args(self) -> ModelArgs:
        return self.base.args

    @property
    def layers(self):
        return self.base.layers

    def ss_pass(self, compiled: Optional[bool] = None) -> SSPass:
        """The speculative pass of this model and its streams, compiled or op by op
        (default: as ``self.compiled`` says). Kept here, so compiled graphs are traced
        once per shape for the life of the model."""
        compiled = bool(self.compiled if compiled is None else compiled)
        p = self._passes.get(compiled)
        if p is None or p.streams is not self.streams:
            p = self._passes[compiled] = SSPass(self.base, self.streams, compiled)
        return p

    def tuner(self, sampling: SamplingParams, log: Optional[Callable[[str], None]] = None) -> AutoPolicy:
        """The shared ``--tree auto`` policy for this decoding kind, created on first use
        (with the costs stored for this model here, if any)."""
        kind = "greedy" if sampling.greedy else "sampled"
        if kind not in self.tuners:
            self.tuners[kind] = auto_policy_for(self.base, self.streams, kind == "sampled", bool(self.compiled), log)
        return self.tuners[kind]


def as_speculative(model: Any, streams: Optional[StreamParams] = None) -> SpeculativeModel:
    """``model`` as a :class:`SpeculativeModel` (a bare base model is wrapped);
    ``streams``, when given, replaces the model's own."""
    if isinstance(model, SpeculativeModel):
        if streams is None or streams is model.streams:
            return model
        return SpeculativeModel(model.base, streams, model.path, compiled=model.compiled)
    return SpeculativeModel(model, streams)


def base_model(model: Any) -> nn.Module:
    """The base causal LM of a :class:`SpeculativeModel` or of a bare model."""
    return model.base if isinstance(model, SpeculativeModel) else model


def load(
    path_or_name: str,
    dtype="auto",
    lazy: bool = False,
    warn: bool = True,
    adapter_path: Optional[str] = None,
    fuse: Optional[bool] = None,
    attention: Optional[str] = None,
) -> Tuple[SpeculativeModel, Any]:
    """Load ``(model, tokenizer)`` from a directory, bundled name or hub id.

    Args:
        path_or_name: a model directory, a bundled model name (``demo-chat``,
            ``demo-sql``) or a Hugging Face hub id of an MLX model.
        dtype: "auto" (float32 on the CPU backend, the stored dtype elsewhere),
            None (stored) or an mlx dtype.
        lazy: leave parameters unevaluated.
        warn: warn on stderr when the streams are untrained.
        adapter_path: a PEFT or mlx-lm LoRA adapter directory to fuse into the base.
        fuse: concatenate each layer's q/k/v and gate/up weights, so a decode step runs
            four matrix products per layer instead of seven (:mod:`~specstream_mlx.models.fusion`;
            the same logits to rounding). False keeps the stored layout; None (default):
            fused unless ``SPECSTREAM_FUSE=0`` (:mod:`specstream_mlx.settings`).
        attention: ``fused`` (MLX's kernel), ``composed`` (the same arithmetic composed of
            products) or ``auto``, the form measured faster on this machine for the model's
            heads (:mod:`.attention_choice`); None (default): ``SPECSTREAM_ATTENTION``, else auto.

    Returns:
        A :class:`SpeculativeModel` (``model.streams`` is None for a model
        without streams) and mlx-lm's tokenizer wrapper.
    """
    if warn:
        from ..platform_info import warn_if_reference_blas

        warn_if_reference_blas()
    # The weights are built lazily and evaluated once, fused: each fused weight is computed
    # (a 4-bit one expanded on the CPU backend) straight into its place. Expanded first and
    # fused after, every q/k/v and gate/up weight was written twice and the process touched
    # ~150 MB more fresh memory; SmolLM2 on a 2-core Xeon loaded in 2.0-5.6 s against
    # 0.8-0.9 s so, at 0.78 against 0.93-0.95 GB peak, its decode steps unchanged.
    lm = load_model_dir(path_or_name, dtype=dtype, lazy=True, warn=warn)
    if adapter_path is not None:
        try:
            fuse_adapter_into(lm.model, Path(adapter_path))
        except (ValueError, OSError) as e:
            raise ModelLoadError(str(e)) from e
    if fuse is None:
        fuse = current_settings().fuse_projections
    if fuse:
        fuse_projections(lm.model, evaluate=False)
    if not lazy:
        mx.eval(lm.model.parameters())
        draft_head = lm.streams.draft_head if lm.streams is not None else None
        register_stored(lm.model, extra=[draft_head] if draft_head is not None else [])
        limit_stored_rows(lm.model, log=lambda msg: print(f"specstream-mlx: {lm.path.name}: {msg}", file=sys.stderr))
    set_attention_form(lm.model, choose_attention(lm.model, attention))
    return SpeculativeModel(lm.model, lm.streams, lm.path), lm.tokenizer
