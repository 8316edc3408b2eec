"""The fork server ranks start from: a clean interpreter that has imported torch once.

Ranks fork from it in milliseconds and never inherit the kernel's threads or CUDA context.
"""

from __future__ import annotations

import multiprocessing
import os
import tempfile
import threading
import time

from nbaccel.core import mp_internals
from nbaccel.launch import containment

# Imported once by the fork server; every rank then starts with them loaded. The guard comes
# first (the server's own group, subreaper, kill its tree at exit), the ready signal last.
SERVER_PRELOAD = ("nbaccel.rank.server_guard", "nbaccel.rank.preload")
SERVER_READY = "nbaccel.rank.server_ready"
ENV_READY_FILE = "NBACCEL_SERVER_READY_FILE"

_server_lock = threading.Lock()
_server_modules: tuple[str, ...] = ()
_ready_marker: str | None = None  # exists while the server started last is still importing


def available_start_methods() -> list[str]:
    return multiprocessing.get_all_start_methods()


def resolve_start_method(name: str) -> str:
    """Map ``"auto"`` to the best method here and reject methods this platform lacks."""
    methods = available_start_methods()
    if name == "auto":
        return "forkserver" if "forkserver" in methods else "spawn"
    if name not in methods:
        raise ValueError(
            f"start_method={name!r} is not available on this platform; "
            f"choose one of {', '.join(map(repr, ['auto', *methods]))}."
        )
    return name


def ensure_server(extra_modules: tuple[str, ...] = ()) -> None:
    """Start the fork server (or restart it when it lacks ``extra_modules``); returns at once.

    The server imports its modules in the background; the first rank start waits for that.
    """
    global _server_modules, _ready_marker
    wanted = tuple(dict.fromkeys(SERVER_PRELOAD + tuple(extra_modules) + (SERVER_READY,)))
    # Ctrl-C waits until the server is started (or stopped and restarted): cut in half, the
    # next launch would find multiprocessing's record of it inconsistent.
    with _server_lock, containment.sigint_deferred():
        restart = not set(wanted) <= set(_server_modules)
        if restart or mp_internals.forkserver_pid() is None:
            _server_modules = wanted
        fd, marker = tempfile.mkstemp(prefix="nbaccel-server-warming-")
        os.close(fd)
        started = mp_internals.start_forkserver(
            list(wanted), restart=restart, env={ENV_READY_FILE: marker}
        )
        if started:
            _discard(_ready_marker)
            _ready_marker = marker
        else:
            _discard(marker)


def wait_until_ready(poll: float = 0.02) -> None:
    """Wait until the fork server started by :func:`ensure_server` has finished importing.

    Returns at once for a server that is ready (or that nbaccel did not start). The wait is
    interruptible: a ``KeyboardInterrupt`` here leaves no rank half-started, because none was
    asked for yet.
    """
    global _ready_marker
    marker = _ready_marker
    while marker is not None and os.path.exists(marker):
        pid = mp_internals.forkserver_pid()
        if pid is None or not mp_internals.server_alive(pid):
            break  # it died importing; starting a rank will start (and wait for) a new one
        time.sleep(poll)
    _discard(marker)
    if _ready_marker == marker:
        _ready_marker = None


def _discard(path: str | None) -> None:
    if path is not None:
        try:
            os.unlink(path)
        except OSError:
            pass


def helper_pids() -> set[int]:
    """Long-lived helpers of this process that are not ranks: the fork server and the
    resource tracker multiprocessing starts beside it."""
    pids = {mp_internals.forkserver_pid(), mp_internals.resource_tracker_pid()}
    return {p for p in pids if p is not None}
