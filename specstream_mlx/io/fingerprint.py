"""A fingerprint of a model directory's base weights.

Streams are trained against one base: attached to another (a different conversion,
quantization or fine-tune) they stay exact but draft for a model that is not there.
``specstream.json`` records the fingerprint of the base its streams were trained on,
and loading refuses a base whose weights hash differently.
"""

from __future__ import annotations

import glob
import hashlib
import os
from pathlib import Path
from typing import Dict, Optional

import mlx.core as mx
import numpy as np

_VIEWS = {mx.bfloat16: mx.uint16}  # dtypes numpy cannot hold, hashed by their bits


def weights_fingerprint(weights) -> str:
    """sha256 over (name, dtype, shape, bytes) of every tensor, names sorted; 16 hex digits."""
    h = hashlib.sha256()
    for name in sorted(weights):
        v = weights[name]
        raw = v.view(_VIEWS[v.dtype]) if v.dtype in _VIEWS else v
        h.update(f"{name}|{v.dtype}|{tuple(v.shape)}|".encode())
        h.update(np.asarray(raw).tobytes())
    return h.hexdigest()[:16]


def base_fingerprint(model_dir: Path, cache: bool = True) -> str:
    """The fingerprint of the base weights stored in ``model_dir`` (model*.safetensors, as stored).

    Hashing a model's weights takes a noticeable part of a start-up (0.2 s for SmolLM2), so
    the result is remembered in the user cache under each file's path, size and
    modification time (a guard against mistakes, as the fingerprint itself is)."""
    files = sorted(glob.glob(str(Path(model_dir) / "model*.safetensors")))
    key = "|".join(f"{os.path.realpath(f)}:{os.stat(f).st_size}:{os.stat(f).st_mtime_ns}" for f in files)
    store = _store() if cache else None
    known = _read(store) if store else {}
    if key in known:
        return known[key]
    weights = {}
    for f in files:
        weights.update(mx.load(f))
    fp = weights_fingerprint(weights)
    if store is not None:
        known[key] = fp
        _write(store, dict(list(known.items())[-256:]))  # the most recent ones
    return fp


def _store() -> Optional[Path]:
    from .files import cache_root

    return cache_root() / "fingerprints.json"


def _read(store: Path) -> Dict[str, str]:
    from .files import read_cache_table

    return {k: v for k, v in read_cache_table(store).items() if isinstance(k, str) and isinstance(v, str)}


def _write(store: Path, known: Dict[str, str]) -> None:
    from .files import write_cache_table

    write_cache_table(store, known)  # a read-only or missing cache only costs the hashing next time
