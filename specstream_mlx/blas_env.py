"""``python -m specstream_mlx.blas_env``: the environment words that preload the chosen BLAS
(``env $(python -m specstream_mlx.blas_env) COMMAND``), for programs that import ``mlx``
before ``specstream_mlx`` (the test suite among them)."""

import sys

from .platform_info import print_env

if __name__ == "__main__":
    sys.exit(print_env())
