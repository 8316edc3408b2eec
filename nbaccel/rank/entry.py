"""A notebook rank, from the moment its process exists until it exits.

:func:`run_rank` wires the process up (``startup``), runs the user's function, reports
the result or the failure as an event, and ends through the shared exit protocol (``exit``).
It never imports IPython or the views.
"""

from __future__ import annotations

import builtins
import faulthandler
import os
import signal
import sys
import threading
from typing import Any

from nbaccel.core import (
    events,
    pickling,
    process_table,
    proctitle,
    rendezvous,
    shared_tensors,
    snapshot,
)
from nbaccel.core.disk_space import OutOfSpaceError
from nbaccel.core.events import STACK_DUMP_SIGNAL, RankSpec
from nbaccel.rank import (
    containment,
    debugger,
    exit,
    reporting,
    settings_report,
    startup,
    torch_fixes,
    tqdm_hook,
    twin,
)


def _to_cpu(value: Any) -> Any:
    """Move tensors (and models) in a return value to the CPU, so the kernel can load them."""
    torch = sys.modules.get("torch")
    if torch is None:
        return value
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, torch.nn.parallel.DistributedDataParallel):
        value = value.module
    if isinstance(value, torch.nn.Module):
        return value.cpu()
    if isinstance(value, dict):
        return (
            type(value)((k, _to_cpu(v)) for k, v in value.items()) if type(value) is dict else value
        )
    if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        return type(value)(_to_cpu(v) for v in value)
    return value


# Files whose frames a user's traceback leaves out (rank.xla adds its wrapper's).
PLUMBING_FILES = {__file__}


def is_plumbing(filename: str) -> bool:
    """Whether a traceback frame in ``filename`` is nbaccel's rank plumbing, not the user's."""
    return filename in PLUMBING_FILES


def _pickle_return_value(value: Any, rank: int, transfer: Any = None) -> bytes:
    """Pickle the return value (large tensors through shared memory), or raise a ``TypeError``
    that says it is the return value."""
    try:
        return shared_tensors.dumps_result(_to_cpu(value), transfer, rank)
    except OutOfSpaceError:
        raise  # the value could be sent: /dev/shm is full, which the error says
    except Exception as exc:
        kind = type(value)
        raise TypeError(
            f"rank {rank} returned a {kind.__module__}.{kind.__qualname__} that cannot be sent "
            f"to the kernel ({type(exc).__name__}: {exc}). Return tensors, numbers, strings, or "
            "lists/dicts of them (e.g. model.state_dict()) instead; only rank 0's value is sent "
            "unless return_all=True, so other ranks may return anything."
        ) from None


def _stop_leftovers(rank: int) -> None:
    """Name the processes the user's code left running to the kernel, then stop them.

    Before ``atexit``: multiprocessing's exit hook would otherwise wait for non-daemon children.
    """
    left = containment.descendants()
    if left:
        events.emit(
            events.Leftovers(
                rank=rank, processes=[(p.pid, process_table.describe(p)) for p in left]
            )
        )
        containment.stop_descendants(found=left)


def _install_progress_hooks() -> None:
    """Let tqdm bars in the user's code report as this rank's progress (opt out: NBACCEL_TQDM=0)."""
    try:
        tqdm_hook.install_worker_hooks()
    except Exception as exc:  # noqa: BLE001 - never let reporting break training
        print(f"nbaccel: progress hooks not installed: {exc}", file=sys.stderr)


