"""A fingerprint of a model directory's base weights.

Streams are trained against one base: attached to another (a different conversion,
quantization or fine-tune) they stay exact but draft for a model that is not there.
``specstream.json`` records the fingerprint of the base its streams were trained on,
and loading refuses a base whose weights hash differently.
"""

from __future__ import annotations

import glob
import hashlib
from pathlib import Path

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


def base_fingerprint(model_dir: Path) -> str:
    """The fingerprint of the base weights stored in ``model_dir`` (model*.safetensors, as stored)."""
    weights = {}
    for f in sorted(glob.glob(str(Path(model_dir) / "model*.safetensors"))):
        weights.update(mx.load(f))
    return weights_fingerprint(weights)
