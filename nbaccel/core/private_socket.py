"""A Unix socket only this user can reach: where a paused rank's pdb waits for the kernel (and
``nbaccel launch``'s terminal for its ranks).

A debugger's socket drives a live process, so nobody else may touch it, and nobody else may stop
it from being reached either. Three walls, each enough against another local user alone:

- the socket is a file in a folder of its own made by ``mkdtemp`` (mode 0700): another user
  cannot even connect (an abstract Linux name, used before, has no mode: any local user could
  connect, and it is listed in the world-readable ``/proc/net/unix``);
- on Linux the peer's user id (``SO_PEERCRED``) is checked before a byte is read;
- the authentication (multiprocessing's challenge, with a key only the event pipe or the
  launcher's environment carried) has a time limit, and a peer that fails it or stays silent is
  dropped and waited past: it never fails, hangs or delays the rank or the prompt. The first
  such peer is noted once, on stderr.

>>> listener = PrivateListener(os.urandom(32))
>>> oct(os.stat(listener.folder).st_mode & 0o777)
'0o700'
>>> listener.close(); os.path.exists(listener.folder)
False
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import struct
import sys
import tempfile
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge

# Seconds a peer of this user has to authenticate; past them it is dropped (a stuck client must
# not hold the rank or the launcher's terminal).
AUTH_SECONDS = 5.0
SOCKET_FOLDER_PREFIX = "nbaccel-debug-"  # a paused rank's folder (removed by whoever is last)


def peer_uid(sock: socket.socket) -> int | None:
    """The user id of the process at the other end of a Unix socket (``None`` where the system
    does not say)."""
    option = getattr(socket, "SO_PEERCRED", None)
    if option is None:
        return None
    pid_uid_gid = sock.getsockopt(socket.SOL_SOCKET, option, struct.calcsize("3i"))
    return int(struct.unpack("3i", pid_uid_gid)[1])


def _set_receive_timeout(sock: socket.socket, seconds: float) -> None:
    """A time limit on a blocking read of ``sock``'s descriptor (0: none), which the
    ``Connection`` made of it keeps: a read past it fails with ``OSError`` instead of waiting."""
    whole = int(seconds)
    value = struct.pack("ll", whole, int((seconds - whole) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, value)


class PrivateListener:
    """A listening Unix socket in a private folder; :meth:`accept` returns only authenticated
    connections of this user."""

    def __init__(self, authkey: bytes, prefix: str = SOCKET_FOLDER_PREFIX) -> None:
        self.folder = tempfile.mkdtemp(prefix=prefix)  # mode 0700: this user only
        self.address = os.path.join(self.folder, "s")
        self._authkey = authkey
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._sock.bind(self.address)
            self._sock.listen()
        except OSError:
            self.close()
            raise
        self._noted = False

    def accept(self) -> Connection:
        """The next peer of this user that authenticates (others are dropped; the first
        dropped is noted on stderr)."""
        while True:
            conn = self.accept_one()
            if conn is not None:
                return conn

    def accept_one(self) -> Connection | None:
        """The next peer, authenticated, or ``None`` where it was dropped. Raises ``OSError``
        once the listener is closed."""
        peer = self.accept_peer()
        return None if peer is None else self.authenticate(peer)

    def accept_peer(self) -> socket.socket | None:
        """The next peer not yet authenticated (for :meth:`authenticate` in a thread of its
        own), or ``None`` where it was another user's. Raises ``OSError`` once closed."""
        peer, _ = self._sock.accept()
        uid = peer_uid(peer)
        if uid is not None and uid != os.getuid():
            peer.close()
            self._note(f"a process of user id {uid}, not this launch's user")
            return None
        return peer

    def authenticate(self, peer: socket.socket) -> Connection | None:
        """``peer`` as a ``Connection`` once it proved it holds the key, else ``None`` (a wrong
        key, a peer that closed or stayed silent past :data:`AUTH_SECONDS`)."""
        _set_receive_timeout(peer, AUTH_SECONDS)
        conn = Connection(peer.detach())
        try:
            deliver_challenge(conn, self._authkey)
            answer_challenge(conn, self._authkey)
        except (AuthenticationError, OSError, EOFError, ValueError) as exc:
            conn.close()
            self._note(f"a peer that did not authenticate ({type(exc).__name__})")
            return None
        with socket.socket(fileno=os.dup(conn.fileno())) as same:
            _set_receive_timeout(same, 0)  # authenticated: it may take its time from now on
        return conn

    def _note(self, who: str) -> None:
        if self._noted:
            return
        self._noted = True
        with contextlib.suppress(Exception):
            print(
                f"nbaccel: ignored a connection to the debugger's socket from {who}",
                file=sys.stderr,
                flush=True,
            )

    def close(self) -> None:
        """Stop listening and remove the folder (idempotent)."""
        with contextlib.suppress(OSError):
            self._sock.close()
        shutil.rmtree(self.folder, ignore_errors=True)

    def __enter__(self) -> PrivateListener:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
