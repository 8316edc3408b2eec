"""The kernel's side of ranks on a Ray cluster: :class:`RayRankGroup`, shaped like ``RankGroup``.

The launch (``launch.handle.Launch``), the loop and the relay use a group and its ranks through
the same few methods whether the ranks run here or on a cluster: ``start``, ``alive``,
``send_signal``, ``begin_stop``/``poll_stop``/``stop``, ``wait``, ``reap``, and per rank its
four readable ends, a sentinel and ``exitcode()``. Here the ends are TCP connections from each
rank's node (``wire``), the sentinel is the status connection, and signals go to the rank's
actor (``node.RankHost.signal``), which sends them on its node.
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing.connection
import os
import pickle
import secrets
import select
import signal
import socket
import time
from typing import Any

from nbaccel.cluster import wire
from nbaccel.cluster.node import RankHost
from nbaccel.core.errors import LaunchError
from nbaccel.core.events import RankSpec
from nbaccel.launch.group import StopSequence

CONNECT_TIMEOUT = 60.0  # s for every rank's connections to arrive once its actor started it
KILL_WAIT = 10.0  # s a SIGKILLed remote rank gets to report before its actor is killed


@dataclasses.dataclass
class RemoteRank:
    """A rank on a cluster node: its connections here, its pid there, its actor."""

    rank: int
    pid: int
    actor: Any
    node: str
    stdout: socket.socket
    stderr: socket.socket
    diag: socket.socket
    events: Any  # multiprocessing.connection.Connection on the events socket
    ended: socket.socket  # the status connection: the exit status, then EOF
    events_socket: socket.socket  # ``events``'s socket (peeked at for its end)
    _received: bytes = b""
    _code: int | None = None
    _reaped: bool = False

    @property
    def sentinel(self) -> int:
        return self.ended.fileno()

    def exitcode(self) -> int | None:
        """The rank's exit status once its actor sent it and every stream has ended (never
        blocks). A local rank's pipes hold all it wrote when it is dead; these connections
        may still carry its last lines after the status arrived, and the relay must read them
        before it hears of the exit."""
        if self._code is None:
            self._code = self._read_status()
        if self._code is None or not (self._reaped or self._streams_ended()):
            return None
        return self._code

    def has_exited(self) -> bool:
        """Whether the rank has ended on its node (its streams may still be arriving)."""
        if self._code is None:
            self._code = self._read_status()
        return self._code is not None

    def _read_status(self) -> int | None:
        while self.ended.fileno() >= 0 and len(self._received) < wire.STATUS.size:
            try:
                chunk = self.ended.recv(wire.STATUS.size - len(self._received), socket.MSG_DONTWAIT)
            except BlockingIOError:
                return None
            except OSError:
                chunk = b""
            if not chunk:  # the actor died before it could say: it was killed
                return -signal.SIGKILL
            self._received += chunk
        if len(self._received) < wire.STATUS.size:
            return -signal.SIGKILL  # closed here (torn down) without a status
        return int(wire.STATUS.unpack(self._received)[0])

    def _streams_ended(self) -> bool:
        for s in (self.stdout, self.stderr, self.diag, self.events_socket):
            if s.fileno() < 0:
                continue
            try:
                if s.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT):
                    return False  # unread data
            except BlockingIOError:
                return False  # open, nothing yet: the writer may still be there
            except OSError:
                continue
        return True

    def reap(self) -> None:
        self._reaped = True

    def close_pipes(self) -> None:
        for s in (self.stdout, self.stderr, self.diag, self.ended, self.events_socket):
            s.close()
        self.events.close()


class RayRankGroup(StopSequence):
    """The ranks of one launch on a Ray cluster (see the module docstring).

    ``cluster`` is the :class:`~nbaccel.cluster.ray_cluster.RayCluster` that places them.
    """

    start_method = "ray"
    _kill_wait = KILL_WAIT  # then its actor is killed: a node may be slow to answer

    def __init__(self, specs: list[RankSpec], cluster: Any) -> None:
        self.specs = specs
        self.cluster = cluster
        self.ranks: list[RemoteRank] = []
        self.strays: list[tuple[int, str]] = []
        self._stop_signal_sent: set[int] = set()
        self._kill_at: float | None = None
        self._actors: list[Any] = []
        self._placement: Any = None

    # -- starting ---------------------------------------------------------------------------

    def start(self) -> None:
        """Place the ranks, start one per actor and take their connections; on any failure or
        Ctrl-C, stop what started and re-raise."""
        try:
            self._start()
        except KeyboardInterrupt:
            self.stop(grace=0)
            raise KeyboardInterrupt(
                "launch interrupted while placing and starting ranks on the Ray cluster; "
                "what had started was stopped"
            ) from None
        except BaseException:
            self.stop(grace=0)
            raise

    def _start(self) -> None:
        import ray

        ray_module = self.cluster.connect()
        self._placement = self.cluster.place(len(self.specs))
        host_class = ray_module.remote(RankHost)
        strategy = ray_module.util.scheduling_strategies.PlacementGroupSchedulingStrategy
        for index in range(len(self.specs)):
            self._actors.append(
                host_class.options(
                    scheduling_strategy=strategy(
                        self._placement, placement_group_bundle_index=index
                    ),
                    **self.cluster.rank_resources(),
                ).remote()
            )
        nodes = ray.get([a.where.remote() for a in self._actors])
        master = nodes[0]
        port = ray.get(self._actors[0].free_port.remote(master))
        one_machine = len(set(nodes)) == 1
        listener = _listen(self.cluster.address_for_nodes(master), backlog=8 + 5 * len(self.specs))
        token = secrets.token_hex(16)
        try:
            address = listener.getsockname()[:2]
            pids = ray.get(
                [
                    actor.start.remote(
                        pickle.dumps((placed_spec(spec, nodes, master, port), one_machine)),
                        address,
                        token,
                        spec.rank,
                    )
                    for actor, spec in zip(self._actors, self.specs, strict=True)
                ]
            )
            conns = _accept(listener, token, len(self.specs))
        finally:
            listener.close()
        for spec, pid, actor, node in zip(self.specs, pids, self._actors, nodes, strict=True):
            c = conns[spec.rank]
            for kind in ("stdout", "stderr", "diag"):
                c[kind].setblocking(False)
            self.ranks.append(
                RemoteRank(
                    spec.rank,
                    pid,
                    actor,
                    node,
                    c["stdout"],
                    c["stderr"],
                    c["diag"],
                    multiprocessing.connection.Connection(os.dup(c["events"].fileno())),
                    c["status"],
                    c["events"],
                )
            )

    # -- watching and stopping (RankGroup's interface) --------------------------------------

    def alive(self) -> list[RemoteRank]:
        return [r for r in self.ranks if not r.has_exited()]

    def was_stopped(self, rank: int, exitcode: int | None = None) -> bool:
        return rank in self._stop_signal_sent  # which signal ended a remote rank is unknown

    def send_signal(self, ranks: list[RemoteRank], sig: int) -> None:
        for r in ranks:
            r.actor.signal.remote(int(sig), False)

    def _signal_trees(self, sig: int) -> None:
        alive = self.alive()
        self._stop_signal_sent.update(r.rank for r in alive)
        for r in alive:
            r.actor.signal.remote(int(sig), True)

    def reap(self) -> None:
        """Collect what each node's sweep killed, then end the actors and the placement group
        (a rank still running dies with its actor)."""
        if not self._actors:
            return
        import ray

        with contextlib.suppress(Exception):
            found = ray.get([a.strays.remote() for a in self._actors], timeout=KILL_WAIT)
            self.strays += [tuple(s) for per_node in found for s in per_node]
        for actor in self._actors:
            with contextlib.suppress(Exception):
                ray.kill(actor)
        self._actors = []
        for r in self.ranks:
            r.exitcode()  # a rank whose actor was just killed reads as killed
            r.reap()
        if self._placement is not None:
            with contextlib.suppress(Exception):
                ray.util.remove_placement_group(self._placement)
            self._placement = None


def placed_spec(spec: RankSpec, nodes: list[str], master: str, port: int) -> RankSpec:
    """``spec`` for where Ray placed the ranks: ``nodes[i]`` is rank i's node address. Ranks
    are numbered by the plan; the node numbers and local ranks follow placement (rank 0's node
    is node 0).

    >>> s = RankSpec(1, 1, 3, 3, 0, {}, b"", [], {}, False)
    >>> p = placed_spec(s, ["10.0.0.1", "10.0.0.2", "10.0.0.1"], "10.0.0.1", 29500)
    >>> p.node_rank, p.local_rank, p.local_world_size, p.env["MASTER_ADDR"]
    (1, 0, 1, '10.0.0.1')
    """
    node = nodes[spec.rank]
    order = list(dict.fromkeys(nodes))
    local_rank = nodes[: spec.rank].count(node)
    env = {
        **spec.env,
        "RANK": str(spec.rank),
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(nodes.count(node)),
        "NODE_RANK": str(order.index(node)),
        "GROUP_RANK": str(order.index(node)),
        "MASTER_ADDR": master,
        "MASTER_PORT": str(port),
    }
    return dataclasses.replace(
        spec,
        local_rank=local_rank,
        local_world_size=nodes.count(node),
        node_rank=order.index(node),
        env=env,
    )


def _listen(host: str, backlog: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.bind((host, 0))
    listener.listen(backlog)  # every rank's connections wait here until the actors answer
    return listener


def _accept(listener: socket.socket, token: str, n: int) -> dict[int, dict[str, socket.socket]]:
    """Every rank's five connections (a stranger's is closed), or a ``LaunchError``."""
    conns: dict[int, dict[str, socket.socket]] = {}
    deadline = time.monotonic() + CONNECT_TIMEOUT
    while sum(len(c) for c in conns.values()) < n * len(wire.KINDS):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            missing = sorted(k for k in range(n) if len(conns.get(k, {})) < len(wire.KINDS))
            for c in conns.values():
                for s in c.values():
                    s.close()
            raise LaunchError(
                f"ranks {missing} were started on the cluster but did not connect back to the "
                f"kernel at {listener.getsockname()[0]} within {CONNECT_TIMEOUT:g} s. The nodes "
                "must reach this machine: pass RayCluster(kernel_address=...) with an address "
                "of this machine they can reach."
            )
        if not select.select([listener], [], [], min(remaining, 0.5))[0]:
            continue
        sock, _ = listener.accept()
        found = wire.read_header(sock)
        if found is None or found[0] != token or not 0 <= found[1] < n:
            sock.close()
            continue
        conns.setdefault(found[1], {})[found[2]] = sock
    return conns
