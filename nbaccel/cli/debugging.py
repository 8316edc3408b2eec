"""``breakpoint()`` and ``input()`` in the ranks of ``nbaccel launch``: pdb on the launcher's
terminal, one rank at a time.

The launcher listens on a Unix socket of its own (:class:`TerminalDebugging`) and tells the
ranks where through their environment (``rank.debugger.ENV_ADDRESS``/``ENV_KEY``). A rank that
waits for a person connects only then and asks for its lines there (``rank.debugger.Console``);
the launcher answers one rank at a time from its terminal: the others wait for their turn
(connected, paused), so two ranks never read the same keyboard. pdb's ``q`` stops the launch as
Ctrl-C does (the launcher interrupts itself; torch elastic stops every rank), so no rank is left
waiting for a peer that will never come (the trap of ``torch.distributed.breakpoint``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from multiprocessing.connection import Connection, Listener

from nbaccel.rank.debugger import ENV_ADDRESS, ENV_KEY


class TerminalDebugging:
    """The launcher's end: accept the ranks that pause, relay them to the terminal in turn."""

    def __init__(self) -> None:
        self._key = os.urandom(32)
        token = os.urandom(8).hex()
        address = f"\0nbaccel-launch-debug-{os.getpid()}-{token}"
        self._folder = None
        if not sys.platform.startswith("linux"):
            import tempfile

            self._folder = tempfile.mkdtemp(prefix="nbaccel-debug-")
            address = os.path.join(self._folder, "s")
        self._listener = Listener(address, family="AF_UNIX", authkey=self._key)
        self.address = address
        self._turn = threading.Lock()  # one rank at the terminal at a time
        self._closed = False
        threading.Thread(target=self._accept, name="nbaccel-debug", daemon=True).start()

    def environment(self) -> dict[str, str]:
        """What the ranks need to reach this terminal."""
        # An environment variable holds no NUL: Linux's abstract names travel with "@" instead.
        return {ENV_ADDRESS: self.address.replace("\0", "@", 1), ENV_KEY: self._key.hex()}

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn = self._listener.accept()
            except (OSError, EOFError):
                if self._closed:
                    return
                continue  # a connection that failed to authenticate
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: Connection) -> None:
        with self._turn, contextlib.closing(conn):
            try:
                _, rank, reason, file, line, _function = conn.recv()
                print(f"nbaccel: rank {rank} paused in {reason} at {file}, line {line}", flush=True)
                conn.send(("labels", {}))
                while True:
                    kind, *rest = conn.recv()
                    if kind == "out":
                        sys.stdout.write(rest[0])
                        sys.stdout.flush()
                    elif kind == "ask":
                        conn.send(_ask(rest[0]))
                    elif kind == "quit":
                        # Ctrl-C's way out: torch elastic stops every rank, this one included.
                        os.kill(os.getpid(), signal.SIGINT)
                        conn.recv()  # until this rank is stopped
                    else:
                        return
            except (OSError, EOFError):
                return

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._listener.close()
        if self._folder is not None:
            import shutil

            shutil.rmtree(self._folder, ignore_errors=True)


def _ask(prompt: str) -> tuple[str, ...]:
    try:
        return ("line", input(prompt))
    except EOFError:
        return ("eof",)
