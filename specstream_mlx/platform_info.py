"""Platform helpers: which BLAS MLX uses on Linux, and a report of the runtime.

MLX's Linux CPU wheel (``mlx[cpu]``) links a reference BLAS that is ~30x slower
than OpenBLAS for matrix products. Preloading the system OpenBLAS (Debian:
``libopenblas0-pthread``) replaces those symbols. A process cannot preload a
library after it has started, so the CLI re-executes itself once with
``LD_PRELOAD`` set (:func:`maybe_reexec_with_openblas`).
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from typing import Optional

REEXEC_ENV = "SPECSTREAM_BLAS_REEXEC"
DISABLE_ENV = "SPECSTREAM_NO_OPENBLAS"

_OPENBLAS_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
)

FIX_HINT = (
    "install OpenBLAS (Debian/Ubuntu: `apt install libopenblas0-pthread`) and "
    "specstream-mlx will preload it automatically"
)


def find_openblas() -> Optional[str]:
    """Path of a system ``libopenblas.so.0``, or None."""
    for path in _OPENBLAS_CANDIDATES:
        if os.path.exists(path):
            return path
    try:
        out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for line in out.splitlines():
        if "libopenblas.so.0" in line and "=>" in line:
            path = line.split("=>", 1)[1].strip()
            if os.path.exists(path):
                return path
    return None


def _uses_mlx_cpu_wheel() -> bool:
    """True when the installed MLX is the Linux CPU wheel with its bundled BLAS."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        from importlib.metadata import distribution

        distribution("mlx-cpu")
        return True
    except Exception:  # PackageNotFoundError and broken metadata alike
        return False


def openblas_preloaded() -> bool:
    return "openblas" in os.environ.get("LD_PRELOAD", "")


def maybe_reexec_with_openblas(argv: Optional[list[str]] = None) -> None:
    """Re-execute this CLI process with the system OpenBLAS preloaded.

    Does nothing off Linux, when MLX is not the CPU wheel, when OpenBLAS is
    already preloaded, when ``SPECSTREAM_NO_OPENBLAS=1`` or after one re-exec.
    Prints one warning with the fix when no OpenBLAS is installed.
    """
    if not _uses_mlx_cpu_wheel() or openblas_preloaded():
        return
    if os.environ.get(DISABLE_ENV) or os.environ.get(REEXEC_ENV):
        return
    lib = find_openblas()
    if lib is None:
        print(
            "specstream-mlx: warning: MLX is using its bundled reference BLAS "
            f"(matrix products ~30x slower); {FIX_HINT}.",
            file=sys.stderr,
        )
        return
    env = dict(os.environ)
    env["LD_PRELOAD"] = ":".join(p for p in (lib, env.get("LD_PRELOAD", "")) if p)
    env[REEXEC_ENV] = "1"
    args = argv if argv is not None else sys.argv[1:]
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", "specstream_mlx", *args], env)


def blas_threads() -> Optional[int]:
    """Threads the BLAS in this process uses for a matrix product (OpenBLAS, which a
    preloaded OpenBLAS exports a query for), or None."""
    import ctypes

    try:
        get = ctypes.CDLL(None).openblas_get_num_threads
    except (OSError, AttributeError):
        return None
    get.restype = ctypes.c_int
    return int(get())


def blas_in_use() -> str:
    """Which BLAS serves MLX's CPU matrix products in this process."""
    if sys.platform == "darwin":
        return "accelerate"
    maps = ""
    try:
        with open("/proc/self/maps") as f:
            maps = f.read()
    except OSError:
        pass
    # A preloaded OpenBLAS comes first in symbol resolution, so it wins over the
    # reference BLAS that the mlx[cpu] wheel links.
    for line in maps.splitlines():
        if "libopenblas" in line:
            return f"openblas ({line.split()[-1]})"
    if "mlx_cpu.libs/libblas" in maps:
        return "reference (bundled with mlx[cpu]; slow)"
    return "unknown"


def runtime_info() -> dict:
    """Versions, device and BLAS, for --version, doctor and benchmarks."""
    import mlx.core as mx

    from . import __version__

    try:
        import mlx_lm

        mlx_lm_version = mlx_lm.__version__
    except Exception:
        mlx_lm_version = "not installed"
    device = mx.default_device()
    return {
        "specstream_mlx": __version__,
        "mlx": mx.__version__,
        "mlx_lm": mlx_lm_version,
        "python": platform.python_version(),
        "os": f"{platform.system()} {platform.release()}",
        "machine": platform.machine(),
        "cpu": _cpu_name(),
        "cores": os.cpu_count(),
        "device": str(device),
        "metal_available": bool(getattr(mx, "metal", None) and mx.metal.is_available()),
        "blas": blas_in_use(),
        "blas_threads": blas_threads(),
    }


def _cpu_name() -> str:
    if sys.platform.startswith("linux"):
        try:
            with open("/proc/cpuinfo") as f:
                for line in f:
                    if line.startswith("model name"):
                        return line.split(":", 1)[1].strip()
        except OSError:
            pass
    return platform.processor() or platform.machine()
