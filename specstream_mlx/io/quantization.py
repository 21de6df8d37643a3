"""mlx-lm's ``quantization`` entry of config.json: applied to a freshly built model,
written for a quantized one; quantizing, requantizing and dequantizing Linear/Embedding layers."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map, tree_unflatten

from ..models.stored import StoredForm
from ..models.stored import attach as attach_stored


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
        scales = m.scales.astype(mx.float32)
        w = mx.dequantize(m.weight, scales, biases, m.group_size, m.bits)
        before = sum(v.nbytes for k, v in m.items() if isinstance(v, mx.array) and k != "bias")
        if isinstance(m, nn.QuantizedEmbedding):
            new = nn.Embedding(w.shape[0], w.shape[1])
        else:
            new = nn.Linear(w.shape[1], w.shape[0], bias="bias" in m)
            if "bias" in m:
                new.bias = m.bias
        new.weight = w
        if biases is not None and getattr(m, "mode", "affine") == "affine":
            # What the CPU product kernel may read instead of w (runtime.stored_weights).
            attach_stored(new, StoredForm(m.weight, scales, biases, m.bits, m.group_size))
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


def quantize_or_refuse(model: nn.Module, bits: int, group_size: int, log, error) -> None:
    """Quantize what ``group_size`` divides and say what was left float; refuse (``error``)
    when it divides no layer's width, rather than write a quantization entry for nothing."""
    log(f"[convert] quantizing to {bits} bits, group size {group_size}")
    n, left = quantize_float_layers(model, bits, group_size)
    if n == 0 and left:
        widths = sorted({int(m.weight.shape[-1]) for p, m in model.named_modules() if p in set(left)})
        raise error(
            f"--q-group-size {group_size} divides none of this model's input widths "
            f"({', '.join(map(str, widths[:6]))}): nothing would be quantized; choose a group size that divides them"
        )
    if left:
        log(f"[convert] left {len(left)} layers float: their widths are not multiples of {group_size} (e.g. {left[0]})")


# Block types dequantized on import -> the MLX width they are requantized to (4-bit up to
# 5.5 bits per weight as stored, 8-bit above).
REQUANT_BITS = {
    "Q2_K": 4,
    "Q3_K": 4,
    "Q4_K": 4,
    "Q5_K": 4,
    "Q4_0": 4,
    "Q4_1": 4,
    "Q5_0": 4,
    "Q5_1": 4,
    "IQ2_XXS": 4,
    "IQ2_XS": 4,
    "IQ2_S": 4,
    "IQ3_XXS": 4,
    "IQ3_S": 4,
    "IQ1_S": 4,
    "IQ1_M": 4,
    "IQ4_NL": 4,
    "IQ4_XS": 4,
    "Q6_K": 8,
    "Q8_0": 8,
    "Q8_1": 8,
    "Q8_K": 8,
}
REQUANT_GROUP_SIZES = (32, 64, 128)
# The largest group size whose error is within this factor of the smallest's is chosen.
REQUANT_ERROR_SLACK = 1.10


def quantization_entry(settings: Dict[str, Tuple[int, int]]) -> Optional[Dict[str, Any]]:
    """mlx-lm's ``quantization`` entry for module path -> (group size, bits): the commonest
    pair as the default, every module that differs named with its own."""
    if not settings:
        return None
    gs, bits = Counter(settings.values()).most_common(1)[0][0]
    q: Dict[str, Any] = {"group_size": gs, "bits": bits}
    for path, (g, b) in sorted(settings.items()):
        if (g, b) != (gs, bits):
            q[path] = {"group_size": g, "bits": b}
    return q


@dataclass
class Requantized:
    """What :func:`requantize` did: modules per (GGUF type, MLX bits), the group size and
    the relative RMS error against the dequantized weights at each candidate size."""

    counts: Dict[Tuple[str, int], int]
    group_size: int
    errors: Dict[int, float]

    def line(self) -> str:
        kinds = ", ".join(f"{k} x{n} -> {b}-bit" for (k, b), n in sorted(self.counts.items()))
        tried = ", ".join(f"{g}: {e:.4f}" for g, e in sorted(self.errors.items()))
        return (
            f"requantized {sum(self.counts.values())} dequantized weights to MLX affine quantization ({kinds}), "
            f"group size {self.group_size}: relative RMS error {self.errors[self.group_size]:.4f} against the "
            f"dequantized weights (group size {tried})"
        )


def requantize(model: nn.Module, dequantized: Dict[str, str]) -> Optional[Requantized]:
    """Quantize the Linear/Embedding layers whose weights were dequantized from GGUF blocks
    at the nearest MLX width (:data:`REQUANT_BITS`). The group size is measured: the largest
    of 32/64/128 whose relative RMS error over all of them is within
    :data:`REQUANT_ERROR_SLACK` of the best (larger groups store fewer scales)."""
    mods = {
        p: m
        for p, m in model.named_modules()
        if p in dequantized and hasattr(m, "to_quantized") and m.weight.shape[-1] % REQUANT_GROUP_SIZES[0] == 0
    }
    if not mods:
        return None
    bits = {p: REQUANT_BITS[dequantized[p]] for p in mods}
    errors = {}
    for g in REQUANT_GROUP_SIZES:
        if any(m.weight.shape[-1] % g for m in mods.values()):
            continue
        num = den = 0.0
        for p, m in mods.items():
            w = m.weight.astype(mx.float32)
            back = mx.dequantize(*mx.quantize(w, g, bits[p]), group_size=g, bits=bits[p])
            num += mx.sum(mx.square(back - w)).item()
            den += mx.sum(mx.square(w)).item()
        errors[g] = (num / max(den, 1e-30)) ** 0.5
    best = min(errors.values())
    g = max(k for k, e in errors.items() if e <= best * REQUANT_ERROR_SLACK)
    nn.quantize(model, class_predicate=lambda p, m: {"group_size": g, "bits": bits[p]} if p in mods else False)
    counts = Counter((dequantized[p], bits[p]) for p in mods)
    return Requantized(dict(counts), g, errors)


def model_quantization(model: nn.Module) -> Optional[dict]:
    """The entry for a model as it is (after any further ``-q``)."""
    quantized = (nn.QuantizedLinear, nn.QuantizedEmbedding)
    return quantization_entry({p: (m.group_size, m.bits) for p, m in model.named_modules() if isinstance(m, quantized)})
