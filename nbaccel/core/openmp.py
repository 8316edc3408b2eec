"""Release the calling thread's OpenMP worker pool, so a fork of this process is safe.

GNU OpenMP (the libgomp torch's CPU wheels ship) keeps a pool of worker threads per thread that
started a parallel region. A fork copies the pool's bookkeeping but not its threads: the next
parallel region in the child (a matmul on 2+ threads) waits for them forever. Measured here: a
process forked from a kernel that had run one ``a @ a`` hangs on its first 2-thread matmul.
OpenMP 5's ``omp_pause_resource_all`` ends those threads cleanly; the parent's next parallel
region starts a new pool (a few milliseconds).

>>> release_thread_pools() in (True, False)
True
"""

from __future__ import annotations

import ctypes

from nbaccel.core import libc

# OpenMP runtimes a process may have loaded (GNU, Intel, LLVM), by the file name's start.
_RUNTIMES = ("libgomp", "libiomp", "libomp")
_OMP_PAUSE_HARD = 2


def loaded_runtimes() -> list[str]:
    """Paths of the OpenMP runtimes mapped into this process (Linux; empty elsewhere)."""
    paths = libc.loaded_libraries()
    return sorted(p for p in paths if p.rsplit("/", 1)[-1].startswith(_RUNTIMES))


def release_thread_pools() -> bool:
    """End this thread's OpenMP workers in every loaded runtime; whether all of them did.

    Call it from the thread that will fork, outside any parallel region. False means a
    runtime could not say it released its pool: a fork could then hang its children.
    """
    for path in loaded_runtimes():
        try:
            pause = ctypes.CDLL(path).omp_pause_resource_all
        except (OSError, AttributeError):
            return False  # an OpenMP older than 5.0: no way to end its threads
        pause.restype = ctypes.c_int
        if pause(_OMP_PAUSE_HARD) != 0:
            return False
    return True
