"""A rank process that hosts several XLA devices as threads (XLA's CPU devices, TPU v2/v3).

PJRT drives such devices from one process, one thread per device, so one process stands for N
ranks. :func:`run_device_threads` keeps nbaccel's promises per rank anyway: each device thread
prints into its own rank's output pipe (Python-level ``sys.stdout``/``sys.stderr``; C-level
writes and crash dumps go to the first rank's), sends its own progress, result and failure on
its own event pipe, and the process exits through the shared exit protocol.

:func:`install_lockstep_sync` is the workaround that makes collectives between threaded CPU
devices work in torch_xla 2.9 (see its docstring). Only the launcher calls this module.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import os
import sys
import threading
from typing import Any

import cloudpickle

from nbaccel.core import events, pickling
from nbaccel.core.events import RankSpec
from nbaccel.rank import entry, exit, reporting, torch_fixes

entry.PLUMBING_FILES.add(__file__)  # _start_then_call is not the user's frame
_local = threading.local()  # .rank: the rank the current device thread runs as


class _ThreadChannels:
    """Stands in for the process's event channel: each event goes down the pipe of the rank
    it names, and ``rank`` is the calling device thread's (the first rank in other threads)."""

    def __init__(self, channels: dict[int, Any], default: int) -> None:
        self._channels, self._default = channels, default

    @property
    def rank(self) -> int:
        return getattr(_local, "rank", self._default)

    def send(self, event: events.Event) -> None:
        rank = getattr(event, "rank", None)
        channel = self._channels.get(rank) if isinstance(rank, int) else None
        if channel is None:  # an event that names no rank of this process: the caller's
            channel = self._channels[self.rank]
        channel.send(event)

    def has_room(self) -> bool:
        return self._channels[self.rank].has_room()


class _ThreadStream(io.TextIOBase):
    """``sys.stdout``/``sys.stderr`` for a process of device threads: writes go to the calling
    thread's rank's pipe, so every line keeps its rank's label in the notebook."""

    def __init__(self, streams: dict[int, Any], default: Any) -> None:
        self._streams, self._default = streams, default

    def _target(self) -> Any:
        rank = getattr(_local, "rank", None)
        return self._streams.get(rank, self._default) if rank is not None else self._default

    def write(self, text: str) -> int:
        return self._target().write(text)

    def flush(self) -> None:
        for stream in {id(s): s for s in [*self._streams.values(), self._default]}.values():
            stream.flush()

    def fileno(self) -> int:
        return self._default.fileno()

    def isatty(self) -> bool:
        return False

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return "utf-8"


def _line_stream(fd: int) -> io.TextIOWrapper:
    raw = open(fd, "wb", buffering=0, closefd=False)  # noqa: SIM115 - lives with the process
    return io.TextIOWrapper(raw, encoding="utf-8", errors="backslashreplace", line_buffering=True)


