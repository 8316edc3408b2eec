"""The one place that touches CPython's private ``multiprocessing`` state (fork server, tracker).

The standard library offers no public way to ask for the fork server's pid (containment sweeps
by it, an unanswered start sets it aside), restart it with other preloaded modules, or make a forked
child forget the server it came from. Both sides need some of that; keeping it here means a
CPython change breaks one small file. The private names used: ``forkserver._forkserver`` and
its ``_forkserver_pid``, ``_forkserver_alive_fd``, ``_forkserver_address``, ``_lock``,
``_stop()``, and ``resource_tracker._resource_tracker``'s ``_pid``, ``_fd`` and ``_lock``.
"""

from __future__ import annotations

import contextlib
import multiprocessing.forkserver
import multiprocessing.util
import os
import signal
import threading
import time
from typing import Any


def forkserver_pid() -> int | None:
    """The running fork server's pid, or ``None`` when this process has not started one."""
    server: Any = multiprocessing.forkserver._forkserver  # its fields are CPython's private ones
    return server._forkserver_pid


def resource_tracker_pid() -> int | None:
    from multiprocessing import resource_tracker

    return getattr(resource_tracker._resource_tracker, "_pid", None)


def let_resource_tracker_go() -> None:
    """Close this process's end of the resource tracker's pipe without waiting for it, and
    reap it in a thread once it exits: it does when every process holding the pipe (fork
    servers, ranks) has ended. For a process about to end: a later need of the tracker would
    start another."""
    from multiprocessing import resource_tracker

    tracker: Any = resource_tracker._resource_tracker
    with tracker._lock:
        fd, pid = tracker._fd, tracker._pid
        if fd is None:
            return
        tracker._fd = tracker._pid = None
    with contextlib.suppress(OSError):
        os.close(fd)
    if pid is not None:
        threading.Thread(target=_reap, args=(pid,), name="nbaccel-reap", daemon=True).start()


def _reap(pid: int) -> None:
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, 0)


def start_forkserver(preload: list[str], restart: bool, env: dict[str, str] | None = None) -> bool:
    """Make sure a fork server runs that preloads ``preload``; ``restart`` stops a running one.

    ``env`` is added to the environment of a server started now; returns whether one was.
    """
    server: Any = multiprocessing.forkserver._forkserver
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


def detach_forkserver() -> tuple[int, int, Any] | None:
    """Forget the running fork server without stopping it, so the next start begins a new one
    while this one goes on serving the ranks it forked; returns what :func:`end_detached`
    needs to stop it once they have ended (``None`` when none runs)."""
    server: Any = multiprocessing.forkserver._forkserver  # private fields typeshed lacks
    with server._lock:
        if server._forkserver_pid is None:
            return None
        detached = (server._forkserver_pid, server._forkserver_alive_fd, server._forkserver_address)
        server._forkserver_pid = server._forkserver_alive_fd = server._forkserver_address = None
    return detached


def end_detached(detached: tuple[int, int, Any], wait: float = 2.0) -> None:
    """Stop a server :func:`detach_forkserver` set aside (as ``ForkServer._stop`` does): close
    its "alive" pipe, reap it (SIGKILL after ``wait`` s: one retired because an import hung
    may not exit), remove its socket."""
    pid, alive_fd, address = detached
    with contextlib.suppress(OSError):
        os.close(alive_fd)
    deadline = time.monotonic() + wait
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(pid, os.WNOHANG) == (0, 0):
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                break
            time.sleep(0.01)
    if address and not multiprocessing.util.is_abstract_socket_namespace(address):
        with contextlib.suppress(OSError):
            os.unlink(address)


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


def server_gone(server: int | None, wait: float = 1.0) -> bool:
    """Whether the fork server ``server`` (a rank's own: the current one or one retired while
    its ranks ran) has died; its sockets close before it is a zombie, so its rank's end can
    arrive first: give it ``wait`` seconds."""
    deadline = time.monotonic() + wait
    while server is not None and server_alive(server):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return server is not None


def forget_forkserver() -> None:
    """In a process forked by the fork server: drop the server's "alive" pipe and its address.

    The server only exits once every holder of that pipe has closed it; a rank holding it
    would keep the server (and so itself) alive after the kernel died. A process that then
    starts processes of its own gets a fresh server.
    """
    server: Any = multiprocessing.forkserver._forkserver
    fd = getattr(server, "_forkserver_alive_fd", None)
    if fd is not None:
        try:
            os.close(fd)
        except OSError:
            pass
    server._forkserver_alive_fd = None
    server._forkserver_address = None
    server._forkserver_pid = None
