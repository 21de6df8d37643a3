"""mlx-lm's ``quantization`` entry of config.json, applied to a freshly built model."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map, tree_unflatten


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


# What mx.quantize supports (affine): the widths and group sizes --q-bits / --q-group-size take.
QUANT_BITS = (2, 3, 4, 5, 6, 8)
QUANT_GROUP_SIZES = (32, 64, 128)


def quantize_args_error(bits: int, group_size: int) -> "str | None":
    """Why ``--q-bits`` / ``--q-group-size`` cannot be used, or None."""
    if bits not in QUANT_BITS:
        return f"unsupported --q-bits {bits}; choose one of {', '.join(map(str, QUANT_BITS))}"
    if group_size not in QUANT_GROUP_SIZES:
        return f"unsupported --q-group-size {group_size}; choose one of {', '.join(map(str, QUANT_GROUP_SIZES))}"
    return None


def quantize_float_layers(model: nn.Module, bits: int, group_size: int) -> "tuple[int, list]":
    """Quantize every float Linear/Embedding whose input width ``group_size`` divides;
    returns (how many were quantized, the paths of the float ones left as they are)."""
    quantizable = [(p, m) for p, m in model.named_modules() if hasattr(m, "to_quantized")]
    left = [p for p, m in quantizable if m.weight.shape[-1] % group_size != 0]
    n = len(quantizable) - len(left)
    if n:
        nn.quantize(
            model,
            group_size=group_size,
            bits=bits,
            class_predicate=lambda p, m: hasattr(m, "to_quantized") and m.weight.shape[-1] % group_size == 0,
        )
    return n, left


def cast_floating(model: nn.Module, dtype: mx.Dtype) -> None:
    def cast(x):
        if mx.issubdtype(x.dtype, mx.floating) and x.dtype != dtype:
            return x.astype(dtype)
        return x

    model.update(tree_map(cast, model.parameters()))


def dequantize_model(model: nn.Module) -> int:
    """Replace quantized Linear/Embedding layers by float32 ones; returns the bytes added."""
    replaced, added = [], 0
    for path, m in model.named_modules():
        if not isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            continue
        # Scales in float32 first: dequantizing with float16 scales rounds every weight to float16.
        biases = m.get("biases")
        biases = None if biases is None else biases.astype(mx.float32)
        w = mx.dequantize(m.weight, m.scales.astype(mx.float32), biases, m.group_size, m.bits)
        before = sum(v.nbytes for k, v in m.items() if isinstance(v, mx.array) and k != "bias")
        if isinstance(m, nn.QuantizedEmbedding):
            new = nn.Embedding(w.shape[0], w.shape[1])
        else:
            new = nn.Linear(w.shape[1], w.shape[0], bias="bias" in m)
            if "bias" in m:
                new.bias = m.bias
        new.weight = w
        replaced.append((path, new))
        added += w.nbytes - before
    if replaced:
        model.update_modules(tree_unflatten(replaced))
    return added


def stored_widths(model: nn.Module) -> str:
    """How a model's Linear/Embedding weights are stored, e.g. "4-bit x 180 (group 64), 8-bit
    x 31 (group 64), float x 2" (``convert`` and ``doctor --model`` print it)."""
    from collections import Counter

    kinds = Counter()
    for _, m in model.named_modules():
        if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            kinds[(m.bits, m.group_size)] += 1
        elif isinstance(m, (nn.Linear, nn.Embedding)):
            kinds[(None, None)] += 1
    parts = [f"{b}-bit x {n} (group {g})" for (b, g), n in sorted(kinds.items(), key=lambda kv: kv[0][0] or 99) if b]
    if kinds.get((None, None)):
        parts.append(f"float x {kinds[(None, None)]}")
    return ", ".join(parts)
