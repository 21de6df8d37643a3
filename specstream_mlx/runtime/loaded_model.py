"""A loaded model and everything decoding keeps about it.

:class:`SpeculativeModel` is what :func:`load` returns: the base model, its
speculative streams, the directory it came from, and the ``--tree auto``
tuners that learn across requests. Calling it runs the base model, so it can
be used wherever a plain MLX language model is expected.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Tuple

import mlx.nn as nn

from ..io.adapters import fuse_adapter_into
from ..io.loading import ModelLoadError, load_model_dir
from ..method.streams import StreamParams
from ..models.base import ModelArgs
from ..settings import current as current_settings
from .autotune import AutoPolicy, auto_policy_for
from .compiled_pass import SSPass
from .sampling import SamplingParams

MAX_CLIENT_TUNERS = 64


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
    # Per (kind, client): a tuner sharing its kind's machine facts, with its own acceptance
    # evidence and back-off (one client's prompts must not switch another to plain decoding).
    client_tuners: "OrderedDict[tuple, AutoPolicy]" = field(default_factory=OrderedDict, repr=False)
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

    def tuner(
        self, sampling: SamplingParams, log: Optional[Callable[[str], None]] = None, client: Any = None
    ) -> AutoPolicy:
        """The ``--tree auto`` policy for this decoding kind, created on first use (with the
        costs stored for this model here, if any); with ``client``, that client's own
        policy over the same machine facts."""
        kind = "greedy" if sampling.greedy else "sampled"
        if kind not in self.tuners:
            self.tuners[kind] = auto_policy_for(self.base, self.streams, kind == "sampled", bool(self.compiled), log)
        if client is None:
            return self.tuners[kind]
        key = (kind, client)
        t = self.client_tuners.get(key)
        if t is None:
            t = self.client_tuners[key] = self.tuners[kind].for_client()
            while len(self.client_tuners) > MAX_CLIENT_TUNERS:
                self.client_tuners.popitem(last=False)  # the least recently served client
        self.client_tuners.move_to_end(key)
        return t


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
    path_or_name: str, dtype="auto", lazy: bool = False, warn: bool = True, adapter_path: Optional[str] = None
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

    Returns:
        A :class:`SpeculativeModel` (``model.streams`` is None for a model
        without streams) and mlx-lm's tokenizer wrapper.
    """
    if warn:
        from ..platform_info import warn_if_reference_blas

        warn_if_reference_blas()
    lm = load_model_dir(path_or_name, dtype=dtype, lazy=lazy, warn=warn)
    if adapter_path is not None:
        try:
            fuse_adapter_into(lm.model, Path(adapter_path))
        except (ValueError, OSError) as e:
            raise ModelLoadError(str(e)) from e
    return SpeculativeModel(lm.model, lm.streams, lm.path), lm.tokenizer
