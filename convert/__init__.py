"""Hugging Face -> MLX converter (importable as ``specstream_mlx.convert``).

``convert(hf_path, mlx_path, ...)`` reads a Hugging Face checkpoint (local
directory or hub id; sharded safetensors with their index, no torch needed),
maps it onto our model classes (same parameter names), casts or quantizes it,
and writes an mlx-lm-compatible directory atomically.
"""

from .converter import ConvertError, ConvertOptions, convert

__all__ = ["convert", "ConvertError", "ConvertOptions"]
