"""Speculative-stream parameters and their files (docs/FORMAT.md).

A model with streams is an mlx-lm model directory plus:

* ``specstream.json``: :class:`StreamConfig` (version, num_streams,
  stream_layers, mode, lora, pruning, trained).
* ``streams.safetensors``: ``embeddings`` (γ, h); ``lora.layer<i>.<proj>.a``
  (in, r) and ``.b`` (r, out) for the MSA layers; ``pruning.down`` (h, 8) and
  ``pruning.up`` (8, h); optionally ``draft_vocab`` (N,) int32, the token ids the
  streams draft from.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Dict, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from ..models.fusion import fused_part, linear_dims

FORMAT_VERSION = 1
# The most speculative streams a model may carry: each drafts one position further, and
# acceptance falls with depth (the method's paper uses a handful; trees here go 4 deep);
# every stream costs a row per position in training (1,000 had run it out of memory).
MAX_STREAMS = 32
CONFIG_FILE = "specstream.json"
WEIGHTS_FILE = "streams.safetensors"
# The draft vocabulary's token ids in WEIGHTS_FILE (not a parameter: never trained).
DRAFT_VOCAB_KEY = "draft_vocab"

ATTN_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
PHI3_TARGETS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


class NoStreamsError(RuntimeError):
    pass


@dataclass
class StreamConfig:
    """How a model's speculative streams are shaped.

    Args:
        num_streams: γ, the number of speculative streams. Default 4.
        stream_layers: N_s, the top layers that run multi-stream attention. Default 4.
        mode: "lossless" (stream-only LoRA, frozen base) or "shared" (LoRA fused into the base).
        lora_rank: rank of the stream LoRA in the MSA layers; 0 for none. Default 32.
        lora_scale: multiplier of the LoRA delta. Default 2.0 (alpha 64 / rank 32).
        lora_targets: projections carrying stream LoRA.
        pruning_rank: rank of the early-exit adapter. Default 8.
        pruning_threshold: drop draft nodes whose early-exit transition
            probability is below this; 0 disables pruning. Default 0.
        trained: False for freshly initialised streams.
        base_fingerprint: fingerprint of the base weights the streams were trained on
            (``specstream_mlx.io.fingerprint``); None for streams that name no base.
        draft_vocab: how many vocabulary entries the streams draft from (the ids, most
            frequent first, are ``draft_vocab`` in the weights file); 0: all of them.
    """

    num_streams: int = 4
    stream_layers: int = 4
    mode: str = "lossless"
    lora_rank: int = 32
    lora_scale: float = 2.0
    lora_targets: Tuple[str, ...] = ATTN_TARGETS + MLP_TARGETS
    pruning_rank: int = 8
    pruning_threshold: float = 0.0
    trained: bool = False
    base_fingerprint: Optional[str] = None
    draft_vocab: int = 0
    version: int = FORMAT_VERSION
    extra: Dict = field(default_factory=dict)

    def to_json(self) -> dict:
        d = asdict(self)
        d["lora"] = {"rank": d.pop("lora_rank"), "scale": d.pop("lora_scale"), "targets": list(d.pop("lora_targets"))}
        d["pruning"] = {"rank": d.pop("pruning_rank"), "threshold": d.pop("pruning_threshold")}
        return d

    @staticmethod
    def from_json(d: dict) -> "StreamConfig":
        if not isinstance(d, dict):
            raise ValueError(f"must be a JSON object, got {type(d).__name__}")
        d = dict(d)
        lora = d.pop("lora", {}) or {}
        pruning = d.pop("pruning", {}) or {}
        if not isinstance(lora, dict) or not isinstance(pruning, dict):
            raise ValueError("'lora' and 'pruning' must be objects")
        version = d.get("version", FORMAT_VERSION)
        if not _is_int(version):
            raise ValueError(f"'version' must be an integer, got {version!r}")
        if version > FORMAT_VERSION:
            raise ValueError(f"{CONFIG_FILE} version {version} is newer than this runtime supports ({FORMAT_VERSION})")
        known = {f for f in StreamConfig.__dataclass_fields__}
        cfg = StreamConfig(**{k: v for k, v in d.items() if k in known})
        cfg.lora_rank = lora.get("rank", cfg.lora_rank)
        cfg.lora_scale = lora.get("scale", cfg.lora_scale)
        targets = lora.get("targets", cfg.lora_targets)
        if not isinstance(targets, (list, tuple)):
            raise ValueError(f"'lora.targets' must be a list, got {targets!r}")
        cfg.lora_targets = tuple(targets)
        cfg.pruning_rank = pruning.get("rank", cfg.pruning_rank)
        cfg.pruning_threshold = pruning.get("threshold", cfg.pruning_threshold)
        cfg.check()
        return cfg

    def check(self) -> None:
        """ValueError naming the first field with a wrong type or value."""
        if not (_is_int(self.draft_vocab) and self.draft_vocab >= 0):
            raise ValueError(f"'draft_vocab' must be a non-negative integer, got {self.draft_vocab!r}")
        for name in ("num_streams", "stream_layers", "pruning_rank"):
            v = getattr(self, name)
            if not (_is_int(v) and v >= 1):
                raise ValueError(f"'{name}' must be a positive integer, got {v!r}")
        if not (_is_int(self.lora_rank) and self.lora_rank >= 0):
            raise ValueError(f"'lora.rank' must be a non-negative integer, got {self.lora_rank!r}")
        if self.mode not in ("lossless", "shared"):
            raise ValueError(f"'mode' must be lossless or shared, got {self.mode!r}")
        for name, v in (("lora.scale", self.lora_scale), ("pruning.threshold", self.pruning_threshold)):
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ValueError(f"'{name}' must be a number, got {v!r}")
        if not 0 <= self.pruning_threshold <= 1:
            raise ValueError(f"'pruning.threshold' must be in [0, 1], got {self.pruning_threshold!r}")
        if not all(isinstance(t, str) for t in self.lora_targets):
            raise ValueError(f"'lora.targets' must be projection names, got {list(self.lora_targets)!r}")
        if self.base_fingerprint is not None and not isinstance(self.base_fingerprint, str):
            raise ValueError(f"'base_fingerprint' must be a string, got {self.base_fingerprint!r}")
        if not isinstance(self.trained, bool):
            raise ValueError(f"'trained' must be true or false, got {self.trained!r}")


class LoRA(nn.Module):
    """Low-rank delta ``scale * (x @ a) @ b``; ``b`` starts at zero."""

    def __init__(self, in_dims: int, out_dims: int, rank: int, scale: float):
        super().__init__()
        bound = 1.0 / math.sqrt(in_dims)
        self.a = mx.random.uniform(-bound, bound, (in_dims, rank))
        self.b = mx.zeros((rank, out_dims))
        self.scale = scale

    def low_rank(self, x: mx.array) -> mx.array:
        """``(x @ a) @ b``, the delta before its scale."""
        return (x @ self.a) @ self.b

    def __call__(self, x: mx.array) -> mx.array:
        return self.scale * self.low_rank(x)


class PruningAdapter(nn.Module):
    """o_θ(M) = M + up(down(M)), rank 8: early-exit hidden state for tree pruning.

    Untrained (``up == 0``) it is the identity, so early-exit logits are the
    LM head applied to the stream-insertion layer's input (a logit lens)."""

    def __init__(self, hidden: int, rank: int):
        super().__init__()
        self.down = mx.random.normal((hidden, rank)) * (1.0 / math.sqrt(hidden))
        self.up = mx.zeros((rank, hidden))

    def __call__(self, h: mx.array) -> mx.array:
        return h + (h @ self.down) @ self.up


