"""Keep every process a rank causes inside the rank, and stop them all when the rank is done.

A rank becomes the leader of a session of its own (so the kernel can signal the rank and all
its descendants as one process group, and Jupyter's interrupt, sent to the kernel's group, does
not reach them) and, on Linux, a *child subreaper*: a descendant whose parent dies re-parents
to the rank instead of to pid 1, so the rank's process tree is all it ever caused. When the
user's function has ended and been reported, :func:`stop_descendants` stops that tree (SIGTERM,
SIGKILL after a grace period) before anything can wait on it (multiprocessing's exit hook joins
non-daemon children and would hang the rank).

The fork server uses :func:`guard_server`: it also becomes a subreaper (a dead rank's orphans
re-parent to it, not to pid 1) in a process group of its own (so Jupyter's SIGKILL to the
kernel's group on restart spares it), and before it exits — the kernel died, or it was told to
stop — it kills everything below it. Ranks die with it (PDEATHSIG).

Example::

    become_subreaper_session()           # first thing in a rank
    ...                                  # the user's function runs, starts processes
    left = stop_descendants(grace=2.0)   # [(pid, "sleep 1000"), ...] were still running
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import time
import warnings

import psutil

from nbaccel.core import libc, process_table

PR_SET_CHILD_SUBREAPER = 36
GRACE = 2.0  # seconds a descendant gets to exit after SIGTERM


def become_subreaper_session() -> None:
    """Make this process a session leader and (Linux) a child subreaper; best effort."""
    try:
        os.setsid()
    except OSError:  # already a group leader (not from a fork): keep the group we have
        pass
    set_subreaper()


def set_subreaper() -> bool:
    """Make orphaned descendants re-parent to this process (Linux); report whether it worked."""
    if not sys.platform.startswith("linux"):
        return False
    c = libc.load()
    return c is not None and c.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0


def descendants() -> list[psutil.Process]:
    """This process's living descendants (zombies are reaped, not listed)."""
    reap_children()
    if process_table.child_pids() == []:  # the common case, known in microseconds: a descendant
        return []  # always has a child of this process above it (orphans re-parent here)
    try:
        found = psutil.Process().children(recursive=True)
    except psutil.Error:
        return []
    return [p for p in found if process_table.alive(p)]


def reap_children() -> None:
    """Collect the exit status of every child that has exited (adopted orphans included)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        except OSError:
            return
        if pid == 0:
            return


def stop_descendants(grace: float = GRACE, found: list[psutil.Process] | None = None) -> None:
    """SIGTERM every descendant, SIGKILL what is left after ``grace`` seconds, reap them all.

    Orphans re-parent to this process (a subreaper) while it works, so it looks again until
    nothing is left (a few rounds at most).
    """
    procs = descendants() if found is None else found
    if not procs:
        return
    process_table.signal_all(procs, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        if not descendants():
            return
        time.sleep(0.02)
    kill_descendants()


def kill_descendants(rounds: int = 50) -> None:
    """SIGKILL every descendant, looking again while orphans re-parent to this process."""
    for _ in range(rounds):
        left = descendants()
        if not left:
            return
        process_table.signal_all(left, signal.SIGKILL)
        time.sleep(0.01)


# -- the fork server --------------------------------------------------------------------------

_server_pid: int | None = None


def guard_server() -> None:
    """In the fork server: own group, subreaper, and kill everything below it before exiting.

    The server exits when the kernel is gone (its "alive" pipe reaches EOF); ``atexit`` then
    kills the ranks and every descendant they left. SIGTERM/SIGHUP do the same.
    """
    global _server_pid
    _server_pid = os.getpid()
    try:
        os.setpgid(0, 0)  # out of the kernel's process group: survive Jupyter's killpg
    except OSError:
        pass
    set_subreaper()
    # Adopted orphans are reaped by the server's SIGCHLD loop, which warns about pids it did
    # not start; they are expected here.
    warnings.filterwarnings("ignore", message="forkserver: waitpid returned unexpected pid")
    atexit.register(_kill_tree_if_server)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _on_server_signal)


def _kill_tree_if_server() -> None:
    if os.getpid() == _server_pid:  # a forked rank inherits the hook; it is not for ranks
        kill_descendants()


def _on_server_signal(signum: int, frame: object) -> None:
    if os.getpid() != _server_pid:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    _kill_tree_if_server()
    os._exit(0)


def reset_inherited_handlers() -> None:
    """In a rank: undo what :func:`guard_server` set up in the server it was forked from."""
    for sig in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) is _on_server_signal:
            signal.signal(sig, signal.SIG_DFL)
