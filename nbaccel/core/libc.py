"""The C library, looked up once per process (``find_library`` runs ``ldconfig``)."""

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
