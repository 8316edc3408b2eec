"""``RayCluster``: where a notebook launch puts its ranks when they should run on a Ray cluster.

``notebook_launcher(train, num_processes=4, cluster=nbaccel.RayCluster())`` places the 4 ranks
in one Ray placement group (a bundle of ``cpus_per_rank`` CPUs, and ``gpus_per_rank`` GPUs, per
rank), starts each rank from a Ray actor in its bundle (``node.RankHost``), and follows them
from the kernel as it follows local ranks (``ray_group.RayRankGroup``): live output labelled by
rank, progress, metrics, results, failures with their tracebacks, Stop. Ray is an optional
dependency: ``pip install 'nbaccel[ray]'``.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import time
from typing import Any

from nbaccel.core import rendezvous
from nbaccel.core.errors import LaunchError
from nbaccel.core.events import RankSpec
from nbaccel.launch.protocols import RankGroup

STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


def _no_sigterm_warning(record: logging.LogRecord) -> bool:
    """Drop Ray's "SIGTERM handler is not set" warning: a background launch connects from its
    own thread, and a kernel needs no handler of Ray's (SIGTERM already ends it)."""
    return "SIGTERM handler is not set" not in record.getMessage()


@dataclasses.dataclass(frozen=True)
class RayCluster:
    """A Ray cluster to run a launch's ranks on.

    ``address``: ``None`` connects to the cluster Ray finds (``RAY_ADDRESS``, or one started
    with ``ray start`` on this machine) or else starts a local one for this kernel; ``"auto"``
    needs a running cluster; ``"host:port"`` names its head. ``cpus_per_rank``/``gpus_per_rank``
    size each rank's bundle; ``strategy`` is the placement group's (``"PACK"``: as few nodes as
    fit, ``"SPREAD"``: across nodes). ``kernel_address``: the address of this machine the nodes
    connect back to (default: the one on the route to rank 0's node). ``start_timeout``:
    seconds to wait for the cluster to have room for every rank. ``init``: more keywords for
    ``ray.init`` (``runtime_env=...``, ``namespace=...``).

    Example (needs Ray; ``num_processes`` is the number of ranks)::

        nbaccel.notebook_launcher(train, num_processes=4, cluster=nbaccel.RayCluster("auto"))

    >>> RayCluster(strategy="spread")
    Traceback (most recent call last):
    ...
    ValueError: RayCluster(strategy='spread'): choose one of PACK, SPREAD, STRICT_PACK, STRICT_SPREAD.
    """

    address: str | None = None
    cpus_per_rank: float = 1
    gpus_per_rank: float = 0
    strategy: str = "PACK"
    kernel_address: str | None = None
    start_timeout: float = 120.0
    init: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(
                f"RayCluster(strategy={self.strategy!r}): choose one of {', '.join(STRATEGIES)}."
            )
        for name in ("cpus_per_rank", "gpus_per_rank"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"RayCluster({name}={value!r}) must be a number, 0 or more.")
        if self.cpus_per_rank == 0 and self.gpus_per_rank == 0:
            raise ValueError("RayCluster: a rank needs a CPU or a GPU (cpus_per_rank=1).")

    @property
    def start_method(self) -> str:
        """How the launch banner names the ranks' start (``launch.protocols.Cluster``)."""
        return "ray"

    @property
    def placement(self) -> str:
        """Where the launch banner says the ranks run (``launch.protocols.Cluster``)."""
        return "on a Ray cluster"

    @property
    def rank_entry_file(self) -> str:
        """Where each rank's process starts: ``python -m nbaccel.cluster.remote_entry``."""
        return "/nbaccel/cluster/remote_entry.py"

    @property
    def uses_gpus(self) -> bool:
        return self.gpus_per_rank > 0

    def check_available(self) -> None:
        """Raise an ``ImportError`` that says what to install when Ray is missing (without
        importing it: that takes seconds, and the launch does it when it connects)."""
        if importlib.util.find_spec("ray") is None:
            raise ImportError(
                "cluster=RayCluster(...) needs Ray, which is not installed here. Install it "
                "with: pip install 'nbaccel[ray]'"
            )

    def connect(self) -> Any:
        """Connect this kernel to the cluster once (``ray.init``); the ``ray`` module."""
        import ray

        if not ray.is_initialized():
            # Ray's own INFO lines and its workers' logs would fill the cell: the ranks' output
            # comes through nbaccel's relay
            settings = {"log_to_driver": False, "logging_level": logging.WARNING, **self.init}
            ray_worker_log = logging.getLogger("ray._private.worker")
            ray_worker_log.addFilter(_no_sigterm_warning)
            try:
                ray.init(address=self.address, **settings)
            finally:
                ray_worker_log.removeFilter(_no_sigterm_warning)
        return ray

    def rank_resources(self) -> dict[str, float]:
        """What each rank's actor takes from its bundle."""
        return {"num_cpus": self.cpus_per_rank, "num_gpus": self.gpus_per_rank}

    def place(self, n: int) -> Any:
        """A ready placement group of ``n`` bundles, or a ``LaunchError`` saying what is short."""
        import ray

        bundle = {"CPU": self.cpus_per_rank}
        if self.gpus_per_rank:
            bundle["GPU"] = self.gpus_per_rank
        bundle = {k: v for k, v in bundle.items() if v}
        group = ray.util.placement_group([dict(bundle) for _ in range(n)], strategy=self.strategy)
        ready = group.ready()
        deadline = time.monotonic() + self.start_timeout
        while not ray.wait([ready], timeout=0.5)[0]:
            if time.monotonic() > deadline:
                ray.util.remove_placement_group(group)
                have = {k: v for k, v in ray.cluster_resources().items() if k in ("CPU", "GPU")}
                raise LaunchError(
                    f"the Ray cluster has no room for {n} ranks of {bundle} each "
                    f"(strategy {self.strategy}) after {self.start_timeout:g} s; it has {have} "
                    "in all. Launch fewer ranks, ask less per rank (cpus_per_rank=...), add "
                    "nodes, or wait for other jobs to end."
                )
        return group

    def address_for_nodes(self, rank0_node: str) -> str:
        """The address of this machine that the nodes connect back to."""
        if self.kernel_address:
            return self.kernel_address
        return rendezvous.route_address(rank0_node) or "0.0.0.0"

    def make_group(self, specs: list[RankSpec]) -> RankGroup:
        """The rank group of one launch attempt (``launch.handle.Launch`` starts it)."""
        from nbaccel.cluster.ray_group import RayRankGroup

        return RayRankGroup(specs, self)
