"""Wire a freshly started rank process up: death with the launcher, output pipes, threads.

Everything here runs before the user's code, in the order :func:`nbaccel.rank.entry.run_rank`
calls it. Nothing here imports IPython or the views.
"""

from __future__ import annotations

import builtins
import ctypes
import io
import multiprocessing
import os
import signal
import sys
import threading

from nbaccel.core import hardware, libc, mp_internals


def die_with_parent() -> None:
    """Make sure the rank dies when whoever launched it dies, so no orphan keeps training.

    On Linux the kernel (via PR_SET_PDEATHSIG) kills us when our parent exits; elsewhere, a
    thread watches the launcher's end of a pipe that only closes when the launcher is gone and
    then kills the rank's process group (the rank and the descendants that stayed in it).
    """
    mp_internals.forget_forkserver()
    if sys.platform.startswith("linux"):
        c = libc.load()
        if c is not None and c.prctl(1, signal.SIGKILL) == 0:  # PR_SET_PDEATHSIG
            return
    parent = multiprocessing.parent_process()
    sentinel = getattr(parent, "sentinel", None)
    if sentinel is None:
        return

    def watch() -> None:
        from multiprocessing.connection import wait

        wait([sentinel])
        # Without PDEATHSIG and a subreaper (macOS) nobody else would stop what the rank
        # started: take the rank's own process group (it leads one) down with it.
        try:
            if os.getpgid(0) == os.getpid():
                os.killpg(os.getpid(), signal.SIGKILL)
        except OSError:
            pass
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="nbaccel-parent-watch", daemon=True).start()


def redirect_output(out_fd: int, err_fd: int) -> None:
    """Point fds 1 and 2 at the kernel's pipes, with line-buffered Python streams on top."""
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.dup2(out_fd, 1)
    os.dup2(err_fd, 2)
    sys.stdin = open(0, closefd=False)  # noqa: SIM115 - lives as long as the process
    sys.stdout = io.TextIOWrapper(
        open(1, "wb", buffering=0, closefd=False),
        encoding="utf-8",  # noqa: SIM115
        errors="backslashreplace",
        line_buffering=True,
    )
    sys.stderr = io.TextIOWrapper(
        open(2, "wb", buffering=0, closefd=False),
        encoding="utf-8",  # noqa: SIM115
        errors="backslashreplace",
        line_buffering=True,
    )
    sys.__stdout__, sys.__stderr__ = sys.stdout, sys.stderr
    # C libraries buffer stdout fully when it is a pipe; make it line-buffered so their
    # output reaches the cell as it happens (glibc only; elsewhere it arrives at exit).
    c = libc.load()
    if c is not None and sys.platform.startswith("linux"):
        try:
            c_stdout = ctypes.c_void_p.in_dll(c, "stdout")
            c.setvbuf(c_stdout, None, 1, 0)  # _IOLBF
        except (ValueError, AttributeError):
            pass


def refuse_keyboard_input() -> None:
    """Make ``input()`` say why it cannot work in a rank (its stdin is empty: nobody types into
    N processes) instead of a bare "EOF when reading a line"; still an ``EOFError``, so code that
    falls back on one keeps working."""

    def input(prompt: object = "") -> str:  # noqa: A001 - it replaces the builtin
        sys.stdout.write(str(prompt))  # the prompt still shows, as with the builtin
        sys.stdout.flush()
        raise EOFError(
            f"input({prompt!r}) cannot read in a rank: ranks have no keyboard (their stdin is "
            "empty). Ask in the notebook before the launch and pass the answer in, e.g. "
            "notebook_launcher(train, args=(answer,))."
        )

    builtins.input = input


def share_cpu_threads(local_world_size: int) -> None:
    """Share the CPU between local ranks instead of each starting one thread per core."""
    if "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = str(hardware.threads_per_rank(local_world_size))
    try:
        import torch

        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    except (ImportError, ValueError, RuntimeError):
        pass
