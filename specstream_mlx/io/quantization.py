"""mlx-lm's ``quantization`` entry of config.json, applied to a freshly built model."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict

import mlx.core as mx
import mlx.nn as nn


class QuantizationConfigError(ValueError):
    """A malformed ``quantization`` entry; the message names the file and the field."""


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _quant_settings(q: Any, where: str, cfg_path: Path) -> Dict[str, int]:
    if not isinstance(q, dict):
        raise QuantizationConfigError(f"{cfg_path}: '{where}' must be an object, got {q!r}")
    for key in ("group_size", "bits"):
        if not (_is_int(q.get(key)) and q[key] > 0):
            raise QuantizationConfigError(f"{cfg_path}: '{where}.{key}' must be a positive integer, got {q.get(key)!r}")
    return {"group_size": q["group_size"], "bits": q["bits"]}


def apply_quantization(model: nn.Module, config: Dict[str, Any], weights: Dict[str, mx.array], cfg_path: Path):
    """Quantize the modules whose weights are stored quantized, with mlx-lm's settings:
    ``quantization`` gives the group size and bits, and an entry named after a module
    path (``model.embed_tokens``) overrides them for that module (GGUF files mix widths)."""
    q = config.get("quantization")
    if not q:
        return
    default = _quant_settings(q, "quantization", cfg_path)
    per_module = {
        k: _quant_settings(v, f"quantization.{k}", cfg_path) for k, v in q.items() if isinstance(v, dict) or "." in k
    }

    def predicate(path, module):
        if not (hasattr(module, "to_quantized") and f"{path}.scales" in weights):
            return False
        return per_module.get(path, True)

    nn.quantize(model, group_size=default["group_size"], bits=default["bits"], class_predicate=predicate)
