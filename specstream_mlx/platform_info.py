"""Platform helpers: which BLAS MLX uses on Linux, and a report of the runtime.

MLX's Linux CPU wheel (``mlx[cpu]``) links a reference BLAS that is ~30x slower
than a real one for matrix products. Preloading a system BLAS that exports the
CBLAS symbols (Debian: ``libblis4-pthread``, ``libopenblas0-pthread``) replaces
them. Which one, with how many threads, is a measured choice
(``specstream-mlx bench-blas``; the table is in ``bench/blas.md``): on the 2-core
AVX2 machines this project is built on, OpenBLAS with two threads and one-row
products forwarded to its GEMV (below) gives SmolLM2 the fastest plain step and stays
near the best at 2-16 rows; BLIS with one thread comes next (and is ahead on tiny,
latency-bound models). ``import specstream_mlx`` loads the chosen library with
``RTLD_GLOBAL`` before anything imports ``mlx.core`` (:func:`preload_in_process`):
the symbols MLX's library looks up are then found in it first, as with
``LD_PRELOAD``, so scripts that use the library directly are as fast as the CLI. Where
that cannot happen (``mlx.core`` imported first) the first model load warns once;
the CLI then re-executes itself with ``LD_PRELOAD`` set (:func:`maybe_reexec_with_blas`).

MLX multiplies even one row by a weight with ``cblas_sgemm``, which these
libraries run through their general GEMM path, well below the memory bandwidth, also
at the 2-32 rows of a speculative tree pass. A small library of our own,
``native/gemv_forward.c`` (compiled once with the system C compiler into the user
cache, :func:`gemv_forwarder`), is preloaded in front of the BLAS: products of 2-32
rows by a weight run in its own AVX2 kernel, which reads each weight once for all rows
on a small thread pool; one-row products go to ``cblas_sgemv``, everything else to the
library unchanged.

MLX allocates every operation's output and its bookkeeping (shapes, task closures,
buffer sets) on the thread that builds the graph and frees it on the stream thread that
ran it; glibc's allocator serialises such cross-thread frees on its arena lock. A
decoding step is ~1,800 operations, and glibc's malloc took ~2-3 ms of a SmolLM2 step
here. A drop-in allocator (Debian: ``libjemalloc2``, ``libtcmalloc-minimal4``,
``libmimalloc2.0``) is preloaded with the BLAS when installed, chosen by measurement
like it (``specstream-mlx bench-blas --libraries 'openblas:2+skinny@jemalloc,...'``;
``bench/malloc.md``). An allocator replaces ``malloc`` only from a process's start, so
it comes with ``LD_PRELOAD`` alone: the CLI re-executes itself once to add it, and
``python -m specstream_mlx.blas_env`` names it for other programs.

MLX's graph-building and stream threads also take the same few mutexes for every
operation (the allocator's buffer cache, the task queue), and the C library's mutex sleeps
at the first contention. ``native/lock_spin.c``, built into the forwarder's library, defines
a ``pthread_mutex_lock`` that tries first (:func:`lock_spins`), and a ``pthread_cond_wait``
that polls for a while before it sleeps (:func:`cond_spin_us`): the graph-building thread,
up to ten scheduler tasks ahead of the stream thread, waits on a condition variable that the
stream thread would otherwise wake with a system call at every task it finishes. They serve
a process only from ``LD_PRELOAD``, so the CLI's re-execution preloads the BLAS and the
forwarder it would otherwise load on import.

Settings: ``SPECSTREAM_BLAS`` = ``openblas`` | ``blis`` |
``none`` | a library path, optionally ``:THREADS`` (``openblas:2``); the older
``SPECSTREAM_NO_OPENBLAS=1`` means ``none``. ``SPECSTREAM_BLAS_GEMV=0`` preloads the
library without the forwarder. The forwarder's kernel reads ``SPECSTREAM_SKINNY_ROWS``
(the most rows it takes, default 48 with AVX-512, else 32; 0: off),
``SPECSTREAM_SKINNY_THREADS``, ``SPECSTREAM_SKINNY_ISA=avx2``,
``SPECSTREAM_SKINNY_PARALLEL_MIN`` (the weight elements from which one row's product is
split between its threads), ``SPECSTREAM_SKINNY_PREFETCH`` = ``nta`` | ``t0`` | ``t1`` |
``off`` (how a tile prefetches the next weight rows; default ``t1``; ``nta`` from two rows
on only),
``SPECSTREAM_SKINNY_YIELD=0`` (a waiting worker pauses instead of yielding its core) and
``SPECSTREAM_SKINNY_SPIN_US`` (how long it spins before it sleeps, default 50),
``SPECSTREAM_SKINNY_KBLOCK`` (the depth block of long weights, default 512; 0: none),
``SPECSTREAM_SKINNY_FUSED_ROWS`` (up to how many rows quantized weights read as stored are
expanded in registers rather than into a buffer, 1-9, default 9),
``SPECSTREAM_SKINNY_AHEAD_KB`` (how much of the next weight a waiting worker reads ahead,
default 1024; 0: none);
``SPECSTREAM_PRODUCTS`` = ``q16`` | ``q8`` | ``exact`` (how weights read as stored are
multiplied: by the activations taken as 16-bit integers, two planes of 8-bit codes, the
default; by 8-bit activations, faster in a tree pass, coarser; or by the float32 activations,
the float32 products' bits; with integer activations a row's outputs are the same bits in any
product);
``SPECSTREAM_LOCK_SPIN`` (the tries of a contended mutex before it sleeps, default 100; 0: none),
``SPECSTREAM_COND_SPIN_US`` (how long a condition wait polls before it sleeps, default 200; 0: none).
``SPECSTREAM_MALLOC`` = ``jemalloc`` | ``tcmalloc`` | ``mimalloc`` | ``glibc`` (none
preloaded) | a library path. jemalloc comes with ``MALLOC_CONF=thp:always`` (its memory in
transparent huge pages); set ``MALLOC_CONF`` by hand (``thp:default``) to replace it.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterator, Optional, Tuple

from .cpu_jit import jit_words
from .cpu_jit import uses_mlx_cpu_wheel as _uses_mlx_cpu_wheel
from .openblas_core import CORETYPE_ENV, openblas_coretype

REEXEC_ENV = "SPECSTREAM_BLAS_REEXEC"
BLAS_ENV = "SPECSTREAM_BLAS"
DISABLE_ENV = "SPECSTREAM_NO_OPENBLAS"
GEMV_ENV = "SPECSTREAM_BLAS_GEMV"
GEMV_SOURCE = Path(__file__).parent / "native" / "gemv_forward.c"
# Built into the same library as the forwarder: mutexes that spin before they sleep.
LOCK_SOURCE = Path(__file__).parent / "native" / "lock_spin.c"
LOCK_SPIN_ENV = "SPECSTREAM_LOCK_SPIN"
COND_SPIN_ENV = "SPECSTREAM_COND_SPIN_US"


@dataclass(frozen=True)
class BlasLibrary:
    """A drop-in CBLAS the CLI can preload.

    Attributes:
        name: what ``SPECSTREAM_BLAS`` calls it.
        soname: the shared object's name, as ``ldconfig -p`` lists it.
        dirs: sub-directories of the multiarch library folder it lives in, first found wins.
        threads_env: the environment variable that sets its thread count.
        threads: the default thread count (the measured best on a 2-core machine).
        package: the Debian package that installs it.
        settings: other environment entries it is loaded with (a value set by hand wins).
    """

    name: str
    soname: str
    dirs: Tuple[str, ...]
    threads_env: str
    threads: int
    package: str
    settings: Tuple[Tuple[str, str], ...] = ()


# OpenBLAS's threads spin for 2^28 cycles (~90 ms) after each product before they sleep, so
# after a prompt's products (the kernel's are 1-48 rows; larger ones are OpenBLAS's) they
# took the cores from the first decoding steps. 2^4 cycles: they sleep at once. A 24-token
# reply after a ~290-token prompt, 4 interleaved pairs: 58.2-60.1 against 49.3-55.4 tok/s,
# the prompt as fast (506-518 against 511-525 ms; bench/README.md).
OPENBLAS_SETTINGS = (("OPENBLAS_THREAD_TIMEOUT", "4"),)


LIBRARIES: Dict[str, BlasLibrary] = {
    "blis": BlasLibrary("blis", "libblis.so.4", ("blis-pthread", ""), "BLIS_NUM_THREADS", 1, "libblis4-pthread"),
    "openblas": BlasLibrary(
        "openblas",
        "libopenblas.so.0",
        ("openblas-pthread", ""),
        "OPENBLAS_NUM_THREADS",
        2,
        "libopenblas0-pthread",
        OPENBLAS_SETTINGS,
    ),
}
# The default, then what is used when it is not installed (bench/blas.md).
PREFERENCE = ("openblas", "blis")
_LIB_ROOTS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib")

MALLOC_ENV = "SPECSTREAM_MALLOC"


@dataclass(frozen=True)
class MallocLibrary:
    """A drop-in ``malloc`` the CLI can preload (``SPECSTREAM_MALLOC`` names it), and the
    environment it is preloaded with (a value set by hand wins)."""

    name: str
    soname: str
    package: str
    settings: Tuple[Tuple[str, str], ...] = ()


# jemalloc backs its memory with transparent huge pages (where the kernel gives them on
# request, as in Debian's default ``madvise`` mode): a step reads 0.5 GB of weights and
# prefill writes large activations, through 512x fewer TLB entries and page faults (a
# SmolLM2 plain step 0.95x as long; docs/DESIGN.md, decision 36). numpy asks for them for
# its large arrays itself, so the floor's read test had them already.
MALLOCS: Dict[str, MallocLibrary] = {
    "jemalloc": MallocLibrary("jemalloc", "libjemalloc.so.2", "libjemalloc2", (("MALLOC_CONF", "thp:always"),)),
    "tcmalloc": MallocLibrary("tcmalloc", "libtcmalloc_minimal.so.4", "libtcmalloc-minimal4"),
    "mimalloc": MallocLibrary("mimalloc", "libmimalloc.so.2", "libmimalloc2.0"),
}
# The default, then what is used when it is not installed (bench/malloc.md).
MALLOC_PREFERENCE = ("jemalloc", "tcmalloc", "mimalloc")

FIX_HINT = (
    "install BLIS (Debian/Ubuntu: `apt install libblis4-pthread`) and specstream-mlx will preload it automatically"
)


@dataclass(frozen=True)
class BlasChoice:
    """A library to preload, its thread count (None: the library's default) and the
    one-row forwarder to preload in front of it (None: none)."""

    library: Optional[BlasLibrary]
    path: Optional[str]
    threads: Optional[int]
    forwarder: Optional[str] = None
    malloc: Optional[str] = None  # the allocator preloaded with it (a path), or None

    def env(self) -> Dict[str, str]:
        """Environment entries that make a new process use this BLAS (and allocator)."""
        blas = (self.forwarder, self.path) if self.path is not None else ()
        preload = [p for p in (self.malloc, *blas) if p]
        env = {"LD_PRELOAD": ":".join(preload)} if preload else {}
        if self.path is not None and self.library is not None and self.threads is not None:
            env[self.library.threads_env] = str(self.threads)
        if self.path is not None and self.library is not None:
            env.update(self.library.settings)
            if self.library.name == "openblas":  # where it took this CPU for an unknown one
                core = openblas_coretype(self.path)
                if core is not None:
                    env[CORETYPE_ENV] = core
        env.update(malloc_settings(self.malloc))
        return env


def malloc_named(file_name: str) -> Optional[MallocLibrary]:
    """The allocator a library file is (``libjemalloc.so.2`` or a versioned name of it), or None."""
    return next((m for m in MALLOCS.values() if file_name.startswith(m.soname.split(".so")[0] + ".so")), None)


def malloc_settings(path: Optional[str]) -> Dict[str, str]:
    """The environment the allocator at ``path`` is preloaded with (by its file name)."""
    lib = malloc_named(os.path.basename(path)) if path else None
    return dict(lib.settings) if lib else {}


def find_blas(name: str) -> Optional[str]:
    """Path of the named library (a key of :data:`LIBRARIES`) on this system, or None."""
    lib = LIBRARIES[name]
    for root in _LIB_ROOTS:
        for sub in lib.dirs:
            path = os.path.join(root, sub, lib.soname) if sub else os.path.join(root, lib.soname)
            if os.path.exists(path):
                return path
    try:
        out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for line in out.splitlines():
        if lib.soname in line and "=>" in line:
            path = line.split("=>", 1)[1].strip()
            if os.path.exists(path):
                return path
    return None


def find_malloc(name: str) -> Optional[str]:
    """Path of the named allocator (a key of :data:`MALLOCS`) on this system, or None."""
    lib = MALLOCS[name]
    for root in _LIB_ROOTS:
        path = os.path.join(root, lib.soname)
        if os.path.exists(path):
            return path
    return None


def choose_malloc(setting: Optional[str] = None) -> Optional[str]:
    """The allocator to preload for ``setting`` (``SPECSTREAM_MALLOC``'s syntax; None: the
    first of :data:`MALLOC_PREFERENCE` installed), as a path; None for ``glibc`` (or
    ``none``) and off Linux. A named allocator that is not installed, or a path that
    does not exist, raises :class:`BlasSettingError`."""
    if not sys.platform.startswith("linux"):
        return None
    name = (setting or "").strip()
    if not name:
        return next((p for p in map(find_malloc, MALLOC_PREFERENCE) if p), None)
    if name in ("glibc", "none"):
        return None
    if name in MALLOCS:
        path = find_malloc(name)
        if path is None:
            lib = MALLOCS[name]
            raise BlasSettingError(f"{MALLOC_ENV}={setting!r}: {lib.soname} not found; install {lib.package}")
        return path
    if os.path.sep in name:
        if not os.path.exists(name):
            raise BlasSettingError(f"{MALLOC_ENV}={setting!r}: no such file")
        return name
    known = ", ".join([*MALLOCS, "glibc"])
    raise BlasSettingError(f"{MALLOC_ENV}={setting!r}: unknown allocator; use {known} or a path")


@functools.lru_cache(maxsize=None)
def gemv_source_tag() -> str:
    """The forwarder's version: its sources' hash (what names its library, and what keys the
    measurements its kernel's speed decides)."""
    src = b"".join(p.read_bytes() for p in (GEMV_SOURCE, LOCK_SOURCE) if p.exists())
    return hashlib.sha256(src).hexdigest()[:12]


def gemv_library_path(cache_dir: Optional[Path] = None) -> Path:
    """Where :func:`gemv_forwarder` keeps this version of the library (named by its sources'
    hash, so that an upgrade builds its own), built or not."""
    if cache_dir is None:  # the user cache of converted models
        from .settings import current

        cache_dir = current().cache_dir
    return Path(cache_dir).expanduser() / "native" / f"libspecstream-gemv-{gemv_source_tag()}.so"


def gemv_forwarder(cache_dir: Optional[Path] = None) -> Optional[str]:
    """Path of the compiled one-row forwarder (``native/gemv_forward.c``, with
    ``native/lock_spin.c``'s mutexes in the same library), built once per
    source version into ``cache_dir`` (default: the user cache) with the system C
    compiler; None where it cannot be built (no compiler, no source, not Linux)."""
    sources = (GEMV_SOURCE, LOCK_SOURCE)
    if not sys.platform.startswith("linux") or not all(p.exists() for p in sources):
        return None
    out = gemv_library_path(cache_dir)
    if out.exists():
        return str(out)
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(f".{os.getpid()}.tmp")
        cmd = [cc, "-O3", "-shared", "-fPIC", *map(str, sources), "-o", str(tmp), "-ldl", "-lpthread"]
        done = subprocess.run(cmd, capture_output=True, timeout=60)
        if done.returncode != 0:
            return None
        os.replace(tmp, out)  # atomic: a concurrent process sees the old state or a whole library
    except (OSError, subprocess.SubprocessError):
        return None
    return str(out)


def find_openblas() -> Optional[str]:
    """Path of a system ``libopenblas.so.0``, or None."""
    return find_blas("openblas")


class BlasSettingError(ValueError):
    pass


def choose_blas(setting: Optional[str] = None, gemv: bool = True, malloc: Optional[str] = "glibc") -> BlasChoice:
    """The BLAS to preload for ``setting`` (``SPECSTREAM_BLAS``'s syntax; None: the
    default, the first of :data:`PREFERENCE` that is installed), with the one-row
    forwarder in front when ``gemv`` and it can be built, and the allocator that
    ``malloc`` names (:func:`choose_malloc`; None: the default one). A named library that
    is not installed, or a path that does not exist, raises :class:`BlasSettingError`;
    ``none`` preloads no BLAS."""
    choice = _choose_library(setting)
    forwarder = gemv_forwarder() if gemv and choice.path is not None else None
    return BlasChoice(choice.library, choice.path, choice.threads, forwarder, choose_malloc(malloc))


def configured_choice(malloc: bool = True) -> BlasChoice:
    """:func:`choose_blas` as this process's environment sets it (``SPECSTREAM_BLAS``,
    ``SPECSTREAM_BLAS_GEMV``, and with ``malloc`` ``SPECSTREAM_MALLOC``; without, none)."""
    for name, (unit, least, most) in NUMBER_SETTINGS.items():
        value = os.environ.get(name, "").strip()
        if value and not (value.isdigit() and least <= int(value) <= most):
            raise BlasSettingError(f"{name}={value!r}: expected {unit} from {least} to {most}")
    prefetch = os.environ.get(PREFETCH_ENV, "")
    if prefetch and prefetch not in PREFETCH_MODES:
        raise BlasSettingError(f"{PREFETCH_ENV}={prefetch!r}: expected nta, t0, t1 or off")
    products = os.environ.get(PRODUCTS_ENV, "")
    if products and products not in PRODUCTS_SETTINGS:
        raise BlasSettingError(
            f"{PRODUCTS_ENV}={products!r}: expected exact (the float32 products' bits), q8 (8-bit activations) "
            "or q16 (16-bit activations as two 8-bit planes)"
        )
    isa = os.environ.get(ISA_ENV, "")
    if isa and isa not in ("avx2", "avx512"):
        raise BlasSettingError(f"{ISA_ENV}={isa!r}: expected avx2 (AVX2 tiles where AVX-512 is there) or avx512")
    return choose_blas(
        os.environ.get(BLAS_ENV),
        gemv=os.environ.get(GEMV_ENV, "1") != "0",
        malloc=os.environ.get(MALLOC_ENV) if malloc else "glibc",
    )


def _choose_library(setting: Optional[str]) -> BlasChoice:
    if setting is None or not setting.strip():
        for name in PREFERENCE:
            path = find_blas(name)
            if path:
                return BlasChoice(LIBRARIES[name], path, LIBRARIES[name].threads)
        return BlasChoice(None, None, None)
    name, _, threads_text = setting.strip().partition(":")
    threads = None
    if threads_text:
        if not threads_text.isdigit() or int(threads_text) < 1:
            raise BlasSettingError(f"{BLAS_ENV}={setting!r}: threads must be a positive integer")
        threads = int(threads_text)
    if name == "none":
        return BlasChoice(None, None, None)
    if name in LIBRARIES:
        lib = LIBRARIES[name]
        path = find_blas(name)
        if path is None:
            raise BlasSettingError(f"{BLAS_ENV}={setting!r}: {lib.soname} not found; install {lib.package}")
        return BlasChoice(lib, path, threads or lib.threads)
    if os.path.sep in name:
        if not os.path.exists(name):
            raise BlasSettingError(f"{BLAS_ENV}={setting!r}: no such file")
        lib = next((lb for lb in LIBRARIES.values() if lb.soname.split(".")[0] in os.path.basename(name)), None)
        return BlasChoice(lib, name, threads)
    known = ", ".join([*LIBRARIES, "none"])
    raise BlasSettingError(f"{BLAS_ENV}={setting!r}: unknown library; use {known} or a path, optionally :THREADS")


def blas_preloaded() -> bool:
    """Whether a known BLAS is already in ``LD_PRELOAD`` (set by hand or by a re-exec)."""
    pre = os.environ.get("LD_PRELOAD", "")
    return any(lib.soname.split(".")[0] in pre for lib in LIBRARIES.values())


def malloc_preloaded(path: Optional[str]) -> bool:
    """Whether the allocator at ``path`` (None: none wanted) is in ``LD_PRELOAD`` already."""
    return path is None or os.path.basename(path) in os.environ.get("LD_PRELOAD", "")


GEMV_NEXT_ENV = "SPECSTREAM_GEMV_NEXT"  # the forwarder's next library when loaded in-process
_in_process: Optional[BlasChoice] = None
_warned = False


def torch_backend_requested(argv) -> bool:
    """Whether a command line asks for the torch training backend: PyTorch's CPU kernels run
    ~2x slower beside a preloaded OpenBLAS (its threads compete with PyTorch's)."""
    return "--backend=torch" in argv or any(
        a == "--backend" and argv[i + 1 : i + 2] == ["torch"] for i, a in enumerate(argv)
    )


def preload_in_process() -> Optional[BlasChoice]:
    """Load the chosen BLAS (and the one-row forwarder in front of it) with ``RTLD_GLOBAL``,
    before ``mlx.core`` is imported; returns what was loaded, or None (not the Linux CPU
    wheel, a BLAS already preloaded, ``none``, a bad setting, none installed, or too late)."""
    global _in_process
    if _in_process is not None:
        return _in_process
    if "mlx.core" in sys.modules or not _uses_mlx_cpu_wheel() or blas_preloaded():
        return None
    if os.environ.get(DISABLE_ENV) or torch_backend_requested(sys.argv[1:]):
        return None
    if any(a in ("-h", "--help") for a in sys.argv[1:]):
        return None  # a help text multiplies nothing: keep `--help` instant
    try:
        # No allocator here: one replaces malloc only from a process's start (the CLI re-executes).
        choice = configured_choice(malloc=False)
    except BlasSettingError:
        return None  # the CLI reports it (exit 2); a library user gets the load-time warning
    if choice.path is None:
        return None
    for key, value in choice.env().items():  # its thread count and settings, read when it loads
        if key != "LD_PRELOAD":
            os.environ.setdefault(key, value)  # a value set by hand wins
    os.environ[GEMV_NEXT_ENV] = choice.path
    try:
        for path in (choice.forwarder, choice.path):  # the forwarder first: it must be found first
            if path:
                ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    except OSError:
        return None
    _in_process = choice
    return choice


def warn_if_no_kernel(choice: BlasChoice) -> None:
    """One line when the product kernel was wanted in front of the BLAS but could not be built
    (no C compiler, or one that failed): decoding then ran on the BLAS alone, the plain step
    several times slower, without a word. Not where a cache it would be built in is unusable (the CLI refuses that)."""
    from .settings import current

    cache = current().cache_dir
    if (
        choice.path is None
        or choice.forwarder is not None
        or os.environ.get(GEMV_ENV, "1") == "0"
        or platform.machine() not in ("x86_64", "AMD64")
        or not sys.platform.startswith("linux")
        or (cache.exists() and not (cache.is_dir() and os.access(cache, os.W_OK)))
    ):
        return
    if shutil.which("cc") or shutil.which("gcc"):
        why, fix = "the C compiler failed on it", "check that `cc` builds shared libraries here"
    else:
        why, fix = "no C compiler (cc or gcc) was found", "install gcc (Debian/Ubuntu: `apt install gcc`)"
    print(
        f"specstream-mlx: warning: the product kernel could not be built ({why}): matrix products run on "
        f"{choice.library.name if choice.library else choice.path} alone, a decoding step several times slower; " + fix,
        file=sys.stderr,
    )


def warn_if_reference_blas() -> None:
    """Once per process: say so when MLX's CPU products run on the bundled reference BLAS."""
    global _warned
    if _warned or not _uses_mlx_cpu_wheel():
        return
    _warned = True
    if "reference" in blas_in_use() and (os.environ.get(BLAS_ENV) or "").strip().partition(":")[0] != "none":
        print(
            "specstream-mlx: warning: MLX is using its bundled reference BLAS (matrix products ~30x slower): "
            "import specstream_mlx before mlx, or start Python with "
            "`env $(python -m specstream_mlx.blas_env)`; " + FIX_HINT,
            file=sys.stderr,
        )


def maybe_reexec_with_blas(argv: Optional[list] = None) -> None:
    """Re-execute this CLI process with the chosen BLAS and allocator preloaded
    (:func:`configured_choice`).

    The BLAS: not when one is preloaded already, for ``none`` (or
    ``SPECSTREAM_NO_OPENBLAS=1``); one warning with the fix when none is installed; one
    that ``import specstream_mlx`` loaded in-process is preloaded instead, so that the
    forwarder's mutexes serve the process (:func:`lock_spins`). The allocator: whenever
    the chosen one is not preloaded yet (only a process's start can replace ``malloc``).
    Nothing off Linux, when MLX is not the CPU wheel, for ``--help`` and after one
    re-exec. A wrong setting is an error (one line, exit status 2): a library asked for by
    name is never silently replaced.
    """
    args = argv if argv is not None else sys.argv[1:]
    if not _uses_mlx_cpu_wheel() or os.environ.get(REEXEC_ENV) or any(a in ("-h", "--help") for a in args):
        return
    try:
        choice = configured_choice()
    except BlasSettingError as e:
        print(f"specstream-mlx: error: {e}", file=sys.stderr)
        sys.exit(2)
    want_blas = _in_process is None and not blas_preloaded() and not os.environ.get(DISABLE_ENV)
    if want_blas and choice.path is None:
        if (os.environ.get(BLAS_ENV) or "").strip().partition(":")[0] != "none":
            print(
                "specstream-mlx: warning: MLX is using its bundled reference BLAS "
                f"(matrix products ~30x slower); {FIX_HINT}.",
                file=sys.stderr,
            )
        want_blas = False
    if want_blas or _in_process is not None:
        warn_if_no_kernel(choice)
    want_malloc = not malloc_preloaded(choice.malloc)
    # A BLAS loaded in-process here is preloaded there, with the forwarder in front of it:
    # the forwarder's library also holds the mutexes that spin (native/lock_spin.c), which
    # replace the C library's only from LD_PRELOAD.
    preload_blas = want_blas or _in_process is not None
    if not (preload_blas or want_malloc):
        return
    malloc = choice.malloc if want_malloc else None
    if preload_blas:
        add = BlasChoice(choice.library, choice.path, choice.threads, choice.forwarder, malloc).env()
    else:
        add = BlasChoice(None, None, None, malloc=malloc).env()
    env = dict(os.environ)
    env["LD_PRELOAD"] = ":".join(p for p in (add.pop("LD_PRELOAD", ""), env.get("LD_PRELOAD", "")) if p)
    for k, v in add.items():
        env.setdefault(k, v)  # a thread count set by hand wins
    env[REEXEC_ENV] = "1"
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", "specstream_mlx", *args], env)


def _symbol(name: str):
    try:
        return getattr(ctypes.CDLL(None), name)
    except (OSError, AttributeError):
        return None


def blas_threads() -> Optional[int]:
    """Threads the preloaded BLAS uses for a matrix product (OpenBLAS and BLIS export a
    query), or None."""
    for name in ("openblas_get_num_threads", "bli_thread_get_num_threads"):
        get = _symbol(name)
        if get is not None:
            get.restype = ctypes.c_int
            n = int(get())
            # BLIS answers -1 when no count was set: it then runs one thread.
            return n if n > 0 else 1
    return None


def blas_version() -> Optional[str]:
    """The preloaded BLAS's own version string, or None."""
    get = _symbol("openblas_get_config")
    if get is not None:
        get.restype = ctypes.c_char_p
        parts = get().decode(errors="replace").split()
        return parts[1] if len(parts) > 1 and parts[0] == "OpenBLAS" else " ".join(parts[:2])
    get = _symbol("bli_info_get_version_str")
    if get is not None:
        get.restype = ctypes.c_char_p
        return get().decode(errors="replace")
    return None


def blas_core() -> Optional[str]:
    """The kernels the preloaded OpenBLAS runs on this CPU (``SkylakeX``, ``Haswell``, …;
    :mod:`.openblas_core`), or None (another library, or none)."""
    get = _symbol("openblas_get_corename")
    if get is None:
        return None
    get.restype = ctypes.c_char_p
    return get().decode(errors="replace")


def gemv_forwarding() -> bool:
    """Whether the one-row forwarder serves this process's ``cblas_sgemm``."""
    return _symbol("specstream_gemv_forward") is not None


def kernel_version() -> str:
    """The version of the forwarder serving this process's products ('' where none does): a
    measurement of their speed holds for that version only."""
    return gemv_source_tag() if gemv_forwarding() else ""


def skinny_kernel() -> Optional[Tuple[int, int, int, int]]:
    """(fewest rows, most rows, threads, vector bits) of the forwarder's own skinny-product
    kernel when it serves this process's products, else None (not preloaded, off, or no
    AVX2/FMA)."""
    info = _symbol("specstream_skinny_info")
    if info is None:
        return None
    least, rows, threads, bits = ctypes.c_int(), ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
    info(ctypes.byref(least), ctypes.byref(rows), ctypes.byref(threads), ctypes.byref(bits))
    return (least.value, rows.value, threads.value, bits.value) if rows.value > 0 else None


PREFETCH_ENV = "SPECSTREAM_SKINNY_PREFETCH"
PREFETCH_MODES = ("off", "nta", "t0", "t1")  # the kernel's codes 0-3, and PREFETCH_ENV's values
KBLOCK_ENV = "SPECSTREAM_SKINNY_KBLOCK"  # the kernel's depth block: a number of columns, 0: none
AHEAD_ENV = "SPECSTREAM_SKINNY_AHEAD_KB"  # how much of the next weight a waiting worker reads ahead
ISA_ENV = "SPECSTREAM_SKINNY_ISA"
# exact | q8 | q16: how the kernel multiplies weights read as stored (docs/DESIGN.md decision 46)
PRODUCTS_ENV = "SPECSTREAM_PRODUCTS"
PRODUCTS_SETTINGS = ("exact", "q8", "q16")  # PRODUCTS_ENV's values, by the kernel's state (q8_products)
# The native libraries' whole-number settings: what each counts, its least and its most. They
# are read in C with atoi, where a word or a negative number would leave the default, turn a
# mechanism off or run the kernel on one thread without a word (configured_choice checks).
NUMBER_SETTINGS = {
    LOCK_SPIN_ENV: ("a number of tries (0: none)", 0, 1 << 20),
    COND_SPIN_ENV: ("microseconds (0: none)", 0, 1 << 20),
    KBLOCK_ENV: ("depth columns (0: none)", 0, 1 << 20),
    AHEAD_ENV: ("KB (0: none)", 0, 1 << 20),
    "SPECSTREAM_SKINNY_ROWS": ("rows (0 or 1: the kernel off)", 0, 1 << 20),
    "SPECSTREAM_SKINNY_THREADS": ("threads", 1, 1 << 10),
    "SPECSTREAM_SKINNY_MIN_ROWS": ("rows", 1, 2),
    "SPECSTREAM_SKINNY_FUSED_ROWS": ("rows", 1, 9),
    "SPECSTREAM_SKINNY_PARALLEL_MIN": ("weight elements", 0, 1 << 40),
    "SPECSTREAM_SKINNY_SPIN_US": ("microseconds", 0, 1 << 30),
    "SPECSTREAM_SKINNY_YIELD": ("0 or 1", 0, 1),
}


def skinny_prefetch() -> Optional[str]:
    """How the skinny kernel prefetches weight rows (one of :data:`PREFETCH_MODES`;
    ``nta`` from two rows on only), or None where the kernel does not serve this process."""
    mode = _symbol("specstream_skinny_prefetch")
    code = int(mode()) if mode is not None else -1
    return PREFETCH_MODES[code] if 0 <= code < len(PREFETCH_MODES) else None


def skinny_ahead_kb() -> int:
    """How much of the next weight the skinny kernel's waiting worker reads ahead, KB (0:
    none, or where the kernel does not serve this process)."""
    kb = _symbol("specstream_skinny_ahead_kb")
    return max(int(kb()), 0) if kb is not None else 0


def q8_products() -> Optional[int]:
    """How the product kernel multiplies weights read as stored (read by the kernel itself;
    docs/DESIGN.md decision 46): 0 by the float32 activations, 1 by 8-bit ones
    (``SPECSTREAM_PRODUCTS=q8``), 2 by 16-bit ones taken as two planes of 8-bit codes
    (``SPECSTREAM_PRODUCTS=q16``); None where it cannot here (the kernel does not serve this
    process)."""
    state = _symbol("specstream_q8_state")
    code = int(state()) if state is not None else -1
    return None if code < 0 else code


def set_q8_products(planes: int) -> Optional[int]:
    """Sets the kernel's integer activations in this process: 0 off, 1 8-bit, 2 16-bit (weights
    registered while ``SPECSTREAM_PRODUCTS`` was ``q8`` or ``q16`` carry their layout); returns
    the state before (:func:`q8_products`), None where the kernel cannot use them here."""
    before = q8_products()
    fn = _symbol("specstream_q8_set")
    if before is not None and fn is not None:
        fn(ctypes.c_int(int(planes)))
    return before


def activation_words(planes: Optional[int]) -> str:
    """What :func:`q8_products`'s state multiplies stored weights by, in a few words."""
    return {1: "8-bit activations", 2: "16-bit activations (two 8-bit planes)"}.get(planes or 0, "")


def lock_spins() -> int:
    """The tries this process's mutexes make before they sleep (``native/lock_spin.c``,
    built into the forwarder's library); 0 where it is not preloaded or is turned off."""
    spins = _symbol("specstream_lock_spins")
    return int(spins()) if spins is not None else 0


def cond_spin_us() -> int:
    """How long this process's condition waits poll before they sleep, microseconds
    (``native/lock_spin.c``); 0 where it is not preloaded or is turned off."""
    spin = _symbol("specstream_cond_spin_us")
    if spin is None:
        return 0
    spin.restype = ctypes.c_long
    return int(spin())


@contextmanager
def cond_spin_paused() -> Iterator[None]:
    """Condition waits sleep at once within the block (as the C library's do), then poll as
    before: ``bench`` runs its peers so, as they run without this library."""
    setter = _symbol("specstream_cond_spin_set")
    if setter is None:
        yield
        return
    setter.argtypes, setter.restype = [ctypes.c_long], ctypes.c_long
    before = setter(0)
    try:
        yield
    finally:
        setter(before)


def forwarder_words(activations: bool = True) -> str:
    """What the forwarder's library adds to the BLAS, as a phrase for a report ('' without it);
    without ``activations``, leaving out how it multiplies weights read as stored."""
    if not gemv_forwarding():
        return ""
    spins, waits = lock_spins(), cond_spin_us()
    locks = f", mutexes spin {spins} tries" if spins else ""
    locks += f", condition waits poll {waits} us" if waits else ""
    skinny = skinny_kernel()
    if skinny is None:
        return ", one-row products as GEMV" + locks
    least, most, threads, bits = skinny
    isa = "AVX-512" if bits == 512 else "AVX2"
    gemv = ", one-row products as GEMV" if least > 1 else ""
    prefetch = skinny_prefetch()
    prefetches = f", {prefetch} prefetches" if prefetch else ""
    ahead = skinny_ahead_kb()
    if ahead and threads > 1:
        prefetches += f", {ahead} KB read ahead"
    planes = q8_products() if activations else 0
    q8 = f", {activation_words(planes)}" if planes else ""
    return f"{gemv}, {least}-{most} rows by the skinny kernel ({isa}, {threads} threads{prefetches}{q8}){locks}"


def blas_words() -> str:
    """One phrase for a report: the BLAS, its version and threads, the one-row forwarder,
    how MLX's compiled CPU kernels are built (:mod:`.cpu_jit`) and the allocator."""
    core = blas_core()
    kernels = f", {core} kernels" if core else ""
    words = f"{blas_in_use()} {blas_version()}{kernels}, {blas_threads()} threads" + forwarder_words()
    return words + f"; compiled CPU kernels {jit_words()}; allocator {malloc_in_use()}"


def _mapped_files() -> str:
    """This process's memory map (``/proc/self/maps``; empty where there is none)."""
    try:
        with open("/proc/self/maps") as f:
            return f.read()
    except OSError:
        return ""


@functools.lru_cache(maxsize=None)  # set at the process's start, never changed
def malloc_in_use() -> str:
    """Which allocator serves this process's ``malloc`` (a preloaded one, else the C library's)."""
    for line in _mapped_files().splitlines():
        lib = malloc_named(line.split("/")[-1])
        if lib is not None:
            conf = "".join(f" {k}={os.environ[k]}" for k, _ in lib.settings if os.environ.get(k))
            return f"{lib.name} ({line.split()[-1]}){conf}"
    return "glibc" if sys.platform.startswith("linux") else "system"


def blas_in_use() -> str:
    """Which BLAS serves MLX's CPU matrix products in this process."""
    if sys.platform == "darwin":
        return "accelerate"
    maps = _mapped_files()
    # A preloaded library comes first in symbol resolution, so it wins over the
    # reference BLAS that the mlx[cpu] wheel links.
    for line in maps.splitlines():
        for name in ("libblis", "libopenblas"):
            if name in line.split("/")[-1]:
                return f"{name[3:]} ({line.split()[-1]})"
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
        "blas_version": blas_version(),
        "blas_core": blas_core(),
        "blas_threads": blas_threads(),
        "blas_gemv_forwarding": gemv_forwarding(),
        "blas_forwarder": forwarder_words().lstrip(", "),
        "lock_spin": lock_spins(),
        "cond_spin_us": cond_spin_us(),
        "cpu_kernels": jit_words(),
        "malloc": malloc_in_use(),
    }


def cpu_name_from(cpuinfo: str) -> Optional[str]:
    """The CPU's name in ``/proc/cpuinfo`` text, with its x86 family and model numbers: a
    VM often shows a bare "AMD EPYC" for hosts of different generations and memory."""
    fields: Dict[str, str] = {}
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if not sep:
            if fields:
                break  # the first processor's block is enough
            continue
        fields.setdefault(key.strip(), value.strip())
    name = fields.get("model name")
    if not name:
        return None
    family, model = fields.get("cpu family"), fields.get("model")
    if family and model and family.isdigit() and model.isdigit():
        return f"{name}, family {family} model {model}"
    return name


def _cpu_name() -> str:
    if sys.platform.startswith("linux"):
        try:
            with open("/proc/cpuinfo") as f:
                name = cpu_name_from(f.read())
            if name:
                return name
        except OSError:
            pass
    return platform.processor() or platform.machine()


def print_env() -> int:
    """The environment that preloads the chosen BLAS and allocator, as VAR=value words for ``env``
    (``python -m specstream_mlx.blas_env``; the Makefile runs the tests under it)."""
    try:
        chosen = configured_choice()
    except BlasSettingError as err:
        print(f"specstream-mlx: error: {err}", file=sys.stderr)
        return 2
    env = chosen.env()
    if chosen.path is not None:
        env[GEMV_NEXT_ENV] = chosen.path
    print(" ".join(f"{k}={v}" for k, v in env.items()))
    return 0
