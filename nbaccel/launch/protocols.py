"""The declared extension points of a launch: what nbaccel asks of a rank group, of a view and
of a cluster backend.

A rank group (:class:`RankGroup`) is the ranks of one launch attempt as the lifecycle, the
relay and the event loop follow them: the local one (``launch.group.RankGroup``), XLA's
thread-host one (``launch.xla.ThreadHostGroup``) and a cluster's (``cluster.ray_group``
``.RayRankGroup``) implement it. A cluster backend (``cluster=`` of ``notebook_launcher``, e.g.
:class:`~nbaccel.cluster.ray_cluster.RayCluster`) is any object with these members; the plan,
the launch and the views ask the object, never its type. A new backend is one module with a
class like that, passed as ``cluster=``. A view (:class:`View`; ``view=`` of
``notebook_launcher``) is what the launch shows itself in: ``nbaccel.ui``'s text view and
dashboard implement it, above the launch, which never imports them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from nbaccel.core.events import RankSpec
from nbaccel.launch.state import LaunchState

if TYPE_CHECKING:
    from nbaccel.launch import group, xla


@runtime_checkable
class RankGroup(Protocol):
    """The ranks of one launch attempt: started, followed, signalled, stopped and reaped.

    Each rank (``ranks``, ``alive()``) has ``rank``, ``pid``, ``sentinel`` (readable once it
    has ended), ``exitcode``, its ``stdout``/``stderr``/``diag``/``events`` pipes,
    ``reap()`` and ``close_pipes()``."""

    @property
    def start_method(self) -> str:
        """How its ranks start ("forkserver", "spawn", "fork", "ray"...), as the banner says."""
        ...

    @property
    def ranks(self) -> Sequence[Any]:
        """Every rank of the attempt, once started."""
        ...

    @property
    def strays(self) -> list[tuple[int, str]]:
        """(pid, command) of processes the ranks left running that reaping killed."""
        ...

    def start(self) -> None:
        """Start every rank; on an error, nothing of the start is left running."""
        ...

    def alive(self) -> list[Any]:
        """The ranks still running."""
        ...

    def was_stopped(self, rank: int, exitcode: int | None = None) -> bool:
        """Whether ``rank`` ended because the group stopped it (not by itself)."""
        ...

    def send_signal(self, ranks: list[Any], sig: int) -> None:
        """Send ``sig`` to ``ranks`` (and what they started)."""
        ...

    def notice_unreported(self) -> None:
        """Each loop turn: ranks that ended by themselves but were never reported."""
        ...

    def begin_stop(self, grace: float) -> None:
        """Ask every live rank to stop now (SIGTERM), once; returns at once."""
        ...

    def poll_stop(self) -> None:
        """SIGKILL what still runs once the grace of :meth:`begin_stop` is over."""
        ...

    def stop(self, grace: float = ...) -> None:
        """Stop every rank (SIGTERM, SIGKILL after ``grace`` s) and reap them all."""
        ...

    def wait(self, timeout: float | None) -> bool:
        """Wait until every rank has exited or ``timeout`` passes; whether all exited."""
        ...

    def reap(self) -> None:
        """Collect every ended rank and kill what the ranks left running."""
        ...


class View(Protocol):
    def start(self, state: LaunchState) -> None: ...

    def output(self, rank: int, stream: str, lines: list[str]) -> None:
        """Complete lines a rank wrote to ``stream`` ("stdout" or "stderr")."""

    def partial(self, rank: int, stream: str, text: str) -> None:
        """The rank's unfinished last line now ("" when there is none); optional for a view.
        So is ``settle()``: show now every line held back (a rank paused, and what it printed
        before must read above its pdb; a ``%%ranks`` cell's view holds bursts of lines)."""

    def update(self) -> None:
        """The state changed (progress, metrics, status); redraw if it is time to."""

    def finish(self) -> None:
        """The launch is over (any outcome): show the final summary."""


@runtime_checkable
class Cluster(Protocol):
    """Machines other than this one that a launch's ranks run on."""

    @property
    def start_method(self) -> str:
        """How the launch banner names the ranks' start (in place of a start method): "ray"."""
        ...

    @property
    def placement(self) -> str:
        """Where the launch banner says the ranks run, e.g. "on a Ray cluster"."""
        ...

    @property
    def rank_entry_file(self) -> str:
        """The end of the path of the file a rank's process starts in on the cluster: its frame
        and older ones are left out of a rank's crash report (``launch.failures``)."""
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
        """The rank group (a :class:`RankGroup`) of one launch attempt: it starts ``specs``'s
        ranks on the cluster and is followed like a local group. Only the launch's
        ``RankLifecycle`` calls it (a test of the package rules checks)."""
        ...


if TYPE_CHECKING:  # the type checker holds the local groups to the protocol (Ray's: its make_group)

    def _local_groups_conform(
        local: group.RankGroup, threads: xla.ThreadHostGroup
    ) -> tuple[RankGroup, RankGroup]:
        return local, threads
