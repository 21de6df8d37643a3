"""What a tree pass costs on this machine, learned from real generations and kept between processes.

:class:`PassCosts` holds, per *arm* (a dynamic-tree budget and a hosting mode), the EMA of
the wall time of its passes and of plain tokens, and the costs an earlier process stored
under the model's :func:`model_key` in ``step_costs.json`` in the user cache
(``SPECSTREAM_MLX_CACHE``). It is a machine fact, shared by every client of a model;
:mod:`.autotune`'s policies read it to choose arms.
"""

from __future__ import annotations

import hashlib
import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Dict, List, Optional, Tuple

import mlx.core as mx

from ..cpu_jit import jit_words
from ..io.files import cache_root, read_cache_table, write_cache_table
from ..models.attention import FORMS_VERSION
from ..platform_info import blas_in_use, forwarder_words, kernel_version, malloc_in_use
from .attention_choice import attention_form
from .stored_rows import row_limits

if TYPE_CHECKING:
    from .offline_costs import ArmCosts

Arm = Tuple[int, int]  # (budget, hosting mode)

# Cost of a budget-b pass in plain tokens before any pass is timed: base + slope * b (SmolLM2
# on a 2-core CPU measured 1.46 / 1.98 / 2.36 at b = 2 / 4 / 8; `examples/step_cost.py`).
# Used only where nothing is stored and no calibration ran (:func:`calibrate`).
PRIOR = (1.2, 0.15)
# What :func:`calibrate` times: these budgets at each hosting mode, each pass at its median
# over at least REPS runs and SECONDS of them.
CALIBRATION_BUDGETS = (2, 8)
CALIBRATION_REPS = 3
# Seconds of each calibration arm's passes to time at least (more passes for small models).
CALIBRATION_SECONDS = 0.05
# Timings: EMA weight, samples before a timing counts.
TIME_EMA = 0.1
TIME_MIN = 3
# Bump when a pass changes what it computes or how its costs are measured: stored costs
# are then ignored.
# 22: T1 prefetches on every CPU (eight-bit codes too); 21: attention's scores split between
# threads, keys transposed, values prefetched.
COST_VERSION = 22


def cost_cache_file() -> Path:
    """Where learned costs are kept: ``step_costs.json`` in the user cache (read at each use)."""
    return cache_root() / "step_costs.json"


def _read_table() -> dict:
    return read_cache_table(cost_cache_file())


def cost_line(points: Dict[int, float]) -> Tuple[float, float, float]:
    """(x0, y0, slope) of the line that estimates the cost of a budget from the costs of
    other budgets: least squares (slope ≥ 0) through two or more, ``PRIOR``'s slope
    through one, ``PRIOR`` alone without any. Cost of budget b: max(1, y0 + slope·(b − x0)).
    Plain Python: the policy asks for costs between tokens, and a few points do not need
    numpy's overhead (tens of microseconds, a tenth of a small model's step)."""
    base, slope = PRIOR
    if not points:
        return 0.0, base, slope
    n = len(points)
    x0, y0 = sum(points) / n, sum(points.values()) / n
    if n >= 2:
        sxx = sum((x - x0) ** 2 for x in points)
        sxy = sum((x - x0) * (y - y0) for x, y in points.items())
        slope = max(sxy / sxx, 0.0) if sxx > 0 else 0.0
    return float(x0), float(y0), slope


