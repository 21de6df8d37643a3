"""One matrix product for q/k/v and one for gate/up per layer, fused at load for decoding.

A decode step on a small model is a few hundred small matrix products; each is a kernel
launch (a GPU) or a library call that wakes its worker threads (a CPU BLAS), and each
streams its weight from memory. Concatenating the weights that read the same input —
``q_proj | k_proj | v_proj`` and ``gate_proj | up_proj`` — turns seven products per layer
into four, each wider. The model keeps its own code path for such layers
(``fused_qkv``, as Phi-3 stores them), and an adapter keyed by the original names (the
streams' LoRA) still applies to each part (:meth:`~.base.Attention.project`,
:meth:`~.base.MLP.gate_up`).

The fused layout is for decoding only: :func:`~specstream_mlx.runtime.loaded_model.load`
fuses, while training, conversion and anything that saves weights use the stored layout.
Every output column is the same dot product as before, so logits agree with the unfused
model to rounding (a BLAS may order a product's sums differently by its width).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import mlx.core as mx
import mlx.nn as nn

from . import base, stored

QKV = ("q_proj", "k_proj", "v_proj")
GATE_UP = ("gate_proj", "up_proj")


@dataclass(frozen=True)
class FusedPart:
    """Where a fused projection's part sits: what :func:`~specstream_mlx.method.streams.find_linear`
    returns for ``q_proj`` of a fused layer, so LoRAs keyed by the part get its shape."""

    in_dims: int
    out_dims: int


def linear_dims(module) -> "tuple[int, int]":
    """(in, out) of a Linear or QuantizedLinear, or of a part of a fused one."""
    if isinstance(module, FusedPart):
        return module.in_dims, module.out_dims
    if isinstance(module, nn.QuantizedLinear):
        return module.weight.shape[1] * 32 // module.bits, module.weight.shape[0]
    out_dims, in_dims = module.weight.shape
    return in_dims, out_dims


def _fusable(modules: Sequence[nn.Module]) -> bool:
    """Same kind of layer, same input size, same bias, same quantization."""
    first = modules[0]
    if type(first) not in (nn.Linear, nn.QuantizedLinear) or any(type(m) is not type(first) for m in modules):
        return False
    if any(("bias" in m) != ("bias" in first) for m in modules):
        return False
    if any(m.weight.shape[1] != first.weight.shape[1] for m in modules):
        return False
    if isinstance(first, nn.QuantizedLinear):
        keys = [(m.bits, m.group_size, getattr(m, "mode", "affine")) for m in modules]
        return len(set(keys)) == 1
    return True


def concat_linear(modules: Sequence[nn.Module]) -> nn.Module:
    """One layer whose output is the concatenation of ``modules``' outputs."""
    first = modules[0]
    bias = "bias" in first
    if isinstance(first, nn.QuantizedLinear):
        mode = getattr(first, "mode", "affine")
        g = first.group_size
        fused = nn.QuantizedLinear(g, 1, bias=bias, group_size=g, bits=first.bits, mode=mode)
    else:
        fused = nn.Linear(1, 1, bias=bias)
    # The small placeholder's arrays are replaced, never computed with.
    fused.update({k: mx.concatenate([m[k] for m in modules], axis=0) for k in fused if k in first})
    stored.attach(fused, stored.concatenated([stored.stored_form(m) for m in modules]))
    return fused


def _fuse(module: nn.Module, names: Sequence[str], fused_name: str, evaluate: bool) -> bool:
    parts = [module[n] for n in names]
    if not _fusable(parts):
        return False
    shapes = [FusedPart(*linear_dims(m)) for m in parts]
    module[fused_name] = concat_linear(parts)
    for n in names:
        del module[n]
    if evaluate:  # one layer's copy at a time: the parts' buffers go as soon as it exists
        mx.eval(module[fused_name].parameters())
    # A plain attribute (not an mx.array, not a Module): outside the parameter tree.
    object.__setattr__(module, "_fused_parts", {**getattr(module, "_fused_parts", {}), tuple(names): shapes})
    return True


def fuse_projections(model, evaluate: bool = True) -> int:
    """Fuse q/k/v and gate/up in every layer of ``model`` that stores them apart and runs
    the shared block code; returns how many products a decode step saves. ``evaluate``:
    compute each fused weight at once (memory grows by one layer's projections at most);
    False leaves lazy concatenations (a lazily loaded model)."""
    saved = 0
    for layer in model.layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if isinstance(attn, base.Attention) and not attn.fused_qkv and all(n in attn for n in QKV):
            if _fuse(attn, QKV, "qkv_proj", evaluate):
                attn.fused_qkv = True
                saved += 2
        if isinstance(mlp, base.MLP) and not mlp.fused and all(n in mlp for n in GATE_UP):
            if _fuse(mlp, GATE_UP, "gate_up_proj", evaluate):
                mlp.fused = True
                saved += 1
    return saved


def fused_part(parent: nn.Module, name: str) -> Optional[FusedPart]:
    """``name``'s shape when ``parent`` fused it at load (None otherwise)."""
    for names, shapes in getattr(parent, "_fused_parts", {}).items():
        if name in names:
            return shapes[names.index(name)]
    return None
