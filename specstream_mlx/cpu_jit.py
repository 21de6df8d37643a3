"""Inline FMA instructions in the element-wise kernels MLX compiles on the CPU (Linux wheel).

``mx.compile`` on MLX's CPU backend writes each fused element-wise kernel (SwiGLU, the
RoPE rotation, RMSNorm's arithmetic) as C++ and builds it with ``g++ -O3`` from ``PATH``,
keeping the library under ``<temp dir>/mlx/<version>/cpu``. MLX's Linux x86 wheel is built
for baseline x86-64, so every ``fma`` of those kernels' polynomial ``exp`` (SiLU, sigmoid)
is a call into libm's ``fmaf``: SiLU took 12% of a 9-node tree pass on SmolLM2 here.
Given ``-mavx2 -mfma -mf16c`` (the flags MLX adds itself when it is built for AVX2) the
compiler emits the fused multiply-adds inline and SiLU's share falls to 8%
(bench/cpu-kernels.md). The loops still ran one element at a time: ``exp`` stayed a call
(too large for GCC's default inlining) and its ``select``s stayed branches (GCC will not
evaluate both sides of a floating-point choice while operations may trap). With
``-finline-limit=100000 -fno-trapping-math`` too, SiLU's contiguous loop runs 8 lanes at a
time (a 9-node pass with streams at every node: 38.2-39.5 against 42.4 ms, interleaved).
The results are bit for bit the same: the same operations on each lane, the same fused
multiply-adds, and no other expression is contracted (``-ffp-contract=off``: without it
GCC fuses RMSNorm's multiply-adds and last bits move); a test compares the bytes, also
where ``exp`` saturates, overflows or meets a NaN.

Every kernel's source includes MLX's ``compiled_preamble.h`` (its SIMD types and every
operation's functor): parsing and instantiating it took some 0.45 of the 0.7-0.9 s each
kernel took to build here, and a first training step or a first pass compiles dozens of
kernels (a fresh test run, some 180). The wrapper precompiles that header once, with
MLX's flags and these (:func:`_pch_lines`), into the user cache, and puts its folder
first on the include path: GCC then loads the precompiled header instead and a kernel
builds in about 0.3 s, to the same machine code (compared with ``objdump``). GCC checks
that the precompiled header was built with the same code-generating options and ignores
it otherwise (the kernel then builds from the header, as before); it does not check the
header's text, so the folder is named by MLX's version and include path.

:func:`enable`, run by ``import specstream_mlx`` where the CPU has AVX2, FMA and F16C and
``g++`` exists: writes a ``g++`` script that adds the flags (and the precompiled header)
into the user cache and puts its folder first on ``PATH``, and points ``TMPDIR`` at a
folder of the user cache, so that MLX never reuses a kernel built without them by a
process that did not import this package (child processes inherit both).
``SPECSTREAM_JIT_AVX2=0`` turns it off, also where a parent process turned it on. Nothing
here touches the model path: on a Mac the kernels are Metal's, and this module does nothing.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import shlex
import shutil
import sys
from pathlib import Path
from typing import FrozenSet, Optional, Tuple

FLAGS = ("-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fno-trapping-math", "-finline-limit=100000")
# The header every kernel includes, and the flags MLX 0.32 builds kernels with besides its
# include folder and ``-shared`` (mlx/backend/cpu/jit_compiler.cpp): a precompiled header
# built with other code-generating flags is one GCC ignores.
PREAMBLE = "mlx/backend/cpu/compiled_preamble.h"
MLX_FLAGS = ("-std=c++17", "-O3", "-Wall", "-fPIC")
SETTING = "SPECSTREAM_JIT_AVX2"
# Strided kernels' inner loops rewritten to vectorise (jit_strided.py); "0": as MLX writes them.
STRIDED_SETTING = "SPECSTREAM_JIT_STRIDED"
STRIDED_REWRITER = Path(__file__).with_name("jit_strided.py")
# ... and built without errno: a square root is then one vector instruction where GCC kept
# a branch to libm's for negative inputs (only to set errno), which kept RMSNorm's loops
# from vectorising. The same values: only errno, which nothing reads, is not set.
STRIDED_FLAGS = ("-fno-math-errno",)


def _flags(strided: bool) -> tuple:
    return FLAGS + STRIDED_FLAGS if strided else FLAGS


# What enable() put in the environment and what TMPDIR was before ("" where unset), so
# that a child process that turns it off can take it out again.
_RECORD = ("SPECSTREAM_JIT_BIN", "SPECSTREAM_JIT_KERNELS", "SPECSTREAM_JIT_TMPDIR_BEFORE")
# What the CPU must offer, as /proc/cpuinfo names it, for code built with FLAGS.
_CPU_FLAGS = ("avx2", "fma", "f16c")

_enabled: Optional[Path] = None
_strided = False  # whether enable() rewrites strided kernels (jit_words says so)


@functools.lru_cache(maxsize=None)
def uses_mlx_cpu_wheel() -> bool:
    """True when the installed MLX is the Linux CPU wheel with its bundled BLAS (looked up
    in the package metadata once per process: start-up asks several times)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        from importlib.metadata import distribution

        distribution("mlx-cpu")
        return True
    except Exception:  # PackageNotFoundError and broken metadata alike
        return False


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> FrozenSet[str]:
    """The instruction-set flags of this machine's first CPU, as ``cpuinfo`` names them
    (empty where there are none to read)."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_supports(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether this CPU runs code built with :data:`FLAGS`."""
    return set(_CPU_FLAGS) <= cpu_flags(cpuinfo)


