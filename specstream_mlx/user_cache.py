"""What the user cache holds, and which of its builds nothing here uses any more.

The user cache (``~/.cache/specstream-mlx`` or ``SPECSTREAM_MLX_CACHE``) keeps converted
models, learned measurements (pass costs, attention choices, stored-row limits, weight
fingerprints) and, on Linux's CPU wheel, native builds: the product kernel (one library per
version of its sources), the ``g++`` wrapper with MLX's precompiled kernel header (~50 MB per MLX
installation, named by its include folder, version and flags: :mod:`.cpu_jit`) and the
folder MLX compiles its kernels into. An upgrade, a new virtual environment or another MLX
makes new builds and leaves the old ones where they were; :func:`prune` removes the builds
this installation does not use. They are only ever caches: another installation that
needs its own again rebuilds it when it next starts (seconds). Models and measurements
are never pruned.
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, List, Optional, Sequence, Tuple

MODEL = "model"
WRAPPER = "kernel header"  # native/jit-bin-*: the g++ wrapper and MLX's precompiled header
KERNELS = "MLX kernel folder"  # jit-tmp-*: MLX's compiled CPU kernels (and this process's TMPDIR)
PRODUCTS = "product kernel"  # native/libspecstream-gemv-*.so
MEASUREMENTS = "measurements"
OTHER = "other"
BUILDS = (WRAPPER, KERNELS, PRODUCTS)

_INCLUDE = re.compile(r"-I (\S+)")


@dataclass(frozen=True)
class CacheEntry:
    """One thing in the user cache: ``kind`` one of the names above, ``nbytes`` its files'
    sizes, ``in_use`` whether this installation uses it (models and measurements always),
    ``built_for`` the MLX include folder a kernel header was precompiled from."""

    path: Path
    kind: str
    nbytes: int
    in_use: bool
    built_for: Optional[Path] = None

    @property
    def prunable(self) -> bool:
        return self.kind in BUILDS and not self.in_use

    @property
    def gone(self) -> bool:
        """Built for an MLX installation that no longer exists (nothing can use it again)."""
        return self.built_for is not None and not self.built_for.exists()


def _size(path: Path) -> int:
    if path.is_symlink() or not path.is_dir():
        try:
            return path.lstat().st_size
        except OSError:
            return 0
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:  # removed while we looked
                pass
    return total


def _built_for(folder: Path) -> Optional[Path]:
    """The MLX include folder a wrapper's header is precompiled from (None: no wrapper, or
    one without a precompiled header)."""
    try:
        found = _INCLUDE.search((folder / "g++").read_text())
    except OSError:
        return None
    return Path(found.group(1)) if found else None


def _kind(path: Path) -> str:
    name = path.name
    if path.is_dir() and (path / "config.json").exists():
        return MODEL
    if path.is_dir() and name.startswith("jit-tmp-"):
        return KERNELS
    if path.suffix == ".json":
        return MEASUREMENTS
    return OTHER


def _native_kind(path: Path) -> str:
    if path.is_dir() and path.name.startswith("jit-bin-"):
        return WRAPPER
    if path.name.startswith("libspecstream-gemv-") and path.suffix == ".so":
        return PRODUCTS
    return MEASUREMENTS if path.is_file() else OTHER  # e.g. the BLAS core this CPU was found to take


def inventory(cache_dir: Path, in_use: Iterable[Optional[Path]]) -> List[CacheEntry]:
    """Everything at the cache's top level and in its ``native`` folder, sorted by kind and
    path; ``in_use``: the builds this installation uses (None entries ignored)."""
    cache_dir = Path(cache_dir)
    used = {Path(p).resolve() for p in in_use if p is not None}
    entries = []
    if not cache_dir.is_dir():
        return entries
    for path in sorted(cache_dir.iterdir()):
        if path.name.startswith("."):  # a conversion's lock file
            continue
        if path.name == "native" and path.is_dir():
            for inner in sorted(path.iterdir()):
                kind = _native_kind(inner)
                built_for = _built_for(inner) if kind == WRAPPER else None
                entries.append(
                    CacheEntry(inner, kind, _size(inner), kind not in BUILDS or inner.resolve() in used, built_for)
                )
            continue
        kind = _kind(path)
        entries.append(CacheEntry(path, kind, _size(path), kind not in BUILDS or path.resolve() in used))
    order = {k: i for i, k in enumerate((MODEL, MEASUREMENTS, WRAPPER, KERNELS, PRODUCTS, OTHER))}
    return sorted(entries, key=lambda e: (order[e.kind], str(e.path)))


def prune(entries: Sequence[CacheEntry]) -> Tuple[int, List[Tuple[Path, str]]]:
    """Removes every prunable entry; returns (bytes freed, [(path, why) not removed])."""
    freed, failed = 0, []
    for e in entries:
        if not e.prunable:
            continue
        try:
            if e.path.is_dir() and not e.path.is_symlink():
                shutil.rmtree(e.path)
            else:
                e.path.unlink()
            freed += e.nbytes
        except OSError as err:
            failed.append((e.path, err.strerror or str(err)))
    return freed, failed


def stale_words(stale: Sequence[CacheEntry]) -> str:
    """'12 kernel headers (609.6 MB; 3 for MLX installations that are gone), ...'."""
    parts = []
    for kind in BUILDS:
        these = [e for e in stale if e.kind == kind]
        if not these:
            continue
        gone = sum(e.gone for e in these)
        extra = f"; {gone} for MLX installations that are gone" if gone else ""
        parts.append(
            f"{len(these)} {kind}{'s' if len(these) > 1 else ''} ({human(sum(e.nbytes for e in these))}{extra})"
        )
    return ", ".join(parts)


def human(nbytes: int) -> str:
    """1,536 -> '1.5 KB' (decimal units, as ``du --si``)."""
    value = float(nbytes)
    for unit in ("B", "KB", "MB"):
        if value < 1000:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    return f"{value:.1f} GB"


def builds_in_use() -> List[Optional[Path]]:
    """The builds this process uses: the kernel header's and MLX kernels' folders that
    ``import specstream_mlx`` chose (:func:`.cpu_jit.enable`; None where it chose none)
    and this version's product kernel."""
    from .cpu_jit import builds_in_use as jit_builds
    from .platform_info import gemv_library_path

    return [*jit_builds(), gemv_library_path()]
