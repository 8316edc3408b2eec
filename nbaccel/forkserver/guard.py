"""Imported first by the fork server: it leaves the kernel's process group, becomes a child
subreaper, and kills everything below it before it exits (see :mod:`nbaccel.rank.containment`).

Importing it anywhere else (a doctest run, a curious reader) does nothing: the guard is set up
only when the import happens inside ``multiprocessing.forkserver.main``'s preloading.
"""

import sys
import types

from nbaccel.rank.containment import guard_server


def in_fork_server() -> bool:
    """Whether this import runs inside ``multiprocessing.forkserver.main``'s preloading."""
    frame: types.FrameType | None = sys._getframe()
    while frame is not None:
        if frame.f_code.co_name == "main" and frame.f_globals.get("__name__") == (
            "multiprocessing.forkserver"
        ):
            return True
        frame = frame.f_back
    return False


if in_fork_server():
    guard_server()