def mlx_include_dir() -> Optional[Path]:
    """The include folder of the installed MLX where it holds :data:`PREAMBLE` (found
    without importing MLX), else None."""
    try:
        spec = importlib.util.find_spec("mlx")
    except (ImportError, ValueError):
        return None
    for location in (spec.submodule_search_locations or []) if spec else []:
        folder = Path(location) / "include"
        if (folder / PREAMBLE).is_file():
            return folder
    return None


def _pch_lines(compiler: str, include: Path, flags: tuple = FLAGS) -> str:
    """Shell lines that build the precompiled :data:`PREAMBLE` at ``$gch`` once: into a file
    of this process's own, then renamed, so that a concurrent build or compile sees no file
    or a whole one; a failed build leaves none (kernels then build from the header)."""
    build = [compiler, *flags, *MLX_FLAGS, "-I", str(include), "-x", "c++-header", str(include / PREAMBLE)]
    return (
        'if [ ! -f "$gch" ]; then\n'
        f'  mkdir -p "${{gch%/*}}" && {shlex.join(build)} -o "$gch.$$" >/dev/null 2>&1 && mv -f "$gch.$$" "$gch"\n'
        '  rm -f "$gch.$$"\n'
        "fi\n"
    )


def _rewrite_lines(strided: bool) -> str:
    """Shell lines that run :mod:`.jit_strided` on a build's kernel source (every ``.cpp``:
    MLX 0.32 writes it under a temporary name; the rewriter leaves all but strided kernels
    alone), with Python's ``-S -E``: the standard library only, whatever the environment."""
    if not strided:
        return ""
    cmd = shlex.join([sys.executable, "-S", "-E", str(STRIDED_REWRITER)])
    return f'for a in "$@"; do case "$a" in *.cpp) {cmd} "$a";; esac; done\n'


def _wrapper_text(
    compiler: str, include: Optional[Path] = None, pch: Optional[Path] = None, strided: bool = False
) -> str:
    quoted = compiler.replace("'", "'\\''")
    if include is None or pch is None:
        return f"#!/bin/sh\n{_rewrite_lines(strided)}exec '{quoted}' {' '.join(_flags(strided))} \"$@\"\n"
    return (
        "#!/bin/sh\n"
        f"pch={shlex.quote(str(pch))}\n"
        f'gch="$pch/{PREAMBLE}.gch"\n'
        + _pch_lines(compiler, include, _flags(strided))
        + _rewrite_lines(strided)
        + f'exec \'{quoted}\' {" ".join(_flags(strided))} -I "$pch" "$@"\n'
    )


