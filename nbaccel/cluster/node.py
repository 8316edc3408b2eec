"""On a cluster node: the Ray actor that starts one rank and answers for it (:class:`RankHost`).

The actor connects the rank's five connections to the kernel (``wire``), starts the rank as a
child process (``remote_entry``, nbaccel's normal rank entry on those sockets) and watches it
from a thread: when the rank exits it sweeps what is left of the rank's session, then sends
the exit status; when the kernel's end of the status connection closes (the kernel died, or
its launch was torn down), it kills the rank's session. The rank itself dies with the actor
(``PR_SET_PDEATHSIG``, set by the rank entry): Ray kills an actor whose owner, the kernel's
driver, has gone. Imports only the standard library, psutil and ``nbaccel.core``.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import select
import signal
import socket
import subprocess
import sys
import threading

import psutil

from nbaccel.cluster import wire
from nbaccel.core import process_table, rendezvous

PIPES = ("stdout", "stderr", "diag", "events")


class RankHost:
    """One rank's host on its node; a Ray actor (``ray.remote(RankHost)``) in a placement group."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen[bytes] | None = None
        self._strays: list[tuple[int, str]] = []

    def where(self) -> str:
        """This node's address, as the other nodes reach it (Ray's own node address)."""
        import ray

        return str(ray.util.get_node_ip_address())

    def free_port(self, host: str) -> int:
        """A port free on this node now: rank 0's rendezvous store listens there."""
        return rendezvous.free_port(host)

    def start(self, spec: bytes, kernel: tuple[str, int], token: str, rank: int) -> int:
        """Connect to the kernel, start the rank with ``spec`` (a pickled RankSpec and its
        rendezvous); return the rank's pid. Runs on the actor's main thread, which lives as
        long as the actor, so the rank's parent-death signal means the actor's death."""
        address = (str(kernel[0]), int(kernel[1]))  # a list, once through Ray's serializer
        socks = {kind: wire.connect(address, token, rank, kind) for kind in wire.KINDS}
        fds = [socks[kind].fileno() for kind in PIPES]
        env = dict(os.environ)
        # Ray's GPU assignment for this actor overrides the kernel's (the rank copies the
        # kernel's environment).
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "nbaccel.cluster.remote_entry", *map(str, fds)],
            stdin=subprocess.PIPE,
            pass_fds=fds,
            env=env,
        )
        assert self._proc.stdin is not None
        self._proc.stdin.write(pickle.dumps((spec, visible)))
        self._proc.stdin.close()
        for kind in PIPES:  # the rank holds them now
            socks[kind].close()
        threading.Thread(
            target=self._watch, args=(socks["status"],), name="nbaccel-rank-watch", daemon=True
        ).start()
        return self._proc.pid

    def signal(self, sig: int, tree: bool = True) -> None:
        """Send ``sig`` to the rank (with ``tree``: its session and descendants too)."""
        proc = self._proc
        if proc is None or proc.poll() is not None:
            return
        if tree:
            _signal_session(proc.pid, sig)
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, sig)

    def strays(self) -> list[tuple[int, str]]:
        """(pid, command) of what the rank left running that the sweep killed."""
        return list(self._strays)

    def _watch(self, status: socket.socket) -> None:
        proc = self._proc
        assert proc is not None
        while proc.poll() is None:
            readable, _, _ = select.select([status], [], [], 0.2)
            if readable and not _recv(status):  # the kernel is gone: so is the launch
                _signal_session(proc.pid, signal.SIGKILL)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGKILL)
                proc.wait()
        self._strays = _signal_session(proc.pid, signal.SIGKILL)
        with contextlib.suppress(OSError):
            status.sendall(wire.STATUS.pack(proc.returncode))
        status.close()


def _signal_session(sid: int, sig: int) -> list[tuple[int, str]]:
    """Signal every process of session ``sid`` but its leader (the rank leads its session and
    is a subreaper, so what it starts stays in it unless it calls setsid itself); return them."""
    found = []
    for p in psutil.process_iter():
        try:
            if p.pid != sid and os.getsid(p.pid) == sid:
                found.append(p)
        except (OSError, psutil.Error):
            continue
    named = [(p.pid, process_table.describe(p)) for p in found]
    process_table.signal_all(found, sig)
    return named


def _recv(sock: socket.socket) -> bytes:
    try:
        return sock.recv(1)
    except OSError:
        return b""
