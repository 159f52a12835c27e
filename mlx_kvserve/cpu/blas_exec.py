"""`python -m mlx_kvserve.cpu.blas_exec CMD ...`: run CMD with OpenBLAS preloaded where available
(used by `make test` so the test suite gets the same fast BLAS as the server)."""

import os
import sys

from .blas import preload_env

if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: python -m mlx_kvserve.cpu.blas_exec CMD [ARGS...]")
    os.execvpe(sys.argv[1], sys.argv[1:], preload_env())
