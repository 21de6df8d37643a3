"""Which kernels OpenBLAS runs on this CPU, and the ones it is told to run where it guesses wrong.

A ``DYNAMIC_ARCH`` build of OpenBLAS (Debian's) picks its kernels when it loads, by the
CPU's family and model. A CPU newer than the library is not in its table and gets the
generic x86-64 kernels it falls back to, ``Prescott`` (SSE3), whatever the CPU can do:
Debian's OpenBLAS 0.3.21 on an Intel Xeon of model 207 (Emerald Rapids, AVX-512) ran a
512 x 576 x 1536 product in 13.9 ms with them against 3.2 ms with its ``SkylakeX``
kernels (5.8 ms with ``Haswell``'s), and a 512-token SmolLM2 prompt in 2.56 s against
0.99 s. Decoding's products of 1-48 rows run in the project's own kernel; OpenBLAS runs
every larger one: prompts, training, the draft head of wide trees.

So where OpenBLAS's own choice is that fallback, it is loaded with ``OPENBLAS_CORETYPE``
naming the best kernels it has for the instructions the CPU reports: ``SkylakeX`` with
AVX-512 (F, CD, BW, DQ, VL), ``Haswell`` with AVX2 and FMA. Any other choice of its own is
kept, and so is an ``OPENBLAS_CORETYPE`` set by hand. OpenBLAS's choice is found once per
library file and CPU by loading the library in a short child process (no product runs
there), and kept in the user cache.
"""

from __future__ import annotations

import functools
import hashlib
import os
import subprocess
import sys
from pathlib import Path
from typing import FrozenSet, Optional

from .cpu_jit import cpu_flags

CORETYPE_ENV = "OPENBLAS_CORETYPE"
# What a DYNAMIC_ARCH OpenBLAS falls back to on an x86-64 CPU it does not know.
FALLBACK_CORE = "prescott"
AVX512 = frozenset({"avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl"})
AVX2 = frozenset({"avx2", "fma"})

# Run in the child: load the library, print the kernels it chose. Nothing else is imported.
_PROBE = (
    "import ctypes, sys\n"
    "lib = ctypes.CDLL(sys.argv[1])\n"
    "lib.openblas_get_corename.restype = ctypes.c_char_p\n"
    "print(lib.openblas_get_corename().decode())\n"
)


def core_for(flags: FrozenSet[str]) -> Optional[str]:
    """The OpenBLAS kernels for a CPU with these instruction-set ``flags`` (``/proc/cpuinfo``
    spelling), or None where the fallback is all it has."""
    if AVX512 <= flags:
        return "SkylakeX"
    if AVX2 <= flags:
        return "Haswell"
    return None


def coretype_setting(detected: Optional[str], flags: FrozenSet[str]) -> Optional[str]:
    """The ``OPENBLAS_CORETYPE`` to load OpenBLAS with, given the kernels it chose by itself
    (``detected``; None: unknown) and the CPU's ``flags``; None keeps its choice."""
    if detected is None or detected.strip().lower() != FALLBACK_CORE:
        return None
    return core_for(flags)


def detected_core(path: str, cache_dir: Path, flags: FrozenSet[str]) -> Optional[str]:
    """The kernels the OpenBLAS at ``path`` picks by itself on this CPU, from the cache or
    else from a child process that loads it (None where it cannot tell)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    key = f"{os.path.realpath(path)}\0{st.st_size}\0{st.st_mtime_ns}\0{' '.join(sorted(flags))}"
    record = Path(cache_dir).expanduser() / "native" / f"openblas-core-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
    try:
        return record.read_text().strip() or None
    except OSError:
        pass
    env = {k: v for k, v in os.environ.items() if k not in (CORETYPE_ENV, "LD_PRELOAD")}
    env["OPENBLAS_NUM_THREADS"] = "1"
    try:
        done = subprocess.run(
            [sys.executable, "-S", "-c", _PROBE, path], capture_output=True, text=True, timeout=30, env=env
        )
    except (OSError, subprocess.SubprocessError):
        return None
    name = done.stdout.strip()
    if done.returncode != 0 or not name or len(name) > 40:
        return None
    try:
        record.parent.mkdir(parents=True, exist_ok=True)
        tmp = record.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(name + "\n")
        os.replace(tmp, record)  # atomic: a concurrent process reads a whole name or none
    except OSError:
        pass  # not kept: the next process asks again
    return name


def openblas_coretype(path: str) -> Optional[str]:
    """The ``OPENBLAS_CORETYPE`` the OpenBLAS at ``path`` is to be loaded with on this
    machine: the one this process has (set by hand, or by its own import of this package),
    else the one named here; None where its own choice stands."""
    if os.environ.get(CORETYPE_ENV):
        return os.environ[CORETYPE_ENV]
    if not sys.platform.startswith("linux"):
        return None
    return _machine_coretype(path)


@functools.lru_cache(maxsize=None)  # a fact of the library file and the machine
def _machine_coretype(path: str) -> Optional[str]:
    flags = cpu_flags()
    if core_for(flags) is None:
        return None  # nothing better to name: no need to ask
    from .settings import current

    return coretype_setting(detected_core(path, current().cache_dir, flags), flags)
