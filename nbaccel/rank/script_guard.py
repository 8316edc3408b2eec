"""Keep what an ``nbaccel launch`` rank causes inside it, even when the launcher is SIGKILLed.

torch elastic starts each worker in a session of its own and, when it stops a rank, signals that
session's process group. What it cannot cover: the launcher itself being SIGKILLed (its workers
were orphaned, still training) and processes the script started that left the group (setsid,
double fork) or outlived the script. So on Linux the worker process elastic started becomes a
small *guard* and the script runs in a forked child of it:

* the guard is a child subreaper: every process the script causes stays below it, even after
  its own parent died;
* the guard gets SIGTERM when the launcher dies (PR_SET_PDEATHSIG); it then stops its whole tree
  (SIGTERM, SIGKILL after a grace period) and exits;
* the script's process dies with the guard (PR_SET_PDEATHSIG SIGKILL), so nothing outlives both;
* when the script's process ends, the guard stops whatever it left running and exits with the
  same status (or the same signal), which is what elastic sees as the rank's result.

Signals elastic sends to the group reach the script as before; the guard itself ignores
SIGTERM/SIGINT/SIGHUP while its launcher is alive and only waits (so signalling the guard's pid
alone does nothing: signal the group, as elastic does, or the script's process). The script's
``os.getppid()`` is the guard. Elsewhere (macOS) the script runs directly, as before.

What is guaranteed (Linux, tested by argv marker on every process of the machine, in
tests/test_cli_launch_containment.py): nothing a rank started — in its group, in a session of
its own, or orphaned — is left running 5 s after (a) the script ends, (b) ``nbaccel launch``
gets SIGTERM/SIGINT, (c) ``nbaccel launch`` is SIGKILLed, (d) one rank's worker process is
SIGKILLed (orphans re-parent to ``nbaccel launch``, which stops them when the launch ends).
Not covered: a process that ignores SIGTERM gets SIGKILL only after the grace period (2 s);
the launcher and a guard SIGKILLed at once leave the guard's orphans to pid 1; a process that
leaves the tree through a subreaper of its own is out of reach.

Example::

    run_guarded(lambda: exit.leave(main()))   # in script_entry's ``__main__`` block
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable

from nbaccel.core import libc
from nbaccel.rank import containment

PR_SET_PDEATHSIG = 1
_FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class _LauncherGone(Exception):
    """Raised in the guard's wait loop when its parent (the launcher) has died."""


def _die_with_parent(sig: int) -> bool:
    c = libc.load()
    return c is not None and c.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0


def run_guarded(run: Callable[[], object]) -> None:
    """Run ``run`` (which must end the process) below a guard process; see the module docstring.

    Example::

        run_guarded(lambda: exit.leave(main()))
    """
    launcher = os.getppid()
    if not sys.platform.startswith("linux") or not containment.set_subreaper():
        run()
        return
    if not _die_with_parent(signal.SIGTERM) or os.getppid() != launcher:
        os._exit(128 + signal.SIGTERM)  # the launcher is already gone: run nothing
    sys.stdout.flush()
    sys.stderr.flush()
    guard = os.getpid()
    child = os.fork()
    if child == 0:
        if not _die_with_parent(signal.SIGKILL) or os.getppid() != guard:
            os._exit(128 + signal.SIGKILL)
        run()
        os._exit(0)  # run() is expected to exit; never fall back into the guard's code
    _guard(child, launcher)


def _guard(child: int, launcher: int) -> None:
    def on_signal(signum: int, frame: object) -> None:
        # Elastic signals the whole group: the script got it too, and ends on its own terms.
        # A signal after the launcher died is PR_SET_PDEATHSIG: stop everything now.
        if os.getppid() != launcher:
            raise _LauncherGone

    for sig in _FORWARDED:
        signal.signal(sig, on_signal)
    status = None
    try:
        status = _wait_for(child)
    except _LauncherGone:
        pass
    for sig in _FORWARDED:
        signal.signal(sig, signal.SIG_IGN)
    containment.stop_descendants()
    if status is None:
        os._exit(128 + signal.SIGTERM)
    if os.WIFSIGNALED(status):
        number = os.WTERMSIG(status)
        if number not in (signal.SIGKILL, signal.SIGSTOP):  # (theirs cannot be set: OSError)
            signal.signal(number, signal.SIG_DFL)
        os.kill(os.getpid(), number)  # elastic reports the rank as killed by the same signal
        os._exit(128 + number)
    os._exit(os.waitstatus_to_exitcode(status))


def _wait_for(child: int) -> int:
    """Reap every child (adopted orphans too) until ``child`` ends; return its wait status."""
    while True:
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:
            return 0
        if pid == child:
            return status
