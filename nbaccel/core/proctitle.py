"""Name this process in ``ps``/``top``: what a fork server or a rank forked without exec is.

A process forked without exec keeps the command line of the process it was forked from, so a
fork server taken from the kernel would look like a second ``ipykernel_launcher -f ...`` and
its ranks like more kernels. Linux shows a process's command line from its original ``argv``
memory, whose bounds ``/proc/self/stat`` gives (fields 48-49); overwriting it there, as
setproctitle does, renames the process for ``ps``, ``top`` and psutil. The title is cut to the
space the original command line had. Elsewhere nothing changes.

>>> import subprocess, sys
>>> shown = subprocess.run([sys.executable, "-c",
...     "from nbaccel.core.proctitle import set_title; set_title('nbaccel demo'); "
...     "print(open('/proc/self/cmdline').read().split(chr(0))[0])"],
...     capture_output=True, text=True).stdout.strip()
>>> shown == "nbaccel demo" or not sys.platform.startswith("linux")
True
"""

from __future__ import annotations

import ctypes
import sys

# Fields 48 and 49 of /proc/self/stat, counted from the first field after the command name.
_ARG_START, _ARG_END = 48 - 3, 49 - 3


def set_title(title: str) -> bool:
    """Show ``title`` as this process's command line; whether it could (Linux only)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        with open("/proc/self/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        start, end = int(fields[_ARG_START]), int(fields[_ARG_END])
    except (OSError, IndexError, ValueError):
        return False
    size = end - start
    if size < 2 or start == 0:
        return False
    text = title.encode("utf-8", "replace")[: size - 2]
    # A NUL ends the title; a non-NUL last byte tells Linux the area holds one string (the
    # setproctitle convention), so it reads up to that first NUL instead of every argument.
    data = text + b"\0" + b" " * (size - len(text) - 1)
    ctypes.memmove(start, data, size)
    return True
