"""``notebook_launcher``: run a function on N ranks from a notebook cell (or a script), at
Accelerate's module path (``accelerate.launchers``).

The one place a launch meets its views: it picks the view (``nbaccel.ui.choose_view``) and the
kernel's busy signal and hands them to the launch, which knows views only by their protocol
(``launch.protocols.View``), so ``launch/`` stays below ``ui/``. Two steps: :func:`~nbaccel.launch.plan.resolve_plan` checks everything and serializes the job
before anything starts (bad input never leaves a half-started launch), then
:class:`~nbaccel.launch.handle.Launch` runs it: here (``Launch(plan).run()``, rank 0's value)
or, with ``block=False``, in the background (the ``Launch`` is returned at once).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

from nbaccel.core.config import LaunchConfig
from nbaccel.launch.handle import Launch
from nbaccel.launch.options import UNSET, LaunchOptions
from nbaccel.launch.plan import resolve_plan
from nbaccel.launch.protocols import Cluster, View
from nbaccel.ui import choose_view
from nbaccel.ui.busy import BusyBeacon


def notebook_launcher(
    function: Callable[..., Any],
    args: Sequence[Any] = (),
    num_processes: int | None = UNSET,
    mixed_precision: str | None = UNSET,
    use_port: int | str = "auto",
    master_addr: str = "127.0.0.1",
    node_rank: int = 0,
    num_nodes: int = 1,
    rdzv_backend: str = "static",
    rdzv_endpoint: str = "",
    rdzv_conf: dict[str, Any] | None = None,
    rdzv_id: str = "none",
    max_restarts: int = UNSET,
    monitor_interval: float = 0.1,
    log_line_prefix_template: str | None = None,
    *,
    start_method: str = "auto",
    timeout: float | None = None,
    kwargs: dict[str, Any] | None = None,
    return_all: bool = False,
    config: LaunchConfig | None = None,
    progress: bool | str = True,
    preload: Sequence[str] = (),
    env: dict[str, str | None] | None = None,
    view: View | None = None,
    block: bool = True,
    cluster: Cluster | None = None,
) -> Any:
    """Run ``function(*args)`` on ``num_processes`` ranks and return rank 0's return value.

    ``function`` is a plain function (a generator or ``async def`` one is refused before any
    rank starts). Parameters shared with Hugging Face Accelerate's ``notebook_launcher`` keep
    its names, order and meanings; every keyword is a field of :class:`nbaccel.LaunchOptions`
    (``LaunchOptions.doc("timeout")`` documents each). ``num_processes=None`` means every
    visible GPU, else 1. Settings not given here come from ``config``, else from the saved
    default config (``nbaccel.configure()``/``nbaccel config``). ``max_restarts`` relaunches every rank after a rank fails, that many
    times at most. ``log_line_prefix_template`` labels the ranks' lines in text output (torch
    elastic's form: ``"[${rank}]: "``). The rendezvous is static (``rdzv_backend="c10d"`` is
    accepted on one machine, where local ranks meet the same way; ``rdzv_endpoint``,
    ``rdzv_conf`` and ``rdzv_id`` only matter to elastic ones: ``nbaccel launch``), and the
    ranks are followed by events, so ``monitor_interval`` changes nothing.

    What nbaccel adds, as keywords: ``return_all=True`` returns every rank's value as a list.
    ``timeout`` (seconds) stops a launch that runs too long with a ``TimeoutError`` that shows
    where each rank was. ``progress``: True (dashboard where widgets render, text elsewhere),
    "text", or False. ``preload`` names modules the fork server imports once so ranks start
    with them. ``env`` adds (or, with None, removes) the ranks' environment variables.
    ``block=False`` returns a :class:`~nbaccel.launch.handle.Launch` at once and trains in the
    background while other cells run: ``.result()`` waits for rank 0's value (or raises the
    launch's error), ``.stop()``, ``.done()``, ``.status``, ``.metrics()``, ``await launch``
    (see docs/background_launches.md). ``cluster=nbaccel.RayCluster(...)`` runs the
    ``num_processes`` ranks on a Ray cluster instead of this machine, shown as local ones
    (see docs/multi_machine.md).

    Example (in a notebook ``train`` is a cell's function; the lines print as they come):

    >>> import nbaccel
    >>> def train(lr):
    ...     acc = nbaccel.Accelerator()
    ...     acc.print(f"{acc.num_processes} ranks, lr={lr}")
    ...     return acc.process_index
    >>> nbaccel.notebook_launcher(train, args=(0.1,), num_processes=2)  # doctest: +ELLIPSIS
    nbaccel: launching 2 processes on cpu (gloo)...
    [rank0] 2 ranks, lr=0.1
    ...
    0
    >>> nbaccel.notebook_launcher(
    ...     train, args=(0.1,), num_processes=2, return_all=True, progress=False
    ... )  # doctest: +ELLIPSIS
    nbaccel: launching 2 processes...
    [rank0] 2 ranks, lr=0.1
    [0, 1]
    """
    __tracebackhide__ = True  # IPython leaves nbaccel's frames out of the notebook's traceback
    options = LaunchOptions(
        num_processes=num_processes,
        mixed_precision=mixed_precision,
        use_port=use_port,
        master_addr=master_addr,
        node_rank=node_rank,
        num_nodes=num_nodes,
        rdzv_backend=rdzv_backend,
        rdzv_endpoint=rdzv_endpoint,
        rdzv_conf=rdzv_conf,
        rdzv_id=rdzv_id,
        max_restarts=max_restarts,
        monitor_interval=monitor_interval,
        log_line_prefix_template=log_line_prefix_template,
        start_method=start_method,
        timeout=timeout,
        return_all=return_all,
        config=config,
        progress=progress,
        preload=preload,
        env=env,
        view=view,
        block=block,
        cluster=cluster,
    )
    return launch(function, args, kwargs, options)


def debug_launcher(
    function: Callable[..., Any], args: Sequence[Any] = (), num_processes: int = 2
) -> Any:
    """Run ``function(*args)`` on ``num_processes`` CPU processes, even where GPUs are visible:
    a quick check that distributed code works (Accelerate's ``debug_launcher``).

    >>> import os
    >>> def world():
    ...     return os.environ["WORLD_SIZE"]
    >>> debug_launcher(world, num_processes=2)  # doctest: +ELLIPSIS
    nbaccel: launching 2 processes on cpu...
    '2'
    """
    __tracebackhide__ = True
    return launch(function, args, None, LaunchOptions(num_processes=num_processes, cpu=True))


def launch(
    function: Callable[..., Any],
    args: Sequence[Any],
    kwargs: dict[str, Any] | None,
    options: LaunchOptions,
) -> Any:
    """Plan (every check before anything starts), then run the launch here or, with
    ``options.block=False``, in the background (the :class:`Launch` is returned)."""
    __tracebackhide__ = True
    try:
        plan = resolve_plan(function, args, kwargs if kwargs is not None else {}, options)
    except (TypeError, ValueError, RuntimeError, OSError) as exc:
        if os.environ.get("NBACCEL_DEBUG") or not _raised_by_nbaccel(exc):
            raise  # a library's error inside the checks (a bug, or its own): its frames matter
        _raise_short(exc)
    views = lambda: choose_view(options.progress)  # noqa: E731 - a fresh view per attempt
    handle = Launch(plan, options, make_view=views, busy=BusyBeacon)
    return handle.run() if options.block else handle.start()


def _raised_by_nbaccel(exc: BaseException) -> bool:
    """Whether nbaccel's own code raised ``exc`` (one of its checks, whose message says what
    to do), not a library it called; the innermost frame tells.

    >>> _raised_by_nbaccel(ValueError("made here, never raised"))
    False
    """
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and tb.tb_frame.f_globals.get("__name__", "").startswith("nbaccel.")


# Raise `exc` without nbaccel's frames below: bad input (plan.py, config, capabilities) or a
# Stop while ranks start (forkserver, group); the message says what happened and what to do,
# and in a notebook those frames would bury it. IPython shows this one frame (it never hides
# the innermost, and shows the lines of its function: so no docstring here).
def _raise_short(exc: BaseException) -> None:
    raise exc.with_traceback(None)
