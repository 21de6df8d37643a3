"""A float32 weight's stored form: the quantized arrays it was expanded from.

On the CPU backend a quantized model's weights are expanded to float32 at load
(:func:`~specstream_mlx.io.quantization.dequantize_model`), since MLX's own quantized
product there costs several float32 ones. The expanded layer keeps the arrays it came from
beside its weight, outside the parameter tree, so that the CPU product kernel can be told to
read them instead (:mod:`specstream_mlx.runtime.stored_weights`): the same values, a quarter
(8-bit) to an eighth (4-bit) of the bytes. Fusing layers at load concatenates their forms.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import mlx.core as mx
import mlx.nn as nn

# The attribute a layer keeps its form under: a plain attribute (not an mx.array), so it is
# never a parameter, never saved and never trained.
ATTRIBUTE = "_stored_form"


@dataclass(frozen=True)
class StoredForm:
    """MLX affine quantization of a (out, in) weight: ``weight`` packed (uint32, the low bits
    first), one float32 ``scales`` and ``biases`` entry per ``group_size`` elements of a row."""

    weight: mx.array
    scales: mx.array
    biases: mx.array
    bits: int
    group_size: int


def attach(module: nn.Module, form: Optional[StoredForm]) -> None:
    object.__setattr__(module, ATTRIBUTE, form)


def stored_form(module: nn.Module) -> Optional[StoredForm]:
    """The form ``module``'s weight was expanded from, or None."""
    return getattr(module, ATTRIBUTE, None)


def concatenated(forms: Sequence[Optional[StoredForm]]) -> Optional[StoredForm]:
    """The form of weights concatenated by rows (a fused projection), or None when a part has
    none or the parts are quantized differently."""
    if not forms or any(f is None for f in forms):
        return None
    first = forms[0]
    if any((f.bits, f.group_size) != (first.bits, first.group_size) for f in forms):
        return None
    return StoredForm(
        mx.concatenate([f.weight for f in forms], axis=0),
        mx.concatenate([f.scales for f in forms], axis=0),
        mx.concatenate([f.biases for f in forms], axis=0),
        first.bits,
        first.group_size,
    )
