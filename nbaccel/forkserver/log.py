"""Imported by the fork server right after its guard: the server's own output goes to a log
file of bounded size that the kernel names (``NBACCEL_SERVER_LOG``), never into a cell.

The server inherits the kernel's standard streams, which a kernel forwards into whichever
cell runs: a package that prints or warns while the mirror imports it put megabytes into a
launch cell, and its warning reappeared in the next, unrelated cell. Here, file descriptors 1
and 2 become a pipe that a thread copies into the log until :data:`LIMIT` bytes, and discards
after (so a writer never blocks). Ranks forked from the server put their own pipes there
(``rank.startup``).

Importing this module anywhere but in the fork server does nothing.
"""

from __future__ import annotations

import os
import threading
from typing import BinaryIO

from nbaccel.forkserver.guard import in_fork_server
from nbaccel.forkserver.protocol import ENV_SERVER_LOG

LIMIT = 1024 * 1024  # bytes of the server's output kept per server


def redirect(path: str, limit: int = LIMIT) -> None:
    """Send this process's file descriptors 1 and 2 into ``path`` (made at the first byte), its
    first ``limit`` bytes."""
    read_end, write_end = os.pipe()
    os.dup2(write_end, 1)
    os.dup2(write_end, 2)
    os.close(write_end)
    log: list[BinaryIO] = []  # opened at the first byte: a quiet server leaves no file
    os.register_at_fork(after_in_child=lambda: _close(read_end, log))
    thread = threading.Thread(
        target=_copy, args=(read_end, path, log, limit), name="nbaccel-server-log", daemon=True
    )
    thread.start()


def _copy(read_end: int, path: str, log: list[BinaryIO], limit: int) -> None:
    kept = 0
    while chunk := os.read(read_end, 65536):
        if kept >= limit:
            continue
        if not log:
            try:
                log.append(open(path, "ab", buffering=0))  # noqa: SIM115 - kept for good
            except OSError:
                kept = limit  # nowhere to keep it: discarded, never blocking the writer
                continue
        log[0].write(chunk[: limit - kept])
        kept += len(chunk)
        if kept >= limit:
            note = f"\n[nbaccel: the fork server's output past {limit:,} bytes is not kept]\n"
            log[0].write(note.encode())


def _close(read_end: int, log: list[BinaryIO]) -> None:
    """In a rank: the server's log is not its own."""
    try:
        os.close(read_end)
        for f in log:
            f.close()
    except OSError:
        pass


if in_fork_server() and os.environ.get(ENV_SERVER_LOG):
    redirect(os.environ[ENV_SERVER_LOG])