def lora_key(layer_index: int) -> str:
    # Not a bare number: mlx's tree_unflatten would turn numeric keys into a list.
    return f"layer{layer_index}"


def find_linear(layer, name: str):
    """The projection ``name`` of a block, or its :class:`FusedPart` where decoding fused it
    with others at load (streams loaded onto such a model get the part's shape)."""
    for parent in (layer.self_attn, layer.mlp):
        if name in parent:
            return parent[name]
        part = fused_part(parent, name)
        if part is not None:
            return part
    return None


def make_layer_loras(model, layer_indices, targets, rank: int, scale: float) -> Dict[str, Dict[str, "LoRA"]]:
    """A LoRA for every targeted projection of the given layers, keyed by :func:`lora_key`."""
    out: Dict[str, Dict[str, LoRA]] = {}
    for i in layer_indices:
        mods = {}
        for name in targets:
            lin = find_linear(model.layers[i], name)
            if lin is not None:
                d_in, d_out = linear_dims(lin)
                mods[name] = LoRA(d_in, d_out, rank, scale)
        out[lora_key(i)] = mods
    return out


@lru_cache(maxsize=None)
def _masked_delta(scale: float):
    # y + scale·t on stream rows, y itself on main rows, as one element-wise kernel: one dispatch
    # instead of three, 56 fewer in a SmolLM2 pass with streams. Selected rather than multiplied
    # by the mask: y + 0·t turned a main row's -0.0 into +0.0 and a non-finite t into NaN there;
    # stream rows get the same bits as y + (scale·t)·1. The 28 stream LoRAs at 17 rows alone:
    # 1.57 against 1.76 ms; a 9-node pass with streams at two hosts 0.981-0.988x as long with
    # 8-bit activations, 0.992x without (throwaway scripts, 30 and 60 rounds interleaved in one
    # process: about 1%, the noise's size).
    return mx.compile(lambda y, t, m: mx.where(m > 0, y + scale * t, y), shapeless=True)


