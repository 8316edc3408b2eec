"""Native libraries: the C library, looked up once per process (``find_library`` runs
``ldconfig``), and which shared libraries this process has loaded."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from typing import Any


@functools.cache
def load() -> Any:
    """``ctypes.CDLL`` of libc, or ``None`` where it cannot be found."""
    name = ctypes.util.find_library("c")
    return ctypes.CDLL(name, use_errno=True) if name else None


def loaded_libraries() -> set[str]:
    """Paths of the files mapped into this process (Linux ``/proc/self/maps``; empty elsewhere).

    >>> isinstance(loaded_libraries(), set)
    True
    """
    try:
        with open("/proc/self/maps") as f:
            return {line.split()[-1] for line in f if "/" in line}
    except OSError:
        return set()