@dataclass
class PassCosts:
    """Seconds per tree pass per arm and per plain token (EMAs of timed generations), and
    the costs an earlier process stored under ``key``."""

    key: Optional[str] = None
    stored: Dict[Arm, float] = field(default_factory=dict)
    # Seconds of a plain step stored with the costs (a calibration's, else an earlier
    # process's plain tokens): what this process's passes are measured against until it
    # has timed plain tokens of its own. A short request with an acceptance prior may run
    # only tree passes; without it, what they cost would never be learned.
    stored_plain: Optional[float] = None
    seconds: Dict[Arm, float] = field(default_factory=dict)
    timed: Dict[Arm, int] = field(default_factory=dict)
    plain: float = 0.0
    plain_n: int = 0
    # The pass counts at the last save: a request decoded plainly times no pass and leaves
    # the stored costs as they are (no write after every request).
    saved_timed: Dict[Arm, int] = field(default_factory=dict)
    # The first TIME_MIN timings of each arm and of plain tokens in this process, whose
    # median starts the EMA (:func:`_timing`).
    first_passes: Dict[Arm, List[float]] = field(default_factory=dict)
    first_plain: List[float] = field(default_factory=list)

    @classmethod
    def load(cls, key: str) -> "PassCosts":
        entry = _read_table().get(key)
        costs = entry.get("costs") if isinstance(entry, dict) else None
        plain = entry.get("plain_seconds") if isinstance(entry, dict) else None
        plain = float(plain) if isinstance(plain, (int, float)) and plain > 0 else None
        stored = {}
        for arm, cost in costs.items() if isinstance(costs, dict) else ():
            try:
                b, h = (int(v) for v in arm.split(","))
                stored[(b, h)] = float(cost)
            except (ValueError, TypeError):
                continue  # a hand-edited or foreign entry: ignored
        return cls(key, stored, plain)

    def save(self, extra: Optional[Dict[Arm, float]] = None, plain_seconds: Optional[float] = None) -> None:
        """Store the timed arms' costs (and ``extra`` ones, e.g. a calibration's, relative
        to a plain step of ``plain_seconds``) under the key, with the plain step's seconds."""
        if plain_seconds:
            self.stored_plain = plain_seconds
        if not extra and self.timed == self.saved_timed:
            return  # no pass timed since the last save
        measured = {a: c for a in self.timed if (c := self.measured(a)) is not None}
        measured.update(extra or {})
        if self.key is None or not measured:
            return
        self.saved_timed = dict(self.timed)
        # The arms not timed here are stored as this process estimated them (:meth:`table`:
        # scaled by what the timed arms show against their stored costs), so the next
        # process does not take an untried arm at a cost its neighbours have disproved.
        self.stored = {**self.table(list(self.stored)), **measured}
        if self.plain_n >= TIME_MIN:
            self.stored_plain = self.plain
        entry = {"costs": {f"{b},{h}": c for (b, h), c in sorted(self.stored.items())}}
        if self.stored_plain:
            entry["plain_seconds"] = self.stored_plain
        table = _read_table()
        table[self.key] = entry
        write_cache_table(cost_cache_file(), table, indent=1)

    def observe_pass(self, arm: Arm, seconds: float) -> None:
        n = self.timed.get(arm, 0)
        self.seconds[arm] = _timing(self.seconds.get(arm, seconds), self.first_passes.setdefault(arm, []), n, seconds)
        self.timed[arm] = n + 1

    def observe_plain(self, seconds: float) -> None:
        self.plain = _timing(self.plain, self.first_plain, self.plain_n, seconds)
        self.plain_n += 1

    def measured(self, arm: Arm) -> Optional[float]:
        """The arm's timed cost in plain tokens, once it has ``TIME_MIN`` timed passes: over
        this process's plain tokens once it has as many, else over the stored plain step."""
        plain = self.plain if self.plain_n >= TIME_MIN else self.stored_plain
        if not plain or self.timed.get(arm, 0) < TIME_MIN:
            return None
        return self.seconds[arm] / plain

    def cost(self, arm: Arm) -> float:
        """Cost of one pass of ``arm`` in plain tokens: timed, else estimated."""
        return self.table([arm])[arm]

    def table(self, arms) -> Dict[Arm, float]:
        """Costs of ``arms`` in plain tokens: timed where they have been; else the stored
        cost scaled by what the timed arms show against what is stored for them (their
        stored cost, or the line through the stored arms where they have none); else a line
        through the timed arms of the same hosting mode, or its stored ones (of any mode,
        if it has none). Computed once per choice, not per arm: the policy chooses after
        every pass."""
        timed = {a: c for a in self.timed if (c := self.measured(a)) is not None}
        stored_lines: Dict[int, tuple] = {}
        ratios: Dict[bool, list] = {True: [], False: []}
        for a, c in timed.items():
            if self.stored:
                ref = self.stored[a] if a in self.stored else _on_line(self.stored, a, stored_lines)
                ratios[_hosts_streams(a)].append(math.log(c / ref))
        # Per pass kind: passes that host streams carry host work that lookup passes do not.
        scale = {kind: math.exp(sum(r) / len(r)) if r else 1.0 for kind, r in ratios.items()}
        known = {**{a: c * scale[_hosts_streams(a)] for a, c in self.stored.items()}, **timed}
        lines, out = {}, {}
        for arm in arms:
            if arm in timed:
                out[arm] = timed[arm]
            elif arm in self.stored:
                out[arm] = self.stored[arm] * scale[_hosts_streams(arm)]
            else:
                # Through the timed arms of this hosting mode, else its stored ones (a
                # calibration's budgets), else those of any mode.
                same = {a: c for a, c in timed.items() if a[1] == arm[1]}
                out[arm] = _on_line(same or known, arm, lines)
        return out


