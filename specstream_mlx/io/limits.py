"""What a model directory may ask of the loader, bounded before anything is built.

A model directory is input from whoever made it. Every file of it that a loader
reads is checked first here, by one rule: a regular file (never a FIFO or a
device), inside the directory once symlinks are followed (a Hugging Face hub
snapshot's links into its own ``blobs/`` folder are inside), and, for the text
files, under a size limit. A ``config.json`` is checked against upper bounds and
against the shapes its weights really have (read from the safetensors headers,
without loading them), so a config that asks for 100,000 layers is refused in one
line instead of building them. See docs/SECURITY.md.
"""

from __future__ import annotations

import json
import os
import re
import stat
import struct
from pathlib import Path
from typing import Any, Dict, Iterable, Optional, Tuple

# The largest sampling or shuffling seed taken: MLX's PRNG keys take 64 unsigned bits, numpy's
# and PyTorch's generators any non-negative integer of 63.
SEED_MAX = (1 << 63) - 1


def outside_vocabulary(ids: Iterable[int], vocab_size: int) -> Optional[str]:
    """Why token ``ids`` cannot be looked up in a model's vocabulary of ``vocab_size`` (one line),
    or None: the embedding lookup does not check its indices, and an id past the table reads
    whatever memory follows it (another model's tokenizer gave fluent garbage; a larger one
    could crash)."""
    bad = next((i for i in ids if not 0 <= i < vocab_size), None)
    if bad is None:
        return None
    return (
        f"token id {bad} is outside the model's vocabulary (0..{vocab_size - 1}): "
        "the tokenizer does not belong to this model"
    )


_SURROGATE = re.compile("[\ud800-\udfff]")


def not_text(text: str, from_bytes: bool = True) -> Optional[str]:
    """Why ``text`` is not Unicode text a tokenizer can take (one line), or None.

    Python hands over bytes that are not UTF-8 (in a command line; on standard input where
    the locale says so) as the code points U+DC80..U+DCFF, and a JSON escape can spell any
    lone surrogate; no tokenizer encodes either (the Rust one fails with a type error).
    ``from_bytes``: whether ``text`` was decoded from bytes that way (else each such code
    point is said to be a lone surrogate)."""
    found = _SURROGATE.search(text)  # in C: a scan per character in Python took 2 s a training split
    if found is None:
        return None
    bad = found.start()
    point = ord(text[bad])
    if from_bytes and 0xDC80 <= point <= 0xDCFF:
        return f"not UTF-8 text: byte 0x{point - 0xDC00:02x} at character {bad + 1}"
    return f"not Unicode text: a lone surrogate U+{point:04X} at character {bad + 1}"


# Text files of a model directory: the largest real tokenizer.json we know is ~35 MB.
MAX_JSON_BYTES = 16 << 20
MAX_TOKENIZER_BYTES = 128 << 20
MAX_TEMPLATE_CHARS = 1 << 20
MAX_SAFETENSORS_HEADER = 100 << 20  # the safetensors format's own limit

# Upper bounds of config.json's sizes: far beyond any released model, far below an overflow.
CONFIG_BOUNDS = {
    "hidden_size": 1 << 17,
    "intermediate_size": 1 << 20,
    "num_hidden_layers": 1024,
    "num_attention_heads": 1024,
    "num_key_value_heads": 1024,
    "vocab_size": 1 << 22,
    "head_dim": 1 << 13,
    "max_position_embeddings": 1 << 26,
}

# The files of a model directory a loader reads (besides ``*.safetensors``).
TEXT_FILES = {
    "config.json": MAX_JSON_BYTES,
    "specstream.json": MAX_JSON_BYTES,
    "tokenizer_config.json": MAX_TOKENIZER_BYTES,
    "tokenizer.json": MAX_TOKENIZER_BYTES,
    "special_tokens_map.json": MAX_JSON_BYTES,
    "added_tokens.json": MAX_JSON_BYTES,
    "generation_config.json": MAX_JSON_BYTES,
    "vocab.json": MAX_TOKENIZER_BYTES,
    "merges.txt": MAX_TOKENIZER_BYTES,
    "tokenizer.model": MAX_TOKENIZER_BYTES,
    "tiktoken.model": MAX_TOKENIZER_BYTES,
    "chat_template.jinja": MAX_TEMPLATE_CHARS * 4,
    "chat_template.json": MAX_TEMPLATE_CHARS * 4,
    "model.safetensors.index.json": MAX_JSON_BYTES,
}


class UnsafeFileError(ValueError):
    """A file a loader refuses to read; the message names the file and the limit."""


def _allowed_roots(root: Path) -> Tuple[Path, ...]:
    root = Path(os.path.realpath(root))
    roots = [root]
    # huggingface_hub snapshots: snapshots/<rev>/<file> -> ../../blobs/<hash>
    if root.parent.name == "snapshots":
        roots.append(root.parent.parent / "blobs")
    return tuple(roots)


