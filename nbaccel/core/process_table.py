"""Processes by pid, for the kernel and the ranks alike: how one is named to a person, whether it
still lives, and signalling many at once where any may already be gone."""

from __future__ import annotations

import os

import psutil

# The multiprocessing name of a rank's process: "nbaccel-rank0", ... (the fork server knows its
# ranks by it: forkserver.launching_script).
RANK_PROCESS_PREFIX = "nbaccel-rank"

# Command lines a process forked without exec inherits: the ordinary fork server's, and the
# titles nbaccel gives its fork server and ranks (core.proctitle).
_FORKED_COMMANDS = (
    "multiprocessing.forkserver import main",
    "nbaccel rank ",
    "nbaccel fork server",
)


def describe(process: psutil.Process) -> str:
    """A process's command line for a person (``sleep 1000``), or its name.

    A process forked from a rank without exec (a multiprocessing child, a DataLoader worker)
    still has its rank's command line, which would say nothing: it reads "forked from a rank"
    instead.

    >>> describe(psutil.Process()) != "?"
    True
    """
    try:
        cmd = " ".join(process.cmdline()) or process.name()
        if any(forked in cmd for forked in _FORKED_COMMANDS):
            return f"{process.name()}, forked from a rank"
    except psutil.Error:
        return "?"
    return cmd if len(cmd) <= 80 else cmd[:77] + "..."


def alive(process: psutil.Process) -> bool:
    """Whether ``process`` still runs (a zombie has ended; only its exit status is left)."""
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def signal_all(processes: list[psutil.Process], sig: int) -> None:
    """Send ``sig`` to each of ``processes``; one that has gone meanwhile is skipped."""
    for process in processes:
        try:
            process.send_signal(sig)
        except psutil.Error:
            pass


def child_pids(pid: int | str = "self") -> list[int] | None:
    """The pids of ``pid``'s children (zombies included), read from each of its threads'
    ``/proc/<pid>/task/<tid>/children``: a file per thread, where psutil's ``children()``
    reads every process's status on the machine (1.3 ms here, on every rank's exit and every
    launch's sweep). ``None`` where the kernel does not list them, or the process is gone.

    >>> os.getpid() in (child_pids(os.getppid()) or [os.getpid()])  # None: not listed here
    True
    >>> child_pids(2**22 + 1) is None  # no such process
    True
    """
    found: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
        for tid in tasks:
            with open(f"/proc/{pid}/task/{tid}/children", "rb") as f:
                found += [int(p) for p in f.read().split()]
    except (OSError, ValueError):  # a thread that just ended, no such files, or no process
        return None
    return found if tasks else None
