"""Up to how many rows a quantized weight is read as stored: measured once per machine and model.

The product kernel reads a registered weight's stored 4- or 8-bit form instead of its float32
expansion (:mod:`.stored_weights`), the same bits either way. One row's product then reads a
quarter to an eighth of the bytes, but expands every weight vector in registers: arithmetic
that a product of several rows shares, while their multiply-adds grow with the rows. With
enough rows the float32 weight's multiply-adds hide its bytes' streaming, and reading it is
faster than expanding the stored one: on a 2-core AMD EPYC (Zen 4), SmolLM2's weights of both
widths from 10 rows (a tree pass's lower layers carry 9 rows at a budget of 8, its stream
layers more); on other CPUs where their cores and memory put it. So the
row count from which a weight is read as float32 is measured, not assumed: every registered
weight of each width multiplied by rows of 2, 3, ... in both forms, interleaved, in the order
a pass reads them (the layers' weights, then the head), until the float32 form has been the
faster (``MARGIN``) at two row counts running. The limits are kept in ``stored_rows.json`` in
the user cache under what they depend on (the device, MLX's version, the CPU, the kernel's
build and settings, the registered weights' widths and shapes), so a model loads without
measuring again.

``SPECSTREAM_STORED_ROWS`` = ``auto`` (the default: measured) | N (stored up to N rows, both widths).
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

import mlx.core as mx

from ..io.files import cache_root, read_cache_table, write_cache_table
from ..platform_info import _cpu_name, _symbol, forwarder_words, kernel_version, set_q8_products
from ..settings import current as current_settings
from ..settings import stored_rows_count
from .stored_weights import Registration, registration

# The float32 weight is taken from the first of two row counts running where it takes at most
# this share of the stored form's time. Not below 1: both forms give the same bits, so nothing
# flaps with the verdict, and inside a tree pass the float32 form gains on the stored one (the
# product kernel's worker shares its core with the thread that builds the pass, which slows the
# stored form's arithmetic more than the float32 form's streaming): on the Zen 4 host, with the
# kernel's earlier tiles, a 9-node pass took 0.90x as long with SmolLM2's weights read as
# stored up to 8 rows as at every row count, 0.94x up to 9 (4-bit) and 6 (8-bit), where the
# products alone were 1.03x at 9 rows (examples/lock_spin_ab.py --setting stored-rows).
MARGIN = 1.0
# Row counts timed, in order (a tree pass's lower layers carry its nodes, its stream layers
# and head more); past the last, the last verdict holds.
LADDER = (2, 3, 4, 5, 6, 7, 8, 9, 10, 12, 16)
REPS = 5
# Every row count the kernel takes (48; more are taken in blocks of rows): no limit.
ALL_ROWS = 48
NO_LIMIT = 1 << 30
# Raised when the measurement changes, so that stored limits are measured again.
METHOD_VERSION = 1


@dataclass(frozen=True)
class RowLimits:
    """The most rows a product reads a weight as stored, by the weight's bits."""

    by_bits: Dict[int, int]

    def label(self) -> str:
        """In words, for reports: ``4-bit up to 7 rows, 8-bit up to 6``."""
        if not self.by_bits:
            return "none read as stored"
        parts = [
            f"{bits}-bit {'at every row count' if rows >= ALL_ROWS else f'up to {rows} rows'}"
            for bits, rows in sorted(self.by_bits.items())
        ]
        return ", ".join(parts)


def configured_rows() -> Optional[int]:
    """``SPECSTREAM_STORED_ROWS``, checked: a row count (at most ``ALL_ROWS``), or None for ``auto``."""
    rows = stored_rows_count(current_settings().stored_rows)
    return None if rows is None else min(rows, ALL_ROWS)


def _set_rows():
    fn = _symbol("specstream_stored_set_rows")
    if fn is not None:
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int]
    return fn


def apply(reg: Registration, limits: Dict[int, int]) -> None:
    """Products of more rows than ``limits[bits]`` by a registered weight of that width read its
    float32 weight (a width not in ``limits``: every row count reads it stored)."""
    set_rows = _set_rows()
    if set_rows is None:
        return
    for pointer, bits in reg.bits.items():
        rows = limits.get(bits, ALL_ROWS)
        set_rows(pointer, NO_LIMIT if rows >= ALL_ROWS else rows)


def _weights_by_bits(reg: Registration) -> Dict[int, List[mx.array]]:
    out: Dict[int, List[mx.array]] = {}
    for pointer, arrays in reg._held:
        out.setdefault(reg.bits[pointer], []).append(arrays[0])
    return out


def time_forms(reg: Registration, reps: int = REPS) -> Dict[int, Dict[int, Dict[str, float]]]:
    """Median seconds of every registered weight's product of each width, stored and float32,
    by row count (``LADDER``), until the float32 form has been the faster (``MARGIN``) at two
    row counts running for every width. Leaves every weight read as stored at every row count.
    Timed with the kernel's integer activations off: they serve every row count alike, and the
    limits are for the products that are the float32 weight's bits."""
    q8 = set_q8_products(0)
    try:
        return _time_forms(reg, reps)
    finally:
        if q8:
            set_q8_products(q8)