def _timing(ema: float, first: List[float], n: int, seconds: float) -> float:
    """The EMA of a kind of timing after its ``n``-th sample, ``seconds``: until ``TIME_MIN``
    samples the median of those so far (kept in ``first``), then the EMA from that median.
    A process's first pass of an arm carries its warm-up (new shapes, fresh memory): SmolLM2's
    first lookup pass took 50.8 ms against 31-37 for the next ones, and an EMA started from it
    stored 2.5 plain steps for an arm that costs 1.5-1.8, which later processes believed
    without ever timing the arm again (``tests/test_autotune.py``)."""
    if n < TIME_MIN:
        first.append(seconds)
        return statistics.median(first)
    return ema + TIME_EMA * (seconds - ema)


def _hosts_streams(arm: Arm) -> bool:
    """Whether ``arm``'s passes host streams (a negative hosting mode: lookup passes, none)."""
    return arm[1] >= 0


def _on_line(points: Dict[Arm, float], arm: Arm, lines: Dict[int, tuple]) -> float:
    """``arm``'s cost on the line through the ``points`` of its hosting mode (of every mode
    where it has none); the lines are kept in ``lines`` per mode for the next arm."""
    b, h = arm
    if h not in lines:
        same = {bb: c for (bb, hh), c in points.items() if hh == h}
        lines[h] = cost_line(same or {bb: c for (bb, _), c in points.items()})
    x0, y0, slope = lines[h]
    return max(1.0, y0 + slope * (b - x0))


def model_key(model, streams, kind: str, compiled: bool) -> str:
    """What pass costs depend on: the model's shape and dtype, the streams, the device,
    BLAS and allocator, greedy or sampled decoding, the pass kind."""
    a = model.args
    ident = [
        COST_VERSION,
        kind,
        a.model_type,
        a.hidden_size,
        a.num_hidden_layers,
        a.intermediate_size,
        a.vocab_size,
        a.num_attention_heads,
        a.num_key_value_heads,
        streams.num_streams,
        streams.config.stream_layers,
        streams.config.draft_vocab,  # the stream rows' head: the vocabulary's rows or a fraction
        str(mx.default_device()),
        blas_in_use(),
        forwarder_words(),  # the forwarder and its kernel set the plain step's and the passes' speed
        kernel_version(),  # a changed kernel times its passes afresh
        jit_words(),  # how MLX's compiled CPU kernels are built (SiLU: 12% of a 9-node pass, or 8%)
        malloc_in_use(),  # the allocator: a demo-sql step 0.59 ms under glibc's, 0.36 under jemalloc
        str(model.model.norm.weight.dtype),
        "quantized" if "Quantized" in str(type(model.layers[0].mlp.down_proj)) else "float",
        "fused" if getattr(model.layers[0].self_attn, "fused_qkv", False) else "apart",  # q/k/v: one product or three
        "compiled" if compiled else "eager",
        attention_form(model),  # MLX's fused attention or the composed one, for several rows and for one
        FORMS_VERSION,  # and the forms' arithmetic (what a pass costs changes with it)
        row_limits(model).label(),  # up to how many rows quantized weights are read as stored
    ]
    return hashlib.sha1(json.dumps(ident).encode()).hexdigest()[:16]


def calibrate(model, streams, sampled: bool, compiled: bool, hosting_modes=(0, 1), extra_arms=()) -> "ArmCosts":
    """Pass costs in plain steps measured on this machine, before any pass of a generation,
    and the plain step's seconds: bare passes of ``CALIBRATION_BUDGETS`` nodes at each
    hosting mode over bare plain steps on a synthetic prefix (:mod:`.offline_costs`). The
    generic line ``PRIOR`` was 2x too cheap for a 3M-parameter model, whose passes are host
    work (docs/DESIGN.md decision 22); run once per machine and model, its result stored."""
    from .offline_costs import measure_arm_costs

    arms = [(b, h) for h in hosting_modes for b in CALIBRATION_BUDGETS if not (h and b <= h)] + list(extra_arms)
    # Passes at their median, the plain step at its least disturbed: a first request runs
    # trees only where the prior says they pay, so it must not take a lucky pass for the
    # usual one (demo-sql's first requests ran trees 3 times in 20 on the least disturbed
    # of 3 passes, and lost up to half their speed).
    return measure_arm_costs(
        model,
        streams,
        arms,
        context=64,
        reps=CALIBRATION_REPS,
        sampled=sampled,
        compiled=compiled,
        typical_seconds=CALIBRATION_SECONDS,
    )
