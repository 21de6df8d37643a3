"""specstream-mlx: Speculative Streaming decoding for MLX.

Public API::

    from specstream_mlx import load, generate, stream_generate, SamplingParams
    model, tokenizer = load("path/to/model")
    result = generate(model, tokenizer, "Hello", max_tokens=64)
"""

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "load",
    "generate",
    "stream_generate",
    "SamplingParams",
    "GenerationResponse",
    "GenerationResult",
]


def __getattr__(name):
    # Lazy, so `import specstream_mlx` (and the CLI's --help) stays instant.
    if name == "load":
        from .loading import load

        return load
    if name in ("generate", "stream_generate", "GenerationResponse", "GenerationResult"):
        from . import generation as _g

        return getattr(_g, name)
    if name == "SamplingParams":
        from .sampling import SamplingParams

        return SamplingParams
    raise AttributeError(name)
