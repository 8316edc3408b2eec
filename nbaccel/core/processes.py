"""Processes in words: what the kernel and a rank say about a process they stopped."""

from __future__ import annotations

import psutil

_FORK_SERVER_COMMAND = "multiprocessing.forkserver import main"


def describe(process: psutil.Process) -> str:
    """A process's command line for a person (``sleep 1000``), or its name.

    A process forked from a rank without exec (a multiprocessing child, a DataLoader worker)
    still has the fork server's command line, which would say nothing: it reads "forked from a
    rank" instead.

    >>> describe(psutil.Process()) != "?"
    True
    """
    try:
        cmd = " ".join(process.cmdline()) or process.name()
        if _FORK_SERVER_COMMAND in cmd:
            return f"{process.name()}, forked from a rank"
    except psutil.Error:
        return "?"
    return cmd if len(cmd) <= 80 else cmd[:77] + "..."
