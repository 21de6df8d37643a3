"""Hugging Face -> MLX converter (importable as ``specstream_mlx.convert``).

``convert(hf_path, mlx_path, ...)`` reads a Hugging Face checkpoint (local
directory or hub id; sharded safetensors with their index, no torch needed),
maps it onto our model classes (same parameter names), casts or quantizes it,
and writes an mlx-lm-compatible directory atomically. ``convert_gguf(file, mlx_path)``
imports a llama.cpp GGUF file the same way (quantized tensors stay quantized).
"""

from .converter import ConvertError, ConvertOptions, convert, convert_gguf

__all__ = ["convert", "convert_gguf", "ConvertError", "ConvertOptions"]
