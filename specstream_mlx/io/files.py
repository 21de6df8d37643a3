"""The files of a model directory besides weights, and atomic directory writes."""

from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "generation_config.json",
    "chat_template.jinja",
    "chat_template.json",
)


def copy_tokenizer_files(src: Path, dst: Path) -> None:
    for name in TOKENIZER_FILES:
        if (Path(src) / name).exists():
            shutil.copy2(Path(src) / name, Path(dst) / name)


def clean_stale_temporaries(parent: Path, prefixes) -> int:
    """Remove temporaries a killed run left in ``parent`` (names starting with one of
    ``prefixes``); returns how many. Runs never share these names, so whatever a
    new run finds there is a leftover."""
    removed = 0
    parent = Path(parent)
    if not parent.is_dir():
        return 0
    for f in parent.iterdir():
        if f.name.startswith(tuple(prefixes)) and f.is_dir():
            shutil.rmtree(f, ignore_errors=True)
            removed += 1
    return removed


# What a directory holds that a run of ours may replace as a whole: a model (config.json),
# or a training run's checkpoints. Anything else is the user's and is never deleted.
REPLACEABLE_MARKERS = ("config.json", "checkpoint", "checkpoint.old")


def replaceable(dst: Path) -> bool:
    """``dst`` is a directory that ``--force`` may replace: empty, or one of ours."""
    dst = Path(dst)
    return dst.is_dir() and (not any(dst.iterdir()) or any((dst / m).exists() for m in REPLACEABLE_MARKERS))


def check_replaceable(dst: Path, force: bool, error) -> None:
    """Raise ``error(message)`` unless writing a new directory at ``dst`` is allowed."""
    dst = Path(dst)
    if not dst.exists():
        return
    if not dst.is_dir():
        raise error(f"{dst}: exists and is not a directory; refusing to replace it")
    if not force:
        raise error(f"{dst}: already exists; pass --force to overwrite it")
    if not replaceable(dst):
        raise error(
            f"{dst}: exists and is not a model directory (no config.json); --force only replaces model "
            "directories, so choose another path or remove it yourself"
        )


@contextmanager
def atomic_directory(dst: Path, force: bool, exists_error) -> Iterator[Path]:
    """Yield a temporary sibling of ``dst`` to fill; on success it replaces
    ``dst`` by rename, on any failure (Ctrl-C included) it is removed, so a
    crash never leaves a half-written directory at ``dst``.

    ``exists_error(message)`` builds the exception raised when ``dst`` exists
    and ``force`` is False."""
    dst = Path(dst)
    check_replaceable(dst, force, exists_error)
    dst.parent.mkdir(parents=True, exist_ok=True)
    # Leftovers of an earlier run into the same destination that was killed (kill -9).
    clean_stale_temporaries(dst.parent, (f".{dst.name}.tmp-", f".{dst.name}.old-"))
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.tmp-", dir=dst.parent))
    # mkdtemp makes the directory private (0700); the result gets the usual mode.
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)
    try:
        yield tmp
        if dst.exists():
            check_replaceable(dst, force, exists_error)  # it may have appeared meanwhile
            old = dst.with_name(f".{dst.name}.old-{os.getpid()}")
            os.rename(dst, old)
            os.rename(tmp, dst)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
