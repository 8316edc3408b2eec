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
import select
import signal
import socket
import sys
import threading
from multiprocessing.connection import Connection

from nbaccel.core.private_socket import PrivateListener
from nbaccel.rank.debugger import ENV_ADDRESS, ENV_KEY

STDIN_LOOK = 0.2  # seconds between looks at whether the launch ended while a prompt waits


class TerminalDebugging:
    """The launcher's end: accept the ranks that pause, relay them to the terminal in turn."""

    def __init__(self) -> None:
        self._key = os.urandom(32)
        # This user only; a peer that fails to authenticate is dropped (core.private_socket).
        self._listener = PrivateListener(self._key, prefix="nbaccel-launch-debug-")
        self.address = self._listener.address
        self._turn = threading.Lock()  # one rank at the terminal at a time
        self._closed = False
        self._stdin = sys.stdin.fileno() if sys.stdin is not None else -1
        self._pending = b""  # typed (or piped) past the line asked for
        # Why the launch stops, where a rank's pdb stopped it (said instead of "stopped by
        # SIGINT", which is how it is stopped, not why).
        self.stop_reason: str | None = None
        threading.Thread(target=self._accept, name="nbaccel-debug", daemon=True).start()

    def environment(self) -> dict[str, str]:
        """What the ranks need to reach this terminal."""
        return {ENV_ADDRESS: self.address, ENV_KEY: self._key.hex()}

    def _accept(self) -> None:
        while not self._closed:
            try:
                peer = self._listener.accept_peer()
            except OSError:
                if self._closed:
                    return
                continue
            if peer is not None:  # authenticated in its own thread: a silent peer holds no one
                threading.Thread(target=self._authenticated, args=(peer,), daemon=True).start()

    def _authenticated(self, peer: socket.socket) -> None:
        conn = self._listener.authenticate(peer)
        if conn is not None:
            self._serve(conn)

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
                        reply = self._ask(rest[0])
                        if reply == ("eof",) and not self._closed:
                            print(file=sys.stdout, flush=True)  # the prompt's line ends
                            self.stop_reason = (
                                f"end of input on stdin at rank {rank}'s pdb prompt, so the "
                                "launch stops"
                            )
                        conn.send(reply)
                    elif kind == "quit":
                        self.stop_reason = self.stop_reason or f"q in rank {rank}'s pdb"
                        # Ctrl-C's way out: torch elastic stops every rank, this one included.
                        os.kill(os.getpid(), signal.SIGINT)
                        conn.recv()  # until this rank is stopped
                    else:
                        return
            except (OSError, EOFError):
                return

    def _ask(self, prompt: str) -> tuple[str, ...]:
        """One line from the terminal for a rank's prompt: ``("line", text)``, or ``("eof",)``
        at the end of stdin (or once the launch ends).

        Read from the descriptor, not with ``input()``: this thread may still wait for a line
        when the launch ends (Ctrl-C, a rank's failure), and a daemon thread inside
        ``sys.stdin``'s buffered reader at interpreter exit is a fatal error
        (``_enter_buffered_busy``). Here it waits in ``select`` and leaves when closed."""
        sys.stdout.write(prompt)
        sys.stdout.flush()
        while b"\n" not in self._pending:
            try:
                ready, _, _ = select.select([self._stdin], [], [], STDIN_LOOK)
            except (OSError, ValueError):
                return ("eof",)
            if self._closed:
                return ("eof",)
            if not ready:
                continue
            try:
                data = os.read(self._stdin, 4096)
            except OSError:
                data = b""
            if not data:  # end of input: a line without its newline still counts
                if not self._pending:
                    return ("eof",)
                self._pending += b"\n"
                break
            self._pending += data
        line, _, self._pending = self._pending.partition(b"\n")
        return ("line", line.decode(errors="replace").removesuffix("\r"))

    def close(self) -> None:
        self._closed = True
        self._listener.close()
