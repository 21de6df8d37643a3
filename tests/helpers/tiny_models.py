"""Tiny model directories for tests (the builder lives in the package's demo tools)."""

from specstream_mlx.demo.tiny import make_tiny_model_dir, tiny_config

__all__ = ["make_tiny_model_dir", "tiny_config"]
