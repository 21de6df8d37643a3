"""Quantized weights read as stored by the CPU product kernel.

A quantized model on the CPU backend decodes with float32 weights expanded at load
(:func:`~specstream_mlx.io.quantization.dequantize_model`): MLX's own 4-bit product costs
several float32 ones there. Every decoding step then streams the expanded bytes — SmolLM2's
4-bit layers and 8-bit head are 98 MB as stored and 538 MB expanded. The product kernel that
serves MLX's ``cblas_sgemm`` (``native/gemv_forward.c``) can read a weight's stored form
instead, expanding each tile's values in registers; :func:`register` tells it which float32
weight stands for which stored arrays. It accepts a weight only if every value it expands
equals the float32 weight's, bit for bit, and multiplies exactly as with the float32 weight,
so outputs do not change — only the bytes read. Products it does not serve (more rows than its
tiles take: a prompt's) read the float32 weight as before.

The kernel finds a weight by the data pointer MLX passes, so the registration keeps every
registered array alive (its buffer can be neither freed nor reused while registered) and
unregisters them when the model is collected, after the device has finished its work.
Nothing here runs on a device whose weights stay quantized (a GPU): no float32 expansion,
no stored form.
"""

from __future__ import annotations

import ctypes
import weakref
from dataclasses import dataclass, field
from typing import Dict, List, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..models.stored import stored_form
from ..platform_info import _symbol
from ..settings import current as current_settings

# The attribute a model keeps its registration under.
ATTRIBUTE = "_stored_registration"


@dataclass
class Registration:
    """What :func:`register` did for one model.

    Attributes:
        weights: the model's float32 weights the kernel now reads as stored.
        extra: other weights registered with them (the streams' draft head).
        refused: weights with a stored form that the kernel does not take (a width, group or
            depth it does not serve, or values that differ from the float32 weight's).
        stored_bytes: bytes of the registered model weights' stored forms as the kernel reads
            them (codes, scales, biases).
        float_bytes: bytes of the same weights in float32.
        half: the weights among them whose scales and biases the kernel holds and reads as
            float16 (every one exactly a float16, as a GGUF file's).
        bits: each registered weight's width (4 or 8), by its pointer.
        row_limits: the most rows a product reads a weight of each width as stored
            (:mod:`.stored_rows`; empty until set: every row count the kernel takes).
    """

    weights: int = 0
    extra: int = 0
    refused: int = 0
    stored_bytes: int = 0
    float_bytes: int = 0
    half: int = 0
    bits: Dict[int, int] = field(default_factory=dict)
    row_limits: Dict[int, int] = field(default_factory=dict)
    # (pointer, arrays kept alive) per registered weight.
    _held: List[Tuple[int, tuple]] = field(default_factory=list, repr=False)


def _pointer(a: mx.array) -> int:
    return np.asarray(memoryview(a)).ctypes.data


def _kernel():
    register = _symbol("specstream_stored_register")
    if register is None:
        return None, None
    register.restype = ctypes.c_int
    register.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    register.argtypes += [ctypes.c_void_p, ctypes.c_void_p]
    unregister = _symbol("specstream_stored_unregister")
    unregister.argtypes = [ctypes.c_void_p]
    return register, unregister


def _held_bytes():
    """The kernel's ``bytes(pointer)``: what a product of the registered weight at ``pointer``
    reads, its codes, scales and biases as the kernel holds them (scales and biases that are all
    exactly float16, as a GGUF file's, in float16)."""
    fn = _symbol("specstream_stored_bytes")
    fn.restype, fn.argtypes = ctypes.c_longlong, [ctypes.c_void_p]
    return fn


def _release(unregister, held: List[Tuple[int, tuple]]) -> None:
    # Products queued before the model went may still read its weights: wait for them.
    mx.synchronize()
    for pointer, _ in held:
        unregister(pointer)
    held.clear()


def register(model: nn.Module, extra: Sequence = ()) -> Registration:
    """Tell the product kernel to read ``model``'s quantized weights as stored (every float32
    Linear or Embedding weight that keeps a :class:`~specstream_mlx.models.stored.StoredForm`),
    and those of ``extra``: objects with a ``weight`` and its ``form`` (the streams' draft head,
    :class:`~specstream_mlx.models.base.HeadRows`, read twice a pass: SmolLM2's 8,192 rows are
    18.9 MB in float32, 4.7 MB as stored). Nothing where the kernel is not loaded or
    ``SPECSTREAM_STORED=0``."""
    done = Registration()
    register_fn, unregister = _kernel()
    if register_fn is None or not current_settings().stored_weights:
        return done
    weights = [
        (module.weight, stored_form(module), True)
        for _, module in model.named_modules()
        if isinstance(module, (nn.Linear, nn.Embedding))
    ]
    weights += [(e.weight, e.form, False) for e in extra]
    held_bytes = _held_bytes()
    for w, form, parameter in weights:
        if form is None or w.dtype != mx.float32:
            continue
        arrays = (w, form.weight, form.scales, form.biases)  # scales and biases are float32
        mx.eval(arrays)
        n, k = w.shape
        pointers = [_pointer(a) for a in arrays]
        if register_fn(pointers[0], n, k, pointers[1], form.bits, form.group_size, pointers[2], pointers[3]) != 1:
            done.refused += 1
            continue
        if not parameter:  # not one of the model's parameters: not in what a step reads
            done.extra += 1
        else:
            done.weights += 1
            held = held_bytes(pointers[0])
            done.stored_bytes += held
            done.half += held < sum(a.nbytes for a in arrays[1:])  # float32 scales and biases as given
            done.float_bytes += w.nbytes
        done._held.append((pointers[0], arrays))
        done.bits[pointers[0]] = form.bits
    if done._held:
        weakref.finalize(model, _release, unregister, done._held)
    object.__setattr__(model, ATTRIBUTE, done)  # a plain attribute: outside the parameter tree
    return done


def registration(model: nn.Module) -> Registration:
    """What :func:`register` did for ``model`` (nothing registered if it was never called)."""
    return getattr(model, ATTRIBUTE, None) or Registration()


def served() -> int:
    """Products the kernel has served from stored forms in this process (0 without it)."""
    count = _symbol("specstream_stored_served")
    if count is None:
        return 0
    count.restype = ctypes.c_longlong
    return int(count())
