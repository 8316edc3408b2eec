"""The fork server ranks start from: a clean interpreter that has imported torch once.

Ranks fork from it in milliseconds and never inherit the kernel's threads or CUDA context.
"""

from __future__ import annotations

import multiprocessing
import threading

from nbaccel.core import mp_internals

# Imported once by the fork server; every rank then starts with them loaded.
SERVER_PRELOAD = ("nbaccel.rank.preload",)

_server_lock = threading.Lock()
_server_modules: tuple[str, ...] = ()


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
    global _server_modules
    wanted = tuple(dict.fromkeys(SERVER_PRELOAD + tuple(extra_modules)))
    with _server_lock:
        restart = not set(wanted) <= set(_server_modules)
        if restart or mp_internals.forkserver_pid() is None:
            _server_modules = wanted
        mp_internals.start_forkserver(list(wanted), restart=restart)


def helper_pids() -> set[int]:
    """Long-lived helpers of this process that are not ranks: the fork server and the
    resource tracker multiprocessing starts beside it."""
    pids = {mp_internals.forkserver_pid(), mp_internals.resource_tracker_pid()}
    return {p for p in pids if p is not None}
