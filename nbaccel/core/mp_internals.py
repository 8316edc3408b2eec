"""The one place that touches CPython's private ``multiprocessing`` state (fork server, tracker).

The standard library offers no public way to ask for the fork server's pid, restart it with
other preloaded modules, or make a forked child forget the server it came from. Both sides need
some of that; keeping it here means a CPython change breaks one small file.
"""

from __future__ import annotations

import multiprocessing.forkserver
import os
import socket
import threading
import warnings
from collections.abc import Callable
from multiprocessing import connection, resource_tracker, util


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


def can_fork_forkserver() -> bool:
    """Whether :func:`fork_forkserver` knows this Python's fork server (3.10-3.12: no auth key)."""
    server = multiprocessing.forkserver._forkserver
    known = ("_forkserver_address", "_forkserver_alive_fd", "_forkserver_pid", "_preload_modules")
    return all(hasattr(server, a) for a in known) and not hasattr(server, "_forkserver_authkey")


def fork_forkserver(serve: Callable[[int, int], object], preload: list[str]) -> int:
    """Start the fork server as a fork of this process that runs ``serve(listener_fd, alive_r)``
    (which must end in ``os._exit``), instead of a fresh interpreter; return its pid.

    The kernel's side is what ``ForkServer.ensure_running`` sets up (the listening socket, the
    "alive" pipe, the resource tracker), so starting ranks is unchanged. ``preload`` is recorded
    too: should this server die, multiprocessing starts an ordinary one with the same modules.
    Call only when no server runs (:func:`server_alive`) and :func:`can_fork_forkserver`.
    """
    server = multiprocessing.forkserver._forkserver
    server.set_forkserver_preload(list(preload))
    # Not under server._lock: a child would inherit it held, and a rank that starts a fork
    # server of its own would wait on it forever.
    resource_tracker.ensure_running()
    if server._forkserver_pid is not None:  # one that died: what ensure_running would do
        os.waitpid(server._forkserver_pid, os.WNOHANG)
        os.close(server._forkserver_alive_fd)
    with socket.socket(socket.AF_UNIX) as listener:
        address = connection.arbitrary_address("AF_UNIX")
        listener.bind(address)
        if not util.is_abstract_socket_namespace(address):
            os.chmod(address, 0o600)
        listener.listen()
        alive_r, alive_w = os.pipe()
        try:
            with warnings.catch_warnings():
                # Python 3.12+ warns of fork() in a multi-threaded process; the caller has
                # made sure the child never uses what the other threads own.
                warnings.simplefilter("ignore", DeprecationWarning)
                pid = os.fork()
            if pid == 0:
                try:
                    serve(listener.fileno(), alive_r)
                finally:
                    os._exit(1)  # never back into the caller's frames
        except BaseException:
            os.close(alive_w)
            raise
        finally:
            os.close(alive_r)
    server._forkserver_address = address
    server._forkserver_alive_fd = alive_w
    server._forkserver_pid = pid
    return pid


def reset_forkserver_lock() -> None:
    """In a process forked without exec: a fresh lock for the fork-server record, in case the
    fork happened while another thread held it."""
    multiprocessing.forkserver._forkserver._lock = threading.Lock()


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