class LoRAAdapter:
    """The block's ``adapter``: adds a layer's LoRA deltas to its projections.

    ``row_mask`` (1, R, 1), 1.0 on stream rows and 0.0 on main rows, confines
    the delta to stream rows (lossless mode: main rows keep the frozen
    projection exactly, selected from y). Selecting by a mask costs one
    broadcast instead of slicing and re-concatenating rows in every
    projection (computing the LoRA of the stream rows only and concatenating
    was no faster at SmolLM2's 8 stream rows of 17). None adds the delta to every row."""

    def __init__(self, loras: Dict[str, "LoRA"], row_mask: Optional[mx.array] = None):
        self.loras = loras
        self.row_mask = row_mask

    def __call__(self, name: str, x: mx.array, y: mx.array) -> mx.array:
        lora = self.loras.get(name)
        if lora is None:
            return y
        if self.row_mask is None:
            return y + lora(x)
        return _masked_delta(float(lora.scale))(y, lora.low_rank(x), self.row_mask)


def own_streams_block(n_hosts: int, gamma: int) -> np.ndarray:
    """(n_hosts·γ, n_hosts·γ) bool, host-major: stream (t, j) sees streams (t, 1..j) of
    its own host and no other host's. The one definition of the stream-to-stream rule,
    used by decoding (method/msa.py) and training (train/objective.py)."""
    return np.kron(np.eye(n_hosts, dtype=bool), np.tril(np.ones((gamma, gamma), dtype=bool)))


def stream_row_mask(n_main: int, n_rows: int, dtype=mx.float32) -> mx.array:
    """(1, n_rows, 1): 0 for the first ``n_main`` rows, 1 for the stream rows after them."""
    return (mx.arange(n_rows) >= n_main).astype(dtype)[None, :, None]


