"""``notebook_launcher``: run a function on N ranks from a notebook cell (or a script).

The plan reads in three steps: :func:`~nbaccel.launch.plan.resolve_plan` checks everything and
serializes the job before anything starts (bad input never leaves a half-started launch),
:func:`run_plan` starts the ranks and lets :class:`~nbaccel.launch.relay.Relay` follow them to
the end, and rank 0's (or every rank's) return value is loaded in the kernel.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from nbaccel.core import shared_tensors
from nbaccel.core.config import LaunchConfig
from nbaccel.core.errors import RankFailedError
from nbaccel.core.launch_state import LaunchState, Outcome, RankState
from nbaccel.launch import xla
from nbaccel.launch.forkserver import ensure_server
from nbaccel.launch.plan import UNSET, LaunchPlan, resolve_plan
from nbaccel.launch.relay import Relay, load_payload
from nbaccel.ui import View, choose_view


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
) -> Any:
    """Run ``function(*args)`` on ``num_processes`` ranks and return rank 0's return value.

    Parameters shared with Hugging Face Accelerate's ``notebook_launcher`` keep its names,
    order and meanings. ``num_processes=None`` means every visible GPU, else 1. Settings not
    given here come from ``config``, else from the saved default config (``nbaccel.configure()``/
    ``nbaccel config``). ``max_restarts`` relaunches every rank after a rank fails, that many
    times at most. ``log_line_prefix_template`` labels the ranks' lines in text output (torch
    elastic's form: ``"[${rank}]: "``). The rendezvous is static (``rdzv_endpoint``,
    ``rdzv_conf`` and ``rdzv_id`` only matter to elastic ones: ``nbaccel launch``), and the
    ranks are followed by events, so ``monitor_interval`` changes nothing.

    What nbaccel adds, as keywords: ``return_all=True`` returns every rank's value as a list.
    ``timeout`` (seconds) stops a launch that runs too long with a ``TimeoutError`` that shows
    where each rank was. ``progress``: True (dashboard where widgets render, text elsewhere),
    "text", or False. ``preload`` names modules the fork server imports once so ranks start
    with them. ``env`` adds (or, with None, removes) the ranks' environment variables.

    Example::

        def train(lr):
            acc = nbaccel.Accelerator()
            acc.print(f"{acc.num_processes} ranks, lr={lr}")
            return acc.process_index

        nbaccel.notebook_launcher(train, args=(0.1,), num_processes=2)   # -> 0
    """
    __tracebackhide__ = True  # IPython leaves nbaccel's frames out of the notebook's traceback
    return _launch(
        function,
        args,
        kwargs,
        view,
        progress,
        preload,
        config=config,
        num_processes=num_processes,
        mixed_precision=mixed_precision,
        start_method=start_method,
        use_port=use_port,
        master_addr=master_addr,
        node_rank=node_rank,
        num_nodes=num_nodes,
        timeout=timeout,
        env=env,
        return_all=return_all,
        rdzv_backend=rdzv_backend,
        max_restarts=max_restarts,
        monitor_interval=monitor_interval,
        line_prefix=log_line_prefix_template,
    )


def debug_launcher(
    function: Callable[..., Any], args: Sequence[Any] = (), num_processes: int = 2
) -> Any:
    """Run ``function(*args)`` on ``num_processes`` CPU processes, even where GPUs are visible:
    a quick check that distributed code works (Accelerate's ``debug_launcher``).

    Example::

        nbaccel.debug_launcher(train, num_processes=2)
    """
    __tracebackhide__ = True
    return _launch(function, args, None, None, True, (), num_processes=num_processes, cpu=True)


def _launch(
    function: Callable[..., Any],
    args: Sequence[Any],
    kwargs: dict[str, Any] | None,
    view: View | None,
    progress: bool | str,
    preload: Sequence[str],
    **options: Any,
) -> Any:
    """Plan (every check before anything starts), run (with restarts), load the results."""
    __tracebackhide__ = True
    try:
        plan = resolve_plan(function, args, kwargs if kwargs is not None else {}, **options)
    except (TypeError, ValueError, RuntimeError, OSError) as exc:
        if os.environ.get("NBACCEL_DEBUG"):
            raise
        _raise_short(exc)
    try:
        payloads = _run_with_restarts(plan, view, progress, preload)
        if options.get("return_all"):
            return [load_payload(s.rank, payloads.get(s.rank)) for s in plan.specs]
        return load_payload(0, payloads.get(0)) if plan.info.node_rank == 0 else None
    finally:  # shared memory of arguments and of results that were never loaded
        shared_tensors.release(plan.specs[0].transfer if plan.specs else None)


def _run_with_restarts(
    plan: LaunchPlan, view: View | None, progress: bool | str, preload: Sequence[str]
) -> dict[int, bytes | None]:
    """``run_plan``, and again (all ranks, each attempt a fresh view) after a rank fails, up to
    ``plan.max_restarts`` times; the last failure is raised."""
    __tracebackhide__ = True
    for restart in range(1, plan.max_restarts + 1):
        try:
            return run_plan(plan, view if view is not None else choose_view(progress), preload)
        except RankFailedError as exc:
            what = exc.exc_type.rsplit(".", 1)[-1] if exc.exc_type else "it exited"
            print(
                f"nbaccel: rank {exc.rank} failed ({what}); restarting all "
                f"{len(plan.specs)} ranks (restart {restart} of {plan.max_restarts})",
                file=sys.stderr,
                flush=True,
            )
    return run_plan(plan, view if view is not None else choose_view(progress), preload)


# Raise `exc` without nbaccel's frames below: bad input (plan.py, config, capabilities) or a
# Stop while ranks start (forkserver, group); the message says what happened and what to do,
# and in a notebook those frames would bury it. IPython shows this one frame (it never hides
# the innermost, and shows the lines of its function: so no docstring here).
def _raise_short(exc: BaseException) -> None:
    raise exc.with_traceback(None)


def run_plan(plan: LaunchPlan, view: View, preload: Sequence[str] = ()) -> dict[int, bytes | None]:
    """Start the planned ranks and relay them to ``view`` until the end; return their payloads."""
    __tracebackhide__ = True
    state = LaunchState(plan.info, {s.rank: RankState(s.rank) for s in plan.specs})
    group = xla.make_group(plan.specs, plan.info.start_method, plan.xla_threads)  # RankGroup
    # The view first: the fork server may still be importing torch (the first launch after the
    # import cell), and a cell must not stay blank meanwhile.
    view.start(state)
    try:
        if plan.info.start_method == "forkserver":
            ensure_server(tuple(preload))
        group.start()  # stops what it started on any failure
    except BaseException as exc:
        state.outcome = (
            Outcome.INTERRUPTED if isinstance(exc, KeyboardInterrupt) else Outcome.FAILED
        )
        state.ended_at = time.monotonic()
        with contextlib.suppress(Exception):
            view.finish()
        if isinstance(exc, KeyboardInterrupt):  # its message says what was stopped
            _raise_short(exc)
        raise
    # The ranks' clocks start with the ranks: a wait for the fork server (its imports) is no
    # stall, and a stack request then would kill ranks that have no handler for it yet.
    started = time.monotonic()
    for rank_state in state.ranks.values():
        rank_state.started_at = started
    try:
        return Relay(group, state, view, plan.timeout).run(view_started=True)
    except KeyboardInterrupt:
        # Every rank is stopped and reaped by now; the relay's frames would only be noise.
        n = len(plan.specs)
        raise KeyboardInterrupt(f"launch interrupted; all {n} ranks were stopped") from None