def write_wrapper(folder: Path, compiler: str, include: Optional[Path] = None, strided: bool = False) -> Path:
    """``folder/g++``: runs ``compiler`` with :data:`FLAGS` first; with MLX's ``include``
    folder, also with :data:`PREAMBLE` precompiled (once, under ``folder/pch``) first on the
    include path; with ``strided``, after rewriting strided kernels' inner loops
    (:mod:`.jit_strided`). Written atomically."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "g++"
    text = _wrapper_text(compiler, include, folder / "pch" if include is not None else None, strided)
    if not path.exists() or path.read_text() != text:
        tmp = folder / f".g++.{os.getpid()}.tmp"
        tmp.write_text(text)
        tmp.chmod(0o755)
        os.replace(tmp, path)  # a concurrent process sees the old wrapper or the whole new one
    return path


def enable(cache_dir: Optional[Path] = None, cpuinfo: str = "/proc/cpuinfo") -> Optional[Path]:
    """Route MLX's CPU kernel builds through the ``g++`` that adds :data:`FLAGS`; returns the
    folder the kernels are kept in (the new ``TMPDIR``), or None where nothing was turned on
    (not Linux's CPU wheel, ``SPECSTREAM_JIT_AVX2=0``, a CPU without the instructions, no
    ``g++``, an unwritable cache)."""
    global _enabled, _strided
    if _enabled is not None:
        return _enabled
    if not uses_mlx_cpu_wheel():  # Linux only
        return None
    if cache_dir is None:
        from .settings import current

        cache_dir = current().cache_dir
    cache_dir = Path(cache_dir).expanduser()
    _undo_inherited()
    if os.environ.get(SETTING, "1").strip() == "0" or not cpu_supports(cpuinfo):
        return None
    compiler = shutil.which("g++")
    if compiler is None:
        return None
    # Named by the flags: kernels built with other flags are never reused. The wrapper's
    # folder (and its precompiled header) also by MLX's include folder and version: GCC
    # would take a header precompiled from another MLX's text without a word.
    # The strided loops' rewriter by its text: kernels rewritten by another version (or not at
    # all) are never reused either.
    strided = os.environ.get(STRIDED_SETTING, "1").strip() != "0"
    rewriter = hashlib.sha256(STRIDED_REWRITER.read_bytes()).hexdigest()[:8] if strided else ""
    named = " ".join(_flags(strided)) + (f"|strided {rewriter}" if strided else "")
    tag = hashlib.sha256(named.encode()).hexdigest()[:8]
    include = mlx_include_dir()
    bin_tag = hashlib.sha256(f"{tag}|{include}|{_mlx_version()}".encode()).hexdigest()[:8]
    folder, kernels = cache_dir / "native" / f"jit-bin-{bin_tag}", cache_dir / f"jit-tmp-{tag}"
    try:
        write_wrapper(folder, compiler, include, strided)
        kernels.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    for key, value in zip(_RECORD, (str(folder), str(kernels), os.environ.get("TMPDIR", ""))):
        os.environ[key] = value
    os.environ["PATH"] = os.pathsep.join([str(folder), os.environ.get("PATH", "")])
    os.environ["TMPDIR"] = str(kernels)
    _enabled, _strided = kernels, strided
    return kernels


def _mlx_version() -> str:
    try:
        from importlib.metadata import version

        return version("mlx")
    except Exception:  # PackageNotFoundError and broken metadata alike
        return "unknown"


def _undo_inherited() -> None:
    """Take out what a parent process's :func:`enable` put in the environment."""
    folder, kernels, before = (os.environ.pop(key, None) for key in _RECORD)
    path = os.environ.get("PATH", "").split(os.pathsep)
    if folder and folder in path:
        os.environ["PATH"] = os.pathsep.join(d for d in path if d != folder)
    if kernels and os.environ.get("TMPDIR") == kernels:
        if before:
            os.environ["TMPDIR"] = before
        else:
            del os.environ["TMPDIR"]


def builds_in_use() -> Tuple[Optional[Path], Optional[Path]]:
    """The wrapper's folder and the kernels' folder :func:`enable` chose in this process;
    (None, None) where it turned nothing on."""
    if _enabled is None:
        return None, None
    folder = os.environ.get(_RECORD[0])
    return (Path(folder) if folder else None), _enabled


def jit_words() -> str:
    """How MLX's compiled CPU kernels are built in this process, as a phrase for a report."""
    if _enabled is not None:
        return "built with " + " ".join(_flags(_strided)) + (", strided loops vectorised" if _strided else "")
    return "MLX's own build flags"
