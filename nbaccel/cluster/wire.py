"""The connections between a rank on a cluster node and the kernel: one TCP stream per pipe.

A rank on this machine writes to four pipes (stdout, stderr, diagnostics, events) and the
kernel sees its exit through a sentinel. A rank on another node writes to four TCP connections
instead, which the node's actor opened to the kernel before starting it, plus a fifth,
``status``, on which the actor sends the rank's exit status when it has ended. Each connection
opens with one header line, ``<token> <rank> <kind>``, so the kernel knows whose it is and
refuses strangers. Plain sockets, so the kernel's relay reads them as it reads pipes.

>>> header("t0k", 3, "events")
b't0k 3 events\\n'
"""

from __future__ import annotations

import socket
import struct

KINDS = ("stdout", "stderr", "diag", "events", "status")
STATUS = struct.Struct("!i")  # the rank's exit status, as multiprocessing reports it
HEADER_LIMIT = 200


def header(token: str, rank: int, kind: str) -> bytes:
    """The first line of a connection of ``rank``'s ``kind``."""
    return f"{token} {rank} {kind}\n".encode()


def connect(address: tuple[str, int], token: str, rank: int, kind: str) -> socket.socket:
    """Open ``rank``'s ``kind`` connection to the kernel listening at ``address``."""
    sock = socket.create_connection(address, timeout=30)
    sock.settimeout(None)
    sock.sendall(header(token, rank, kind))
    return sock


def read_header(sock: socket.socket, timeout: float = 10.0) -> tuple[str, int, str] | None:
    """The (token, rank, kind) a fresh connection announces, or ``None`` if it is no rank's."""
    sock.settimeout(timeout)
    data = b""
    try:
        while not data.endswith(b"\n") and len(data) < HEADER_LIMIT:
            chunk = sock.recv(1)
            if not chunk:
                return None
            data += chunk
    except OSError:
        return None
    finally:
        sock.settimeout(None)
    parts = data.decode(errors="replace").split()
    if len(parts) != 3 or not parts[1].isdigit() or parts[2] not in KINDS:
        return None
    return parts[0], int(parts[1]), parts[2]