def checked_file(path: Path, root: Path, limit: Optional[int] = None) -> int:
    """The size of ``path``, a file of directory ``root`` a loader is about to read; else
    :class:`UnsafeFileError`: a link leading outside ``root``, not a regular file, or over ``limit``."""
    path = Path(path)
    real = Path(os.path.realpath(path))
    if not any(real == r or r in real.parents for r in _allowed_roots(root)):
        raise UnsafeFileError(f"{path}: a symlink to {real}, outside the model directory; refusing to read it")
    try:
        st = os.stat(real)
    except OSError as e:
        raise UnsafeFileError(f"{path}: cannot read ({e.strerror})") from None
    if not stat.S_ISREG(st.st_mode):
        raise UnsafeFileError(f"{path}: not a regular file (a device, FIFO or socket); refusing to read it")
    if limit is not None and st.st_size > limit:
        raise UnsafeFileError(f"{path}: {st.st_size:,} bytes, over the limit of {limit:,} for this file")
    return st.st_size


def check_directory_files(root: Path, names: Optional[Iterable[str]] = None) -> None:
    """Every file of model directory ``root`` that a loader reads passes :func:`checked_file`
    (``names``: only these; default the text files above and every ``*.safetensors``)."""
    root = Path(root)
    for entry in sorted(os.listdir(root)):
        wanted = entry in TEXT_FILES or entry.endswith(".safetensors")
        if names is not None:
            wanted = entry in names
        if wanted:
            checked_file(root / entry, root, TEXT_FILES.get(entry))


def read_json(path: Path, root: Optional[Path] = None, limit: Optional[int] = None) -> Any:
    """A JSON file of a model directory, checked (:func:`checked_file`) then parsed; any
    failure is one :class:`UnsafeFileError` line (deep nesting included)."""
    path = Path(path)
    checked_file(path, root if root is not None else path.parent, limit or TEXT_FILES.get(path.name, MAX_JSON_BYTES))
    try:
        return json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as e:
        raise UnsafeFileError(f"{path}: invalid JSON (not UTF-8 at byte {e.start})") from None
    except RecursionError:
        raise UnsafeFileError(f"{path}: invalid JSON (nested too deeply)") from None
    except ValueError as e:  # JSONDecodeError, and integers of 4,300+ digits
        raise UnsafeFileError(f"{path}: invalid JSON ({e})") from None


def check_bounds(config: Dict[str, Any], where: Path) -> None:
    """Refuse sizes beyond :data:`CONFIG_BOUNDS` (checked after they are known to be positive ints)."""
    for key, hi in CONFIG_BOUNDS.items():
        v = config.get(key)
        if isinstance(v, int) and v > hi:
            raise UnsafeFileError(f"{where}: '{key}' is {v:,}, above the limit of {hi:,}")


def safetensors_shapes(path: Path) -> Dict[str, Tuple[int, ...]]:
    """Tensor name -> shape from a safetensors file's header, without reading the tensors."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise UnsafeFileError(f"{path}: not a safetensors file (truncated header)")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_SAFETENSORS_HEADER:
                raise UnsafeFileError(f"{path}: safetensors header of {n:,} bytes, over {MAX_SAFETENSORS_HEADER:,}")
            header = json.loads(f.read(n).decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        if isinstance(e, UnsafeFileError):
            raise
        raise UnsafeFileError(f"{path}: not a safetensors file (bad header: {type(e).__name__})") from None
    if not isinstance(header, dict):
        raise UnsafeFileError(f"{path}: not a safetensors file (header is not an object)")
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        shape = info.get("shape") if isinstance(info, dict) else None
        if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise UnsafeFileError(f"{path}: tensor {name!r} has no valid shape in the header")
        out[name] = tuple(shape)
    return out


_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def _first(shapes: Dict[str, Tuple[int, ...]], suffix: str) -> Optional[Tuple[str, Tuple[int, ...]]]:
    for k, v in shapes.items():
        if k.endswith(suffix):
            return k, v
    return None


def check_against_shapes(config: Dict[str, Any], shapes: Dict[str, Tuple[int, ...]], where: Path) -> None:
    """``config``'s sizes agree with the tensors it will be loaded with: the layer count,
    the vocabulary (embedding rows), the hidden size (final norm) and the MLP width. Only the
    leading dimension of a matrix is compared: it is the same quantized or not."""
    layers = {int(m.group(1)) for k in shapes for m in [_LAYER.search(k)] if m}
    n = config.get("num_hidden_layers")
    if layers and n != max(layers) + 1:
        raise UnsafeFileError(f"{where}: 'num_hidden_layers' is {n:,} but the weights hold {max(layers) + 1} layers")
    checks = (
        ("embed_tokens.weight", "vocab_size", 1),
        ("model.norm.weight", "hidden_size", 1),
        ("layers.0.mlp.gate_proj.weight", "intermediate_size", 1),
        ("layers.0.mlp.gate_up_proj.weight", "intermediate_size", 2),
        ("layers.0.mlp.up_proj.weight", "intermediate_size", 1),
    )
    for suffix, key, factor in checks:
        found = _first(shapes, suffix)
        v = config.get(key)
        if found is None or not isinstance(v, int) or not found[1]:
            continue
        rows = found[1][0]
        if rows != factor * v:
            raise UnsafeFileError(
                f"{where}: shape mismatch: '{key}' is {v:,} but tensor {found[0]} has {rows:,} rows"
                + (f" ({factor} x {key})" if factor > 1 else "")
            )
