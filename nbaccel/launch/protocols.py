"""The declared extension points of a launch: what nbaccel asks of a cluster backend.

A cluster backend (``cluster=`` of ``notebook_launcher``, e.g.
:class:`~nbaccel.cluster.ray_cluster.RayCluster`) is any object with these members; the plan,
the launch and the views ask the object, never its type. A new backend is one module with a
class like that, passed as ``cluster=``.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from nbaccel.core.events import RankSpec


@runtime_checkable
class Cluster(Protocol):
    """Machines other than this one that a launch's ranks run on."""

    @property
    def start_method(self) -> str:
        """How the launch banner names the ranks' start (in place of a start method): "ray"."""
        ...

    @property
    def uses_gpus(self) -> bool:
        """Whether each rank gets a GPU (else the ranks run on CPU, gloo)."""
        ...

    def check_available(self) -> None:
        """Raise an error saying what to install or start when the backend cannot run here;
        called while the launch is planned, before anything starts."""
        ...

    def make_group(self, specs: list[RankSpec]) -> Any:
        """The rank group of one launch attempt: it starts ``specs``'s ranks on the cluster
        and is followed like a local group."""
        ...
