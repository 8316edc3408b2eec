"""How a persistent-rank session starts: its plan, each rank's command connection, the cell view.

The plan follows ``notebook_launcher``'s rules (:func:`~nbaccel.launch.plan.resolve_plan`) with
``nbaccel.persistent.serve.serve`` as the rank's function; each rank then connects to the
session's Unix socket and says which rank it is.
"""

from __future__ import annotations

import dataclasses
import pickle
import selectors
import socket
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection

from nbaccel.launch.options import UNSET, LaunchOptions
from nbaccel.launch.plan import LaunchPlan, resolve_plan
from nbaccel.launch.relay import Relay
from nbaccel.launch.state import LaunchState
from nbaccel.persistent.cell import RanksBrokenError
from nbaccel.persistent.messages import Hello
from nbaccel.persistent.serve import serve
from nbaccel.ui.text import TextView

START_TIMEOUT = 120.0  # s for every rank to connect its command socket
# What every rank runs first: the process group forms inside Accelerator().
SETUP_CODE = (
    "import torch\n"
    "import torch.distributed as dist\n"
    "import nbaccel\n"
    "accelerator = nbaccel.Accelerator()\n"
)


class CellTextView(TextView):
    """The text view for one cell: ``[rankN]`` lines only, no launch banner or summary."""

    def start(self, state: LaunchState) -> None:
        self._state = state
        self._last_progress = time.monotonic()

    def finish(self) -> None:
        self._print_skipped(force=True)
        self._flush()

    def _print_waiting(self, now: float) -> None:
        # `%ranks start` says "starting 2 ranks… ready (...)" on one line, finished by the
        # session when its ranks connect: a waiting line would cut it in two.
        pass


def session_plan(options: LaunchOptions, gpus: Sequence[int] | None, address: str) -> LaunchPlan:
    """The launch plan of a session: ``notebook_launcher``'s rules, ``serve`` as the function;
    ``gpus`` (e.g. ``[0, 1]``) maps rank i to the i-th listed GPU."""
    if gpus is not None:
        env = dict(options.env or {})
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(int(g)) for g in gpus)
        nprocs = options.num_processes
        nprocs = len(gpus) if nprocs in (UNSET, None) else nprocs
        options = dataclasses.replace(options, env=env, num_processes=nprocs)
    return resolve_plan(serve, (address,), {}, options)


def accept_ranks(server: socket.socket, relay: Relay) -> dict[int, Connection]:
    """Take each rank's command connection, watching for a rank that dies first.

    Each connection is also registered in the relay's selector (as ``(rank, "reply")``).
    """
    group = relay.group
    connections: dict[int, Connection] = {}
    selector = selectors.DefaultSelector()
    selector.register(server, selectors.EVENT_READ, None)
    for r in group.ranks:
        selector.register(r.sentinel, selectors.EVENT_READ, r)
    deadline = time.monotonic() + START_TIMEOUT
    try:
        while len(connections) < len(group.ranks):
            if time.monotonic() > deadline:
                raise RanksBrokenError(f"the ranks did not connect within {START_TIMEOUT:g} s")
            for key, _ in selector.select(0.5):
                if key.data is not None:
                    relay.drain(key.data)
                    diag = relay.state.ranks[key.data.rank].diag.strip()
                    raise RanksBrokenError(f"rank {key.data.rank} exited while starting", diag)
                sock, _ = server.accept()
                conn = Connection(sock.detach())
                if not conn.poll(30):
                    raise RanksBrokenError("a rank connected but did not say which it is")
                hello: Hello = pickle.loads(conn.recv_bytes())
                connections[hello.rank] = conn
                r = next(p for p in group.ranks if p.rank == hello.rank)
                relay.watch(conn.fileno(), (r, "reply"))
    finally:
        selector.close()
    return connections
