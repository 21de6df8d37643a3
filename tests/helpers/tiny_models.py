"""Tiny model directories for tests (the builder lives in the package's demo tools)."""

from specstream_mlx.demo.tiny import make_tiny_model_dir, tiny_config


def copy_model(src, dst, streams: bool = True):
    """A copy of model directory ``src`` at ``dst`` to edit in a test (without its
    speculative streams unless ``streams``); returns ``dst``."""
    import shutil
    from pathlib import Path

    shutil.copytree(src, dst)
    if not streams:
        for f in ("specstream.json", "streams.safetensors"):
            (Path(dst) / f).unlink(missing_ok=True)
    return Path(dst)


__all__ = ["copy_model", "make_tiny_model_dir", "tiny_config"]
