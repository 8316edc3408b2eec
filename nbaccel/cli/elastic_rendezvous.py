"""``nbaccel launch``'s rendezvous: torch elastic's static one, with a fresh store each round.

Elastic's static rendezvous starts one store on machine 0 and its workers use it, unprefixed,
for every restart. A restarted group then reads the addresses and barrier counts of the attempt
before it: ``Gloo connectFullMesh ... Connection refused`` (the old rank's port) or a hang
(measured: 0 of 6 restarts of a 2-rank launch succeeded on a loaded 2-core machine). Here each
round's workers get a store of their own: machine 0's agent starts it on a free port and
publishes the port in the agent's store under the round's number, where the other machines'
agents read it. The agent's store and the workers' stores listen only on
:func:`~nbaccel.core.rendezvous.listen_address` (loopback on one machine).

Across machines, ``--rdzv_backend c10d`` is torch's c10d rendezvous (:data:`C10D_BACKEND`)
with its workers' store on this machine's address only.

Imported by ``nbaccel launch`` only (it imports torch); :func:`register` makes the backends
known to torch elastic's registry as :data:`BACKEND` and :data:`C10D_BACKEND`.
"""

from __future__ import annotations

import datetime
import os
from typing import Any

from torch.distributed.elastic.rendezvous import (
    RendezvousError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    rendezvous_handler_registry,
)
from torch.distributed.elastic.rendezvous.api import RendezvousStoreInfo
from torch.distributed.elastic.rendezvous.registry import _create_c10d_handler
from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import (
    StaticTCPRendezvous,
    create_rdzv_handler,
)

from nbaccel.core import rendezvous

BACKEND = "nbaccel-static"
C10D_BACKEND = "nbaccel-c10d"
ENV_RESTART_TIMEOUT = "NBACCEL_RESTART_TIMEOUT"


def restart_timeout() -> float:
    """Seconds machine 0 waits for every machine to rejoin on a restart (default 120)."""
    return float(os.environ.get(ENV_RESTART_TIMEOUT, "120"))


class FreshStoreRendezvous(RendezvousHandler):
    """``static``'s rendezvous, where each round's workers meet at a store of their own."""

    def __init__(self, static: StaticTCPRendezvous) -> None:
        self._static = static
        self._listen = rendezvous.listen_address(static.master_addr, static.world_size == 1)
        self._round = 0
        self._agent_server: Any = None
        self._worker_store: Any = None

    def get_backend(self) -> str:
        return BACKEND

    @property
    def use_agent_store(self) -> bool:
        return True  # the workers are clients of the store this agent (machine 0's) hosts

    def next_rendezvous(self) -> RendezvousInfo:
        static = self._static
        if static.rank == 0 and self._agent_server is None:
            # Elastic's own store on this port is multi-tenant: it shares this server (and
            # waits for the other machines' agents itself).
            self._agent_server = rendezvous.serve_store(
                self._listen, static.master_port, timeout=static.timeout
            )
        info = static.next_rendezvous()
        try:
            if self._round:
                self._wait_for_machines(info.store)
            key = f"nbaccel/worker_store/{self._round}"
            self._round += 1
            if static.rank == 0:
                self._worker_store = None  # the last round's workers are gone: close it
                self._worker_store = rendezvous.serve_store(self._listen, 0)
                port = int(self._worker_store.port)
                info.store.set(key, str(port))
            else:
                port = int(info.store.get(key))
        except RendezvousError:
            raise
        except Exception as exc:  # torch's DistNetworkError: machine 0's store is gone
            if static.rank == 0:
                raise
            first = str(exc).splitlines()[0] if str(exc) else ""  # then C++ frames
            raise RendezvousError(
                f"machine 0's rendezvous store at {static.master_addr}:{static.master_port} "
                f"cannot be reached any more ({type(exc).__name__}: {first}): machine 0 was lost "
                "or its nbaccel launch stopped, so this launch stops too."
            ) from None
        store_info = RendezvousStoreInfo(static.master_addr, port)
        return RendezvousInfo(info.store, info.rank, info.world_size, store_info)

    def _wait_for_machines(self, store: Any) -> None:
        """On a restart, every machine's agent checks in; machine 0 waits for all of them
        :func:`restart_timeout` seconds at most. Static membership is fixed: a machine that
        does not come back (lost, its agent killed) can never be replaced, so the launch fails
        saying so instead of waiting out the first meeting's long timeout (600 s)."""
        static = self._static
        prefix = f"nbaccel/restart/{self._round}/machine/"
        store.set(f"{prefix}{static.rank}", "1")
        if static.rank != 0:
            return
        keys = [f"{prefix}{r}" for r in range(static.world_size)]
        timeout = restart_timeout()
        try:
            store.wait(keys, datetime.timedelta(seconds=timeout))
        except Exception:  # torch's DistStoreError (a timeout) or a closed connection
            missing = [str(r) for r, k in enumerate(keys) if not store.check([k])]
            raise RendezvousError(
                f"machine {', '.join(missing)} of {static.world_size} did not rejoin for "
                f"restart {self._round} within {timeout:g} s: a static rendezvous needs all "
                "its machines, so the launch stops (was a machine lost or its nbaccel launch "
                f"killed?). {ENV_RESTART_TIMEOUT}=SECONDS waits longer."
            ) from None

    def is_closed(self) -> bool:
        return self._static.is_closed()

    def set_closed(self) -> None:
        self._static.set_closed()

    def num_nodes_waiting(self) -> int:
        return self._static.num_nodes_waiting()

    def get_run_id(self) -> str:
        return self._static.get_run_id()

    def shutdown(self) -> bool:
        return self._static.shutdown()


def _create(params: RendezvousParameters) -> FreshStoreRendezvous:
    params.config["rank"] = params.get_as_int("rank", 0)  # --rdzv-conf passes it as text
    static = create_rdzv_handler(params)
    if not isinstance(static, StaticTCPRendezvous):  # torch's static handler, whatever its type
        raise TypeError(f"torch's static rendezvous handler is a {type(static).__name__}")
    return FreshStoreRendezvous(static)


def _create_c10d(params: RendezvousParameters) -> RendezvousHandler:
    """torch's c10d rendezvous, whose workers' store (on the agent that becomes rank 0, at
    the address given as ``--local-addr``) listens on that address only: torch's own server
    would listen on every interface."""
    params.backend = "c10d"  # torch's handler checks that its backend is the one asked for
    handler = _create_c10d_handler(params)

    def serve(addr: str, port: int) -> Any:
        return rendezvous.serve_store(rendezvous.listen_address(addr, one_machine=False), port)

    # (torch 2.13's one hook for this server: DynamicRendezvousHandler's own method)
    handler._create_tcp_store_server = serve  # type: ignore[attr-defined]
    return handler


def register() -> None:
    """Make ``--rdzv-backend nbaccel-static`` and ``nbaccel-c10d`` known to torch elastic
    (idempotent)."""
    rendezvous_handler_registry.register(BACKEND, _create)
    rendezvous_handler_registry.register(C10D_BACKEND, _create_c10d)