def _time_forms(reg: Registration, reps: int) -> Dict[int, Dict[int, Dict[str, float]]]:
    groups = _weights_by_bits(reg)
    widths = sorted(groups, key=lambda b: -len(groups[b]))  # the layers' width first, the head's last
    out: Dict[int, Dict[int, Dict[str, float]]] = {b: {} for b in widths}
    done = {b: 0 for b in widths}  # row counts running at which float32 won
    depths = {w.shape[1] for ws in groups.values() for w in ws}
    for rows in LADDER:
        # Keyed: a measurement at load must not move the caller's random state.
        xs = {k: mx.random.normal((rows, k), key=mx.random.key(k)) for k in depths}
        mx.eval(list(xs.values()))
        runs: Dict[int, Dict[str, list]] = {b: {"stored": [], "float32": []} for b in widths}
        for rep in range(reps + 1):  # the first a warm-up
            for form in ("stored", "float32") if rep % 2 else ("float32", "stored"):
                apply(reg, {b: ALL_ROWS if form == "stored" else 0 for b in widths})
                for b in widths:
                    t = time.perf_counter()
                    mx.eval([xs[w.shape[1]] @ w.T for w in groups[b]])
                    if rep:
                        runs[b][form].append(time.perf_counter() - t)
        for b in widths:
            if done[b] < 2:
                out[b][rows] = {f: statistics.median(ts) for f, ts in runs[b].items()}
                done[b] = done[b] + 1 if out[b][rows]["float32"] <= MARGIN * out[b][rows]["stored"] else 0
        if all(d >= 2 for d in done.values()):
            break
    apply(reg, {})
    return out


def limits_from(times: Dict[int, Dict[int, Dict[str, float]]]) -> Dict[int, int]:
    """Per width, the row count before the first of two running at which the float32 form took at
    most ``MARGIN`` of the stored form's time (``ALL_ROWS`` where that never happened)."""
    limits = {}
    for bits, by_rows in times.items():
        counts = sorted(by_rows)
        wins = [by_rows[r]["float32"] <= MARGIN * by_rows[r]["stored"] for r in counts]
        limit = ALL_ROWS
        for i in range(len(counts) - 1):
            if wins[i] and wins[i + 1]:
                limit = counts[i - 1] if i > 0 else 1
                break
        limits[bits] = limit
    return limits


def _key(reg: Registration) -> str:
    weights = sorted((reg.bits[pointer], *arrays[0].shape) for pointer, arrays in reg._held)
    # Without the integer activations' setting: the limits are measured with them off (time_forms),
    # so one measurement serves every setting.
    machine = [mx.__version__, str(mx.default_device()), _cpu_name(), forwarder_words(False), kernel_version()]
    ident = [METHOD_VERSION, *machine, weights]
    return hashlib.sha1(json.dumps(ident).encode()).hexdigest()[:16]


def measured_limits(
    reg: Registration, measure: Callable[[Registration], dict] = time_forms, log: Optional[Callable[[str], None]] = None
) -> Dict[int, int]:
    """The stored limits for ``reg``'s weights on this machine, else a new measurement (stored;
    announced through ``log``)."""
    path = cache_root() / "stored_rows.json"
    key = _key(reg)
    table = read_cache_table(path)
    entry = table.get(key)
    if isinstance(entry, dict) and isinstance(entry.get("limits"), dict):
        try:
            stored = {int(b): int(r) for b, r in entry["limits"].items()}
            if stored.keys() == set(reg.bits.values()) and min(stored.values()) >= 1:
                return stored
        except (TypeError, ValueError):
            pass  # a damaged entry: measured again
    if log:
        log("timing products of stored and float32 weights on this machine (once; stored in the user cache)")
    times = measure(reg)
    limits = limits_from(times)
    table[key] = {
        "limits": {str(b): r for b, r in limits.items()},
        "ms": {
            str(b): {str(r): {f: round(s * 1e3, 3) for f, s in t.items()} for r, t in by_rows.items()}
            for b, by_rows in times.items()
        },
    }
    write_cache_table(path, table, indent=1)
    return limits


def limit_stored_rows(model, setting: Optional[int] = None, log: Optional[Callable[[str], None]] = None) -> RowLimits:
    """Sets up to how many rows ``model``'s registered weights are read as stored: ``setting``
    (default ``SPECSTREAM_STORED_ROWS``), or where that is ``auto``, the measured limits (a
    measurement announced through ``log``). Kept on the registration (:func:`row_limits`)."""
    reg = registration(model)
    if not reg.bits:
        return RowLimits({})
    rows = configured_rows() if setting is None else setting
    widths = set(reg.bits.values())
    limits = {b: rows for b in widths} if rows is not None else measured_limits(reg, log=log)
    apply(reg, limits)
    reg.row_limits = dict(limits)
    return RowLimits(dict(limits))


def limits_words(model) -> str:
    """The limits in words for a report's header; '' where no weight is read as stored."""
    return row_limits(model).label() if registration(model).weights else ""


def row_limits(model) -> RowLimits:
    """What :func:`limit_stored_rows` set for ``model`` (none read as stored if nothing was)."""
    return RowLimits(dict(registration(model).row_limits))
