"""The one place that touches CPython's private ``multiprocessing`` state (fork server, tracker).

The standard library offers no public way to ask for the fork server's pid (containment sweeps
by it, the answer watchdog stops it), restart it with other preloaded modules, or make a forked
child forget the server it came from. Both sides need some of that; keeping it here means a
CPython change breaks one small file. The private names used: ``forkserver._forkserver`` and
its ``_forkserver_pid``, ``_forkserver_alive_fd``, ``_forkserver_address``, ``_stop()``, and
``resource_tracker._resource_tracker._pid``.
"""

from __future__ import annotations

import multiprocessing.forkserver
import os


def forkserver_pid() -> int | None:
    """The running fork server's pid, or ``None`` when this process has not started one."""
    return multiprocessing.forkserver._forkserver._forkserver_pid


def resource_tracker_pid() -> int | None:
    from multiprocessing import resource_tracker

    return getattr(resource_tracker._resource_tracker, "_pid", None)


def start_forkserver(preload: list[str], restart: bool, env: dict[str, str] | None = None) -> bool:
    """Make sure a fork server runs that preloads ``preload``; ``restart`` stops a running one.

    ``env`` is added to the environment of a server started now; returns whether one was.
    """
    server = multiprocessing.forkserver._forkserver
    if restart and server._forkserver_pid is not None:
        server._stop()  # a server started without these modules cannot gain them
    if server._forkserver_pid is None:
        server.set_forkserver_preload(list(preload))
    starting = not server_alive(server._forkserver_pid)
    saved = {k: os.environ.get(k) for k in env or {}}
    if starting:
        os.environ.update(env or {})  # the server inherits the environment as it is now
    try:
        server.ensure_running()
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return starting


def server_alive(pid: int | None) -> bool:
    """Whether the server ``pid`` runs (without reaping it: ``ensure_running`` does that)."""
    if pid is None:
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc (macOS): ask the kernel whether the pid exists
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


def forget_forkserver() -> None:
    """In a process forked by the fork server: drop the server's "alive" pipe and its address.

    The server only exits once every holder of that pipe has closed it; a rank holding it
    would keep the server (and so itself) alive after the kernel died. A process that then
    starts processes of its own gets a fresh server.
    """
    server = multiprocessing.forkserver._forkserver
    fd = getattr(server, "_forkserver_alive_fd", None)
    if fd is not None:
        try:
            os.close(fd)
        except OSError:
            pass
    server._forkserver_alive_fd = None
    server._forkserver_address = None
    server._forkserver_pid = None