def set_up_process(spec: RankSpec, out_w: Any, err_w: Any, diag_w: Any, threads_for: int) -> Any:
    """Wire a fresh rank process up, in the one order every rank entry uses: signals, death
    with the launcher, its own session (containment), output pipes, crash reports, then the
    kernel's environment and state (``twin``). Returns the diagnostic stream."""
    # The kernel handles Ctrl-C/interrupt for everyone and stops ranks itself; N tracebacks
    # from N ranks would only bury the one that matters.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    containment.reset_inherited_handlers()
    startup.die_with_parent()
    containment.become_subreaper_session()  # every process the rank causes stays below it
    proctitle.set_title(f"nbaccel rank {spec.rank} of {spec.world_size}")
    startup.redirect_output(out_w.fileno(), err_w.fileno())
    startup.refuse_keyboard_input()
    debugger.install(fallback_input=builtins.input)  # asks the notebook where it can
    diag = open(diag_w.fileno(), "w", closefd=False)  # noqa: SIM115 - kept for faulthandler
    faulthandler.enable(file=diag, all_threads=True)
    faulthandler.register(STACK_DUMP_SIGNAL, file=diag, all_threads=True, chain=False)
    os.environ.clear()
    os.environ.update(spec.env)
    twin.apply(spec)
    startup.share_cpu_threads(threads_for)
    pickling.install_sources(spec.sources)
    return diag


def _call(function: Any, args: list[Any], kwargs: dict[str, Any]) -> Any:
    return function(*args, **kwargs)


def run_job(
    spec: RankSpec, call: Any = _call, flush_metrics: bool = True, host_store: bool = False
) -> int:
    """Run the user's function of ``spec`` through ``call`` and report how it ended (its result
    or its failure) to the kernel; return the exit status. The process group is left to die
    with the process (see ``torch_fixes``).

    ``host_store``: rank 0 serves the rendezvous store first, before anything is unpickled (a
    ``TrainingArguments`` sets up its process group as it is unpickled), and inside the ``try``
    so a port taken meanwhile is reported as rank 0's failure like the user's own."""
    payload, raised = None, None
    try:
        if host_store:
            rendezvous.host_rank_store()
        function = pickling.loads(spec.function)
        args = [pickling.loads(a) for a in spec.args]
        kwargs = {k: pickling.loads(v) for k, v in spec.kwargs.items()}
        value = call(function, args, kwargs)
        if spec.send_result:
            payload = _pickle_return_value(value, spec.rank, spec.transfer)
    except BaseException as exc:  # noqa: BLE001 - every failure goes to the kernel
        raised = exc
    code, failure = exit.outcome(raised)
    settings_report.report_accelerate()  # what Accelerate's Accelerator ran, for the summary
    if flush_metrics:
        reporting.flush()  # metrics held back while the kernel was busy go before the verdict
    if failure is not None:
        event = exit.failure_event(failure, spec.rank, is_plumbing)
        event.copy_follows = snapshot.enabled()
        events.emit(event)
        _send_failure_copy(failure, spec.rank)
    else:
        exited = 0 if isinstance(raised, SystemExit) else None
        events.emit(events.Result(rank=spec.rank, payload=payload, exit_code=exited))
    return code


def _send_failure_copy(failure: BaseException, rank: int) -> None:
    """The failure's frames and locals for ``%debug``, sent after the failure itself. The
    kernel stops the ranks (SIGTERM) as soon as it has the failure: that signal waits until the
    copy is sent (``core.snapshot`` bounds its time well within the grace before SIGKILL)."""
    blocked = threading.current_thread() is threading.main_thread()
    if blocked:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        frames = snapshot.take(failure)
        if frames is not None:
            events.emit(events.FailureCopy(rank=rank, frames=frames))
    finally:
        if blocked:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})


def run_rank(spec: RankSpec, out_w: Any, err_w: Any, diag_w: Any, events_w: Any) -> None:
    """Entry point of a rank process (the target of its ``multiprocessing.Process``)."""
    diag = set_up_process(spec, out_w, err_w, diag_w, threads_for=spec.local_world_size)
    events.install_channel(events_w, spec.rank)
    _install_progress_hooks()
    torch_fixes.keep_destroyed_process_groups_alive()
    torch_fixes.count_built_process_groups()
    events.emit(events.Started(rank=spec.rank, pid=os.getpid()))

    code = run_job(spec, host_store=True)
    torch_fixes.leave_together()
    exit.end_within(code)
    exit.close_multiprocessing()
    _stop_leftovers(spec.rank)
    diag.flush()
    exit.leave(code)
