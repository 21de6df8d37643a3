"""The settings the environment can give, read in one place.

==========================  ====================================================================
``SPECSTREAM_MLX_CACHE``    the user cache: converted bundled models, ``--tree auto``'s learned
                            step costs (``step_costs.json``), the attention form and the
                            stored-row limits measured here (``attention.json``,
                            ``stored_rows.json``), base-model fingerprints, the
                            compiled one-row GEMV forwarder and MLX's compiled CPU kernels
                            (``jit-tmp-*``, with the ``g++`` that builds them and the
                            header it precompiles, under ``native/``). Default
                            ``$XDG_CACHE_HOME/specstream-mlx``, else ``~/.cache/specstream-mlx``.
``SPECSTREAM_COMPILE``      ``1``: speculative passes run as compiled graphs (one per tree
                            shape); default op by op (docs/DESIGN.md, decision 18).
``SPECSTREAM_FUSE``         ``0``: decoding keeps each layer's q/k/v and gate/up products apart
                            as stored; default fused at load (docs/DESIGN.md, decision 35).
``SPECSTREAM_STORED``       ``0``: the CPU product kernel reads a quantized model's weights as
                            expanded to float32; default it reads their stored 4/8-bit form
                            where it can (docs/DESIGN.md, decision 43).
``SPECSTREAM_STORED_ROWS``  up to how many rows a product reads a weight as stored (more rows
                            read the float32 weight: the same bits); default ``auto``, measured
                            here once per model shape (docs/DESIGN.md, decision 45).
``SPECSTREAM_ATTENTION``    how queries attend: ``fused``, ``composed`` or ``auto`` (default:
                            the form measured faster here, for several query rows and for one;
                            docs/DESIGN.md, decision 37).
==========================  ====================================================================

The BLAS settings (``SPECSTREAM_BLAS``, ``SPECSTREAM_NO_OPENBLAS``, thread counts) act before
MLX is imported and are read by :mod:`specstream_mlx.blas_env` (docs/USAGE.md);
``SPECSTREAM_JIT_AVX2=0`` (MLX's compiled CPU kernels built with MLX's own flags) acts at
``import specstream_mlx`` and is read by :mod:`specstream_mlx.cpu_jit`. Everything
else takes its setting as an argument; :func:`current` is read at each use, so a test or a
caller that changes the environment is seen. The switches among them take 0 or 1 only, and the
cache must be a folder that can be made and written; the CLI refuses anything else before it
runs (:func:`check`).
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional


@dataclass(frozen=True)
class Settings:
    """What :func:`current` found.

    Attributes:
        cache_dir: the user cache directory (not created here).
        compile_passes: run speculative passes as compiled graphs.
        fuse_projections: fuse q/k/v and gate/up at load for decoding.
        stored_weights: let the CPU product kernel read quantized weights as stored.
        stored_rows: up to how many rows it reads them so, as given (``auto``: measured;
            checked where it is used, :func:`specstream_mlx.runtime.stored_rows.configured_rows`).
        attention: the attention form, as given (checked where it is used,
            :func:`specstream_mlx.runtime.attention_choice.configured_form`).
    """

    cache_dir: Path
    compile_passes: bool
    fuse_projections: bool = True
    attention: str = "auto"
    stored_weights: bool = True
    stored_rows: str = "auto"


# The settings that are switches: read as "1" / "0" where they are used, so any other value
# would be taken for the default without a word (``check`` refuses it first).
SWITCHES = (
    "SPECSTREAM_COMPILE",
    "SPECSTREAM_FUSE",
    "SPECSTREAM_JIT_AVX2",
    "SPECSTREAM_JIT_STRIDED",
    "SPECSTREAM_STORED",
)


def check() -> None:
    """Raises ValueError naming a switch (:data:`SWITCHES`) set to anything but 0 or 1, or a
    cache folder that cannot be made or written: without one the product kernel and the
    compiled kernels' flags could not be built and decoding ran several times slower, the
    bundled model failed to convert, and neither said why."""
    for name in SWITCHES:
        value = os.environ.get(name, "").strip()
        if value not in ("", "0", "1"):
            raise ValueError(f"{name}={value!r}: expected 0 or 1")
    stored_rows_count(current().stored_rows)
    cache = current().cache_dir
    what = (
        f"SPECSTREAM_MLX_CACHE={os.environ['SPECSTREAM_MLX_CACHE']}"
        if os.environ.get("SPECSTREAM_MLX_CACHE")
        else cache
    )
    try:
        cache.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=cache, prefix=".probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        above = next((p for p in [cache, *cache.parents] if p.exists()), None)
        why = f"{above} is not a folder" if above is not None and not above.is_dir() else e.strerror or str(e)
        raise ValueError(f"{what}: the cache folder cannot be made or written ({why})") from None


def stored_rows_count(value: str) -> Optional[int]:
    """``SPECSTREAM_STORED_ROWS`` as given (``Settings.stored_rows``): None for ``auto``, else
    its row count; ValueError naming the setting for anything else."""
    if value == "auto":
        return None
    if not value.isdigit():
        raise ValueError(f"SPECSTREAM_STORED_ROWS={value!r}: expected auto or a row count (0 or more)")
    return int(value)


def current() -> Settings:
    """The settings the environment gives now."""
    env = os.environ.get("SPECSTREAM_MLX_CACHE")
    if env:
        cache = Path(env).expanduser()
    else:
        xdg = os.environ.get("XDG_CACHE_HOME")
        cache = (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "specstream-mlx"
    return Settings(
        cache_dir=cache,
        compile_passes=os.environ.get("SPECSTREAM_COMPILE", "").strip() == "1",
        fuse_projections=os.environ.get("SPECSTREAM_FUSE", "").strip() != "0",
        attention=os.environ.get("SPECSTREAM_ATTENTION", "").strip() or "auto",
        stored_weights=os.environ.get("SPECSTREAM_STORED", "").strip() != "0",
        stored_rows=os.environ.get("SPECSTREAM_STORED_ROWS", "").strip() or "auto",
    )