class StreamParams(nn.Module):
    """Stream embeddings P, the MSA layers' stream LoRA, and the pruning adapter.

    ``first_layer`` is the stream-insertion layer N - N_s: layers before it run
    main rows only, layers from it on run multi-stream attention."""

    def __init__(self, model, cfg: StreamConfig):
        super().__init__()
        n_layers = len(model.layers)
        if not 1 <= cfg.stream_layers <= n_layers:
            raise ValueError(f"stream_layers must be in 1..{n_layers}, got {cfg.stream_layers}")
        if not 1 <= cfg.num_streams <= MAX_STREAMS:
            raise ValueError(f"num_streams must be in 1..{MAX_STREAMS}, got {cfg.num_streams}")
        self.config = cfg
        self.first_layer = n_layers - cfg.stream_layers
        hidden = model.args.hidden_size
        # Small random identifiers: streams start as near-copies of the main row
        # (training may redraw them at the hidden state's scale: scale_embeddings).
        self.embeddings = mx.random.normal((cfg.num_streams, hidden)) * 0.02
        self.lora: Dict[str, Dict[str, LoRA]] = {}
        if cfg.lora_rank > 0:
            self.lora = make_layer_loras(
                model, range(self.first_layer, n_layers), cfg.lora_targets, cfg.lora_rank, cfg.lora_scale
            )
        self.pruning = PruningAdapter(hidden, cfg.pruning_rank)
        # Not parameters (leading underscore): the draft vocabulary and its head's rows.
        self._draft_vocab: Optional[DraftVocab] = None
        self._draft_head = None

    @property
    def num_streams(self) -> int:
        return self.config.num_streams

    @property
    def draft_vocab(self) -> Optional["DraftVocab"]:
        """The vocabulary entries the streams draft from, or None for all of them."""
        return self._draft_vocab

    @property
    def draft_head(self):
        """The LM head's rows of the draft vocabulary
        (:meth:`~specstream_mlx.models.base.Model.head_rows`), or None without one."""
        return self._draft_head

    def use_draft_vocab(self, model, ids) -> None:
        """Draft from the vocabulary entries ``ids`` only (None: all of them).

        A stream row's logits only rank draft candidates, which verification accepts or
        not, so a head over the entries the streams' data uses keeps the output exact and
        reads a sixth of SmolLM2's 49,152-row head (docs/DESIGN.md decision 41)."""
        if ids is None:
            self._draft_vocab, self._draft_head = None, None
            self.config.draft_vocab = 0
            return
        ids = np.asarray(ids)
        check_draft_vocab(ids, model.args.vocab_size)
        self._draft_vocab = DraftVocab(mx.array(ids.astype(np.int32)), model.args.vocab_size)
        self._draft_head = model.head_rows(self._draft_vocab.ids)
        self.config.draft_vocab = len(ids)

    def draft_logits(self, model, h: mx.array) -> mx.array:
        """Logits of stream rows' hidden states ``h`` over the draft vocabulary (in the
        order of its ids; the whole vocabulary's without one)."""
        return model.lm_logits(h) if self._draft_head is None else self._draft_head(h)

    def insert(self, M: mx.array) -> mx.array:
        """Stream insertion ``S[.., j, :] = M[.., :] + P[j]``: (..., h) -> (..., γ, h)."""
        return M[..., None, :] + self.embeddings

    def scale_embeddings(self, target_rms: float, seed: int = 0) -> None:
        """Draw P afresh with each entry ~ N(0, target_rms²), so a stream row's identifier
        has RMS ``target_rms`` (``train --stream-embedding-rms``; docs/DESIGN.md decision 27)."""
        key = mx.random.key(seed)
        self.embeddings = mx.random.normal(self.embeddings.shape, key=key) * float(target_rms)
        mx.eval(self.embeddings)

    def layer_lora(self, layer_index: int) -> Optional[Dict[str, LoRA]]:
        """The stream LoRA of an MSA layer, or None."""
        return self.lora.get(lora_key(layer_index)) or None if self.lora else None

    def extra_parameters(self) -> int:
        return sum(v.size for _, v in tree_flatten(self.parameters()))


@dataclass(frozen=True)
class DraftVocab:
    """The vocabulary entries streams draft from: ``ids`` (N,) int32, most frequent first,
    of a vocabulary of ``size`` entries."""

    ids: mx.array
    size: int

    def tokens(self, index: mx.array) -> mx.array:
        """Token ids of positions in the draft vocabulary (any shape)."""
        return mx.take(self.ids, index)

    def spread(self, probs: mx.array) -> mx.array:
        """(..., N) distributions over the draft vocabulary as (..., size), 0 elsewhere."""
        full = mx.zeros((*probs.shape[:-1], self.size), dtype=probs.dtype)
        return mx.put_along_axis(full, mx.broadcast_to(self.ids, probs.shape), probs, axis=-1)


def check_draft_vocab(ids: np.ndarray, vocab_size: int) -> None:
    """ValueError unless ``ids`` are distinct integer token ids below ``vocab_size``."""
    if ids.ndim != 1 or not len(ids) or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"draft_vocab must be a non-empty 1-D array of token ids, got shape {ids.shape} {ids.dtype}")
    outside = ids[(ids < 0) | (ids >= vocab_size)]
    if len(outside):
        raise ValueError(f"draft_vocab holds token id {int(outside[0])}, outside the vocabulary (0..{vocab_size - 1})")
    if len(np.unique(ids)) != len(ids):
        raise ValueError("draft_vocab repeats a token id")


def restore_draft_vocab(streams: StreamParams, model, ids: Optional[mx.array], where: str) -> None:
    """Attach stored draft-vocabulary ``ids`` (None: none stored) to loaded ``streams``;
    ValueError naming ``where`` unless they match the config's ``draft_vocab`` count and
    are valid token ids."""
    n = streams.config.draft_vocab
    if (ids is None) != (n == 0) or (ids is not None and ids.size != n):
        have = "none" if ids is None else f"{ids.size} ids"
        raise ValueError(f"{where}: '{DRAFT_VOCAB_KEY}' holds {have}, the config says draft_vocab {n}")
    if ids is not None:
        try:
            streams.use_draft_vocab(model, np.array(ids))
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from e


