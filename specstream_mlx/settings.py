"""The settings the environment can give, read in one place.

========================  ====================================================================
``SPECSTREAM_MLX_CACHE``  the user cache: converted bundled models, ``--tree auto``'s learned
                          step costs (``step_costs.json``), the attention form measured
                          here (``attention.json``), base-model fingerprints, the
                          compiled one-row GEMV forwarder and MLX's compiled CPU kernels
                          (``jit-tmp-*``, with the ``g++`` that builds them and the
                          header it precompiles, under ``native/``). Default
                          ``$XDG_CACHE_HOME/specstream-mlx``, else ``~/.cache/specstream-mlx``.
``SPECSTREAM_COMPILE``    ``1``: speculative passes run as compiled graphs (one per tree
                          shape); default op by op (docs/DESIGN.md, decision 18).
``SPECSTREAM_FUSE``       ``0``: decoding keeps each layer's q/k/v and gate/up products apart
                          as stored; default fused at load (docs/DESIGN.md, decision 35).
``SPECSTREAM_ATTENTION``  how queries attend: ``fused``, ``composed`` or ``auto`` (default:
                          the form measured faster here, for several query rows and for one;
                          docs/DESIGN.md, decision 37).
========================  ====================================================================

The BLAS settings (``SPECSTREAM_BLAS``, ``SPECSTREAM_NO_OPENBLAS``, thread counts) act before
MLX is imported and are read by :mod:`specstream_mlx.blas_env` (docs/USAGE.md);
``SPECSTREAM_JIT_AVX2=0`` (MLX's compiled CPU kernels built with MLX's own flags) acts at
``import specstream_mlx`` and is read by :mod:`specstream_mlx.cpu_jit`. Everything
else takes its setting as an argument; :func:`current` is read at each use, so a test or a
caller that changes the environment is seen. The switches among them take 0 or 1 only; the
CLI refuses any other value before it runs (:func:`check`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Settings:
    """What :func:`current` found.

    Attributes:
        cache_dir: the user cache directory (not created here).
        compile_passes: run speculative passes as compiled graphs.
        fuse_projections: fuse q/k/v and gate/up at load for decoding.
        attention: the attention form, as given (checked where it is used,
            :func:`specstream_mlx.runtime.attention_choice.configured_form`).
    """

    cache_dir: Path
    compile_passes: bool
    fuse_projections: bool = True
    attention: str = "auto"


# The settings that are switches: read as "1" / "0" where they are used, so any other value
# would be taken for the default without a word (``check`` refuses it first).
SWITCHES = ("SPECSTREAM_COMPILE", "SPECSTREAM_FUSE", "SPECSTREAM_JIT_AVX2", "SPECSTREAM_JIT_STRIDED")


def check() -> None:
    """Raises ValueError naming a switch (:data:`SWITCHES`) set to anything but 0 or 1."""
    for name in SWITCHES:
        value = os.environ.get(name, "").strip()
        if value not in ("", "0", "1"):
            raise ValueError(f"{name}={value!r}: expected 0 or 1")


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
    )
