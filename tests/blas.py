"""One BLAS thread in each test worker, set through the library numpy loaded.

numpy's OpenBLAS starts a thread per core for a ``np.dot`` of float64 vectors. The suite runs
one worker per core, each beside the runtimes' and the oracle's own threads, so those threads
wait for a core: on two busy cores a dot of 100k elements took 3.5 ms instead of 0.02 ms, and
the comparison of one tensor (four dots, ``MetricSums.add``) 10-19 ms instead of 2 ms. Set in
this process only, through the library's own call (as threadpoolctl does): the environment
(``OPENBLAS_NUM_THREADS``, which the dataset workers' thread caps read) stays as it was, and so
does every process a test starts.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

__all__ = ["limit_blas_threads"]

_SETTERS = (
    "scipy_openblas_set_num_threads64_",
    "scipy_openblas_set_num_threads_64_",
    "scipy_openblas_set_num_threads",
    "openblas_set_num_threads64_",
    "openblas_set_num_threads",
)


def limit_blas_threads(threads: int = 1) -> list[str]:
    """Set every OpenBLAS loaded in this process to ``threads``; the libraries it set."""
    import numpy  # noqa: F401  -- loads the library

    maps = Path("/proc/self/maps")
    if not maps.is_file():
        return []
    paths = {line.split()[-1] for line in maps.read_text().splitlines() if "openblas" in line}
    done = []
    for path in sorted(p for p in paths if p.startswith("/")):
        lib = ctypes.CDLL(path)
        setter = next((getattr(lib, s) for s in _SETTERS if hasattr(lib, s)), None)
        if setter is not None:
            setter(threads)
            done.append(path)
    return done