def default_targets(model_type: str) -> Tuple[str, ...]:
    return PHI3_TARGETS if model_type == "phi3" else ATTN_TARGETS + MLP_TARGETS


def new_streams(model, cfg: StreamConfig, seed: int = 0) -> StreamParams:
    """Freshly initialised (untrained) streams for ``model``."""
    mx.random.seed(seed)
    if cfg.lora_targets == ATTN_TARGETS + MLP_TARGETS:
        cfg.lora_targets = default_targets(model.model_type)
    sp = StreamParams(model, cfg)
    mx.eval(sp.parameters())
    return sp


def save_streams(streams: StreamParams, out_dir: Path) -> None:
    out_dir = Path(out_dir)
    weights = dict(tree_flatten(streams.parameters()))
    vocab = streams.draft_vocab
    streams.config.draft_vocab = 0 if vocab is None else vocab.ids.size
    if vocab is not None:
        weights[DRAFT_VOCAB_KEY] = vocab.ids
    mx.save_safetensors(str(out_dir / WEIGHTS_FILE), weights, metadata={"format": "specstream"})
    with open(out_dir / CONFIG_FILE, "w") as f:
        json.dump(streams.config.to_json(), f, indent=2)


def one_line_mismatch(message: str, names: int = 3) -> str:
    """MLX's message about parameters that do not match (one name a line, every one of
    them) on one line, naming the first few."""
    head, colon, rest = message.partition(":")
    items = [x.strip(" ,.") for x in rest.split("\n") if x.strip(" ,.")] if "\n" in rest else []
    if len(items) <= names:
        return " ".join(message.split())
    return f"{head}: {', '.join(items[:names])}, … ({len(items)} in all)"


def load_streams(model, model_dir: Path, warn=True) -> Optional[StreamParams]:
    """The streams stored beside a model, or None when it has none."""
    model_dir = Path(model_dir)
    cfg_path = model_dir / CONFIG_FILE
    if not cfg_path.exists():
        return None
    try:  # a file a loader has checked (io.limits: regular, inside the directory, size-bounded)
        cfg = StreamConfig.from_json(json.loads(cfg_path.read_text()))
    except RecursionError:
        raise ValueError(f"{cfg_path}: invalid (nested too deeply)") from None
    except (TypeError, ValueError, AttributeError) as e:
        raise ValueError(f"{cfg_path}: invalid ({e})") from e
    w_path = model_dir / WEIGHTS_FILE
    if not w_path.exists():
        raise ValueError(f"{w_path}: missing (named by {CONFIG_FILE})")
    try:
        sp = StreamParams(model, cfg)
    except ValueError as e:  # stream_layers beyond the model's layers
        raise ValueError(f"{cfg_path}: {e}") from e
    try:
        weights = mx.load(str(w_path))
    except Exception as e:  # corrupt file
        raise ValueError(f"{w_path}: cannot read safetensors ({e})") from e
    draft_ids = weights.pop(DRAFT_VOCAB_KEY, None)
    try:
        sp.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise ValueError(f"{w_path}: does not match {CONFIG_FILE} ({one_line_mismatch(str(e))})") from e
    dtype = model.model.norm.weight.dtype
    sp.update(tree_unflatten([(k, v.astype(dtype)) for k, v in tree_flatten(sp.parameters())]))
    mx.eval(sp.parameters())
    restore_draft_vocab(sp, model, draft_ids, str(w_path))
    if warn and not cfg.trained:
        print(
            f"specstream-mlx: warning: {model_dir.name} has untrained speculative streams; "
            "ss decoding stays exact but will accept few drafts (train them with "
            "`specstream-mlx train`).",
            file=sys.stderr,
        )
    return sp


def no_streams_message(model_dir) -> str:
    return (
        f"{model_dir} has no speculative streams ({CONFIG_FILE} missing). Add untrained ones with "
        "`specstream-mlx convert --hf-path SRC --mlx-path DST --num-streams 4 --stream-layers 4`, "
        "train them with `specstream-mlx train`, or use --mode lookup / --mode ar."
    )
