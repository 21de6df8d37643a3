"""The files of a model directory besides weights, and atomic directory writes."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

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


# What a directory of ours holds, and so what ``--force`` may replace: the files of a model
# directory (Hugging Face or MLX layout, with streams, adapters, logs and bench prompts), a
# training run's checkpoints, and our own temporaries. A directory holding anything else is
# the user's and is never deleted, whatever else it holds (a project with a config.json).
MODEL_DIRECTORY_FILES = frozenset(
    TOKENIZER_FILES
    + (
        "config.json",
        "specstream.json",
        "training_log.json",
        "pretrain_log.json",
        "adapter_config.json",
        "bundle.json",
        "bundle-source.json",
        "bench_prompts.jsonl",
        "step_costs.json",
        "exact_match.json",
        "tools.json",
        "model.safetensors.index.json",
        "tokenizer.ggml.model",
        "README.md",
        ".gitattributes",
        "LICENSE",
    )
)
CHECKPOINT_DIRECTORIES = frozenset(("checkpoint", "checkpoint.old"))
CHECKPOINT_FILES = frozenset(("trainable.safetensors", "optimizer.safetensors", "state.json"))
OUR_TEMPORARIES = (".ckpt-", ".model-", ".tmp-", ".old-")


def _ours(entry: Path, in_checkpoint: bool = False) -> bool:
    name = entry.name
    if entry.is_symlink():
        return False
    if entry.is_dir():
        if in_checkpoint:
            return False
        if name in CHECKPOINT_DIRECTORIES or (name.startswith(".") and any(p in name for p in OUR_TEMPORARIES)):
            return all(_ours(e, in_checkpoint=True) for e in entry.iterdir())
        return False
    if in_checkpoint:
        return name in CHECKPOINT_FILES
    return name in MODEL_DIRECTORY_FILES or name.endswith(".safetensors")


def unrecognised_entry(dst: Path) -> Optional[str]:
    """The first entry of directory ``dst`` that no tool of ours writes, or None."""
    for entry in sorted(Path(dst).iterdir()):
        if not _ours(entry):
            return entry.name + ("/" if entry.is_dir() else "")
    return None


def replaceable(dst: Path) -> bool:
    """``dst`` is a directory that ``--force`` may replace: empty, or holding only what ours hold."""
    dst = Path(dst)
    return dst.is_dir() and not dst.is_symlink() and unrecognised_entry(dst) is None


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
        what = unrecognised_entry(dst) if dst.is_dir() and not dst.is_symlink() else None
        raise error(
            f"{dst}: exists and is not a model directory (it holds {what or 'a symlink'}, which no model "
            "directory does); --force only replaces model directories, so choose another path or remove it yourself"
        )


def _directory_beside(dst: Path, error, clean: bool = False) -> Path:
    """A new private directory beside ``dst``, its parents made; ``error(message)``, one line,
    where none can be made (a read-only or virtual file system, a parent that is a file).
    ``clean``: first remove what a killed run into the same ``dst`` left there."""
    try:
        dst.parent.mkdir(parents=True, exist_ok=True)
        if clean:  # leftovers of an earlier run into the same destination that was killed (kill -9)
            clean_stale_temporaries(dst.parent, (f".{dst.name}.tmp-", f".{dst.name}.old-"))
        return Path(tempfile.mkdtemp(prefix=f".{dst.name}.tmp-", dir=dst.parent))
    except OSError as e:
        above = next((p for p in dst.parents if p.exists()), None)
        why = f"{above} is not a directory" if above is not None and not above.is_dir() else e.strerror or str(e)
        raise error(f"{dst}: cannot write a directory there ({why})") from None


def check_writable(dst: Path, error) -> None:
    """Raise ``error(message)`` unless a directory can be written at ``dst``'s place: for work
    that writes its result only at its end (a conversion, a training run), checked before it
    starts. Leaves nothing behind: the probe and any parent it made are removed."""
    dst = Path(dst).absolute()
    made = [p for p in [dst.parent, *dst.parent.parents] if not p.exists()]
    try:
        os.rmdir(_directory_beside(dst, error))
    finally:
        for p in made:  # innermost first
            try:
                p.rmdir()
            except OSError:
                pass


@contextmanager
def atomic_directory(dst: Path, force: bool, exists_error) -> Iterator[Path]:
    """Yield a temporary sibling of ``dst`` to fill; on success it replaces
    ``dst`` by rename, on any failure (Ctrl-C included) it is removed, so a
    crash never leaves a half-written directory at ``dst``.

    ``exists_error(message)`` builds the exception raised when ``dst`` exists
    and ``force`` is False, or when no directory can be made beside it (a read-only or
    virtual file system, a parent that is a file): one line, before anything is written."""
    dst = Path(dst)
    check_replaceable(dst, force, exists_error)
    tmp = _directory_beside(dst, exists_error, clean=True)
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


def cache_root() -> Path:
    """The user cache (``SPECSTREAM_MLX_CACHE``; :mod:`specstream_mlx.settings`)."""
    from ..settings import current

    return current().cache_dir


def read_cache_table(path: Path) -> dict:
    """A JSON object the user cache keeps (learned costs, verdicts, fingerprints); empty
    when it is missing, unreadable or not an object: it is only learned again."""
    try:
        table = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}
    return table if isinstance(table, dict) else {}


def write_cache_table(path: Path, table: dict, indent: Optional[int] = None) -> None:
    """Write ``table`` to ``path`` atomically (a concurrent reader sees the old or the new
    one); a read-only or missing cache only means it is learned again next time."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(table, indent=indent))
        os.replace(tmp, path)
    except OSError:
        pass