class _Turns:
    """One device thread at a time traces, compiles and launches XLA work; a thread lets the
    others take their turn only while it waits for its device (see install_lockstep_sync)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._mine = threading.local()

    def held(self) -> bool:
        return getattr(self._mine, "held", False)

    def take(self) -> None:
        self._lock.acquire()
        self._mine.held = True

    def give(self) -> None:
        self._mine.held = False
        self._lock.release()


TURNS = _Turns()


def install_lockstep_sync() -> None:
    """Make XLA's CPU devices work as threads: ``torch_xla.sync()`` (``xm.mark_step()``) and
    device threads that take turns.

    Measured with torch_xla 2.9 on CPU devices (2 cores): when two device threads compile the
    same new graph at the same moment, each gets its own executable whose collectives carry
    different ids, and the all-reduce waits for a partner that never comes ("Termination
    timeout for all reduce ... only 1 of them arrived"); and as every execution's rendezvous key
    has ``RunId: 0``, a device that ran a step ahead could pair its all-reduce with another
    device's previous one.
    So each device thread runs its Python code in turn (:data:`TURNS`, taken for the user's
    whole function) and lets go only while its device executes: graphs are traced and compiled
    one device at a time (the others hit the compilation cache and share the executable), and
    every device finishes step k before tracing step k+1. ``PJRT_CPU_ASYNC_CLIENT=0`` (set by
    the launcher) was needed as well. The devices then compute one after the other, which is
    all 2 CPU cores allow anyway; TPU v2/v3 threads do not use this. Consequence for user code:
    a device thread that blocks on another (a ``threading.Barrier``; ``.item()`` of an
    all-reduce not yet cut by ``torch_xla.sync()``, which XLA aborts after 10 s: SIGABRT,
    reported as the ranks' failure) does not get the others' help.
    """
    import torch_xla
    import torch_xla.core.xla_model as xm

    if getattr(torch_xla.sync, "__nbaccel_lockstep__", False):
        return
    original = torch_xla.sync

    def sync(wait: bool = False, reset_scope: bool = True) -> None:
        mine = TURNS.held()
        if not mine:
            TURNS.take()
        try:
            original(wait=False, reset_scope=reset_scope)
        finally:
            TURNS.give()
        try:
            xm.wait_device_ops(xm.xla_real_devices([torch_xla.device()]))
        finally:
            if mine:
                TURNS.take()

    sync.__nbaccel_lockstep__ = True  # type: ignore[attr-defined]
    torch_xla.sync = sync


def _run_device(spec: RankSpec, device: Any, results: dict[int, Any]) -> None:
    """One device thread: bind the device, run the user's function, report like a rank."""
    import torch_xla
    import torch_xla.runtime as xr

    _local.rank = spec.rank

    def call(function: Any, args: list[Any], kwargs: dict[str, Any]) -> Any:
        torch_xla._XLAC._xla_set_default_device(device)
        xr._init_world_size_ordinal()  # what torch_xla's own thread launcher does per device
        if xr.global_ordinal() != spec.rank:
            raise RuntimeError(
                f"XLA device {device} has ordinal {xr.global_ordinal()}, not rank {spec.rank}; "
                "nbaccel expects the launch's ranks to be this runtime's devices in order."
            )
        return _in_turn(function, args, kwargs)

    # Metrics are not flushed per device thread: the threads share one process's pending values.
    results[spec.rank] = entry.run_job(spec, call, flush_metrics=False)


def _in_turn(function: Any, args: list[Any], kwargs: dict[str, Any]) -> Any:
    """Call the user's function holding this thread's turn where devices take turns."""
    lockstep = getattr(sys.modules.get("torch_xla"), "sync", None)
    if not getattr(lockstep, "__nbaccel_lockstep__", False):
        return function(*args, **kwargs)
    TURNS.take()
    try:
        return function(*args, **kwargs)
    finally:
        TURNS.give()


def run_device_threads(specs: list[RankSpec], pipes: list[tuple[Any, Any, Any, Any]]) -> None:
    """Entry point of a process that runs ``specs`` (one per device) as threads.

    ``pipes[i]`` are the writing ends (stdout, stderr, diagnostics, events) of ``specs[i]``.
    """
    first = specs[0]
    out_w, err_w, diag_w, _ = pipes[0]
    # One process: XLA's own thread pools share the cores, so 1 thread for torch's intra-op.
    diag = entry.set_up_process(first, out_w, err_w, diag_w, threads_for=1)
    channels = {}
    for spec, (_, _, _, events_w) in zip(specs, pipes):
        events.install_channel(events_w, spec.rank)
        channels[spec.rank] = events._channel
    events._channel = _ThreadChannels(channels, first.rank)  # type: ignore[assignment]
    outs = {first.rank: sys.stdout} | {
        s.rank: _line_stream(p[0].fileno()) for s, p in zip(specs[1:], pipes[1:])
    }
    errs = {first.rank: sys.stderr} | {
        s.rank: _line_stream(p[1].fileno()) for s, p in zip(specs[1:], pipes[1:])
    }
    sys.stdout, sys.stderr = (
        _ThreadStream(outs, outs[first.rank]),
        _ThreadStream(errs, errs[first.rank]),
    )
    entry._install_progress_hooks()
    torch_fixes.keep_destroyed_process_groups_alive()
    for spec in specs:
        events.emit(events.Started(rank=spec.rank, pid=os.getpid()))

    results: dict[int, int] = {}
    try:
        devices = _prepare_runtime(len(specs))
    except BaseException as exc:  # noqa: BLE001 - the runtime could not start: every rank says so
        for spec in specs:
            events.emit(exit.failure_event(exc, spec.rank, entry.is_plumbing))
        results = {spec.rank: 1 for spec in specs}
    else:
        threads = [
            threading.Thread(
                target=_run_device, args=(s, d, results), name=f"nbaccel-xla-rank{s.rank}"
            )
            for s, d in zip(specs, devices)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    reporting.flush()
    entry._stop_leftovers(first.rank)
    diag.flush()
    exit.leave(max(results.values(), default=0))


def _prepare_runtime(count: int) -> list[Any]:
    """Start PJRT in this process and return its ``count`` devices, or say why not."""
    import torch_xla.core.xla_model as xm
    from torch_xla._internal import pjrt

    if os.environ.get("PJRT_DEVICE", "").upper() == "CPU":
        install_lockstep_sync()
    pjrt.initialize_multiprocess(0, 1)  # one host process: replicate over all its devices
    devices = xm.get_xla_supported_devices()
    if len(devices) != count:
        raise RuntimeError(
            f"this XLA runtime drives {len(devices)} devices from one process, but the launch "
            f"asked for {count} ranks; pass num_processes={len(devices)} (or 1)."
        )
    return devices


def with_runtime_started(spec: RankSpec) -> RankSpec:
    """``spec`` whose function first starts PJRT for this rank's own device (one process per
    device: TPU v4+, or a single device), as ``torch_xla.launch`` does in each process.

    Example::

        spec = with_runtime_started(spec)   # then run_rank(spec, ...) as usual
    """
    start = functools.partial(
        _start_then_call, spec.function, spec.local_rank, spec.local_world_size
    )
    return dataclasses.replace(spec, function=cloudpickle.dumps(start))


def _start_then_call(
    function: bytes, local_rank: int, local_count: int, *args: Any, **kw: Any
) -> Any:
    from torch_xla._internal import pjrt

    pjrt.initialize_multiprocess(local_rank, local_count)
    return pickling.loads(function)(*args, **kw)
