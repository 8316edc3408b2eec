"""The one place that touches CPython's private ``multiprocessing`` state (fork server, tracker).

The standard library offers no public way to ask for the fork server's pid, restart it with
other preloaded modules, or make a forked child forget the server it came from. Both sides need
some of that; keeping it here means a CPython change breaks one small file.
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


def start_forkserver(preload: list[str], restart: bool) -> None:
    """Make sure a fork server runs that preloads ``preload``; ``restart`` stops a running one."""
    server = multiprocessing.forkserver._forkserver
    if restart and server._forkserver_pid is not None:
        server._stop()  # a server started without these modules cannot gain them
    if server._forkserver_pid is None:
        server.set_forkserver_preload(list(preload))
    server.ensure_running()


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
