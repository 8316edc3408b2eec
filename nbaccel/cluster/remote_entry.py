"""A rank process on a cluster node: nbaccel's normal rank entry, its pipes being sockets.

Started by the node's actor (``node.RankHost``) as ``python -m nbaccel.cluster.remote_entry
OUT ERR DIAG EVENTS`` (inherited socket descriptors, connected to the kernel), with the pickled
``RankSpec`` on stdin. The spec comes with the kernel's environment; the rendezvous variables
that depend on the node (which interface gloo uses, where rank 0's store listens) are worked
out here, on the node, from rank 0's address. Then :func:`nbaccel.rank.entry.run_rank` runs as
for a local rank: the same setup, events, failure reports and exit protocol.
"""

from __future__ import annotations

import dataclasses
import multiprocessing.connection
import pickle
import sys

from nbaccel.core import rendezvous
from nbaccel.core.events import RankSpec
from nbaccel.rank.debugger import ENV_UNREACHABLE
from nbaccel.rank.entry import run_rank

# Set by the kernel for its own machine; re-derived here for this node.
NODE_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", rendezvous.ENV_LISTEN_ADDR)


class _Fd:
    """What ``run_rank`` asks of a pipe end: its descriptor."""

    def __init__(self, fd: int) -> None:
        self._fd = fd

    def fileno(self) -> int:
        return self._fd


def node_spec(spec: RankSpec, visible_devices: str | None, one_machine: bool) -> RankSpec:
    """``spec`` with this node's rendezvous variables (and Ray's GPUs for this rank)."""
    env = {k: v for k, v in spec.env.items() if k not in NODE_VARIABLES}
    master = env["MASTER_ADDR"]
    env.update(rendezvous.launcher_environment({}, "notebook", master, one_machine))
    if visible_devices is not None and env.get("CUDA_VISIBLE_DEVICES") != "":
        env["CUDA_VISIBLE_DEVICES"] = visible_devices
    env[ENV_UNREACHABLE] = "1"  # the kernel cannot reach this node's sockets: no breakpoint()
    return dataclasses.replace(spec, env=env)


def main(argv: list[str]) -> None:
    out, err, diag, events = (int(a) for a in argv)
    spec_bytes, visible = pickle.loads(sys.stdin.buffer.read())
    spec, one_machine = pickle.loads(spec_bytes)
    spec = node_spec(spec, visible, one_machine)
    run_rank(spec, _Fd(out), _Fd(err), _Fd(diag), multiprocessing.connection.Connection(events))


if __name__ == "__main__":
    main(sys.argv[1:])
