# Tests that need the CPU product kernel fail with this, never skip: it is preloaded by
# `make test` (the BLAS environment), so its absence is a broken setup, not a missing feature.
KERNEL_NOT_LOADED = (
    "the product kernel is not loaded: run the tests as `make test` does (env $(python -m specstream_mlx.blas_env))"
)
