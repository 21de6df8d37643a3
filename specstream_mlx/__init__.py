"""specstream-mlx: Speculative Streaming decoding for MLX.

Public API::

    from specstream_mlx import load, generate, stream_generate, SamplingParams
    model, tokenizer = load("path/to/model")
    result = generate(model, tokenizer, "Hello", max_tokens=64)

Package layout (each layer imports only the ones above it):

    models/   architectures: the one decoder block, per-architecture flags
    method/   Speculative Streaming: streams, multi-stream attention, trees, acceptance
    io/       model directories: loading, bundled models, atomic writes
    runtime/  KV cache, sampling, step engines (ar, ss, lookup), auto-tuning, generation, chat sessions
    train/    training streams (depends on models, method, io)
    convert   Hugging Face <-> MLX (the top-level convert/ folder)
    serve/, bench/, cli/, demo/   front ends and the demo-model builders
"""

__version__ = "0.1.0"

# Before anything imports mlx.core: on Linux's CPU wheel, the fast BLAS (platform_info).
from .platform_info import preload_in_process as _preload_blas  # noqa: E402

_preload_blas()

# Before MLX builds its first compiled CPU kernel: inline FMA instructions in them (cpu_jit).
from .cpu_jit import enable as _fma_in_cpu_kernels  # noqa: E402

_fma_in_cpu_kernels()

__all__ = [
    "__version__",
    "load",
    "generate",
    "stream_generate",
    "SamplingParams",
    "SpeculativeModel",
    "GenerationResponse",
    "GenerationResult",
]


def __getattr__(name):
    # Lazy, so `import specstream_mlx` (and the CLI's --help) stays instant.
    if name in ("load", "SpeculativeModel"):
        from .runtime import loaded_model

        return getattr(loaded_model, name)
    if name in ("generate", "stream_generate", "GenerationResponse", "GenerationResult"):
        from .runtime import generation

        return getattr(generation, name)
    if name == "SamplingParams":
        from .runtime.sampling import SamplingParams

        return SamplingParams
    raise AttributeError(name)
