"""How a rank ends, the same for notebook ranks and ``nbaccel launch`` ranks.

One protocol: the user's code ran and either returned or raised; :func:`outcome` turns that into
an exit status (``SystemExit(0)``/``None`` is success, ``sys.exit("text")`` is a failure with
status 1, as Python itself does); :func:`user_traceback` formats a failure starting at the
user's first frame; :func:`leave` flushes everything and ends the process without interpreter
teardown, where torch's process-group destructors can deadlock (see ``torch_fixes``).

>>> outcome(SystemExit(0))
(0, None)
>>> outcome(SystemExit(3))[0]
3
>>> code, failure = outcome(ValueError("bad"))
>>> code, type(failure).__name__
(1, 'ValueError')
"""

from __future__ import annotations

import _thread
import atexit
import faulthandler
import multiprocessing.util
import os
import pickle
import sys
import time
import traceback
import weakref
from collections.abc import Callable
from typing import Any

from nbaccel.core import events, libc, pickling


def outcome(exc: BaseException | None) -> tuple[int, BaseException | None]:
    """The exit status for how the user's code ended, and the failure to report (or ``None``)."""
    if exc is None:
        return 0, None
    if isinstance(exc, SystemExit):
        if exc.code in (None, 0):
            return 0, None
        return (exc.code if isinstance(exc.code, int) else 1), exc
    return 1, exc


def user_traceback(exc: BaseException, is_plumbing: Callable[[str], bool]) -> str:
    """The formatted exception, starting at the first frame whose file is not plumbing."""
    tb = exc.__traceback__
    while tb is not None and is_plumbing(tb.tb_frame.f_code.co_filename):
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb))


def failure_event(
    exc: BaseException, rank: int, is_plumbing: Callable[[str], bool]
) -> events.Failure:
    """The event that tells the kernel how a rank's code failed: type, message, the user's
    traceback, and the exception itself when the kernel will be able to unpickle it."""
    try:
        pickled = pickling.dumps(exc)
        pickle.loads(pickled)  # only send what the kernel will be able to load
    except Exception:
        pickled = None
    kind = type(exc)
    return events.Failure(
        rank=rank,
        exc_type=f"{kind.__module__}.{kind.__qualname__}",
        message=shortened(str(exc)),
        traceback="\n".join(map(shortened, user_traceback(exc, is_plumbing).split("\n"))),
        exception=pickled,
    )


# Longer messages (a whole tensor or dataset printed into an exception) would flood the cell.
MESSAGE_LIMIT = 10_000


def shortened(text: str, limit: int = MESSAGE_LIMIT) -> str:
    """``text`` cut to ``limit`` characters, saying how much was left out.

    >>> shortened("x" * 12, limit=5)
    'xxxxx… (7 more characters)'
    """
    if len(text) <= limit:
        return text
    return f"{text[:limit]}… ({len(text) - limit:,} more characters)"


def flush_output() -> None:
    """Flush Python's and the C library's standard streams."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
    c = libc.load()
    if c is not None:
        c.fflush(None)


# How long a rank whose function has ended may spend ending (multiprocessing's finalisers,
# stopping leftovers, exit hooks such as a tracker's final upload) before it ends without them;
# $NBACCEL_EXIT_DEADLINE (seconds) changes it.
EXIT_DEADLINE = 60.0


def end_within(code: int, seconds: float | None = None) -> None:
    """Make sure this process ends with ``code`` within ``seconds`` from now, whatever its exit
    hooks wait for: past the deadline the stacks are printed, with what happened, and the process
    ends. Its result was reported already, so the launch still completes."""
    if seconds is None:
        seconds = float(os.environ.get("NBACCEL_EXIT_DEADLINE") or EXIT_DEADLINE)

    def give_up() -> None:
        time.sleep(seconds)
        try:
            print(
                f"nbaccel: this rank's function ended {seconds:.0f} s ago but its exit hooks are "
                "still waiting (stacks below); it ends without them. A multiprocessing Queue or "
                "child left open is the usual cause: close or join it in the function.",
                file=sys.stderr,
                flush=True,
            )
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        finally:
            flush_output()
            os._exit(code)

    # A bare thread: threading.Timer's start() waits until the new thread runs, which is up to
    # the interpreter's switch interval (5 ms) while another thread holds the GIL, on every
    # rank's exit, which the launch waits for. The process never waits for this thread:
    # leave() ends it with os._exit.
    _thread.start_new_thread(give_up, ())


def close_multiprocessing() -> None:
    """Run multiprocessing's own first exit step now, while the processes it talks to still
    live: a ``Pool`` left open is terminated the way interpreter exit does it. Run after its
    workers were killed, that step waits forever for a lock a dead worker held."""
    try:
        util: Any = multiprocessing.util  # _run_finalizers is private, not in its stubs
        util._run_finalizers(0)
    except Exception as exc:  # noqa: BLE001 - a failing finaliser must not change the outcome
        print(f"nbaccel: a multiprocessing finaliser failed: {exc!r}", file=sys.stderr)


def skip_exit_only_finalizers() -> None:
    """Let ``weakref.finalize``'s exit hook skip finalisers whose only effect is on this
    process's own state, which ``os._exit`` forgets anyway: each ``torch.library.Library``
    unregisters its operators (``torch._dynamo``'s import, in the fork server, made 174 of
    them; running them took 40 ms of each rank's exit on 2 loaded cores, up to 200 ms).
    A user's own finalisers still run."""
    library = sys.modules.get("torch.library")
    unregister = getattr(library, "_del_library", None)
    registry = getattr(weakref.finalize, "_registry", None)  # private: guarded
    if unregister is None or not isinstance(registry, dict):
        return
    for finalizer, info in list(registry.items()):
        if getattr(info, "func", None) is unregister:
            finalizer.atexit = False


def leave(code: int, run_atexit: bool = True) -> None:
    """End this process now with ``code``: atexit hooks, flushed output, no interpreter teardown."""
    if run_atexit:
        skip_exit_only_finalizers()
        atexit._run_exitfuncs()
    flush_output()
    os._exit(code)
