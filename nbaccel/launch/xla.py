"""Launching onto torch_xla's PJRT runtime (TPU, or XLA's CPU devices): the kernel's part.

:func:`adapt_plan` turns a planned launch into one PJRT accepts, decided from the environment
alone (the kernel never starts a runtime: PJRT allows one client per process):

- one process per device (TPU v4+, and any single-device launch): ordinary ranks, each of which
  starts PJRT for its own chip before the user's function runs (``PJRT_LOCAL_PROCESS_RANK``/
  ``_COUNT``, what ``torch_xla.launch`` does);
- devices as threads of one process (XLA's CPU devices, TPU v2/v3): :class:`ThreadHostGroup`
  starts one process that runs every rank as a device thread (``nbaccel.rank.xla``), while the
  relay still sees N ranks, each with its own pipes, label, progress, result and failure.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import sys
from typing import Any

from nbaccel.core import containment, xla_runtime
from nbaccel.core.events import RankSpec
from nbaccel.launch.group import RankGroup, RankProcess
from nbaccel.rank import xla as rank_xla


def adapt_plan(info: Any, specs: list[RankSpec]) -> tuple[Any, list[RankSpec], bool]:
    """``(info, specs, threads)`` for an XLA launch, or the inputs unchanged (``threads`` False)
    when the launch's environment asks for no XLA runtime.

    Example::

        info, specs, threads = adapt_plan(plan.info, plan.specs)   # PJRT_DEVICE=CPU, 2 ranks
        threads                                                     # True: one host process
    """
    env = specs[0].env if specs else os.environ
    device = xla_runtime.requested(env)
    if device is None:
        return info, specs, False
    if importlib.util.find_spec("torch_xla") is None:
        raise RuntimeError(
            f"PJRT_DEVICE={device} asks for torch_xla's runtime, but torch_xla is not installed "
            "in this environment. Install the torch_xla that matches your torch (e.g. torch 2.9 "
            "with torch_xla 2.9), or unset PJRT_DEVICE to run on plain torch."
        )
    _refuse_runtime_in_kernel(device)
    n = len(specs)
    threads = xla_runtime.uses_threads(device, n, env)
    if info.world_size != n and threads:
        raise ValueError(
            f"XLA's {device} devices as threads run on one machine only; got num_nodes="
            f"{info.world_size // max(n, 1)}. Use num_nodes=1."
        )
    extra = {xla_runtime.ENV_PJRT_DEVICE: device}
    if device == "CPU":
        # Each rank is one XLA CPU device; a single process otherwise defaults to one anyway.
        extra["CPU_NUM_DEVICES"] = str(n if threads else 1)
    if threads:
        extra[xla_runtime.ENV_XLA_THREADS] = "1"
        if device == "CPU":
            extra["PJRT_CPU_ASYNC_CLIENT"] = "0"  # see nbaccel.rank.xla.install_lockstep_sync
    new_specs = [
        dataclasses.replace(
            s,
            env={
                **s.env,
                **extra,
                **(
                    {}
                    if threads
                    else {
                        "PJRT_LOCAL_PROCESS_RANK": str(s.local_rank),
                        "PJRT_LOCAL_PROCESS_COUNT": str(s.local_world_size),
                    }
                ),
            },
        )
        for s in specs
    ]
    return dataclasses.replace(info, device="xla", backend="xla"), new_specs, threads


def _refuse_runtime_in_kernel(device: str) -> None:
    """A kernel that has used the TPU holds it, and the ranks could not open it ("TPU
    initialization failed: open(/dev/accel0)"); say so before starting anything."""
    xla = sys.modules.get("torch_xla")
    if device != "TPU" or xla is None:
        return
    try:
        started = bool(xla._XLAC._xla_runtime_is_initialized())
    except (AttributeError, RuntimeError):
        return
    if started:
        raise RuntimeError(
            "this kernel has already used the TPU (torch_xla's runtime is running here), so the "
            "launched ranks could not open it. Restart the kernel and create tensors, models and "
            "the Accelerator on the XLA device only inside the training function."
        )


class _SharedProcess:
    """One host process as seen by one of its ranks: same pid and exit code, but a sentinel
    (a duplicate descriptor) of its own, since the relay watches each rank's sentinel apart."""

    def __init__(self, process: Any, owners: list[int]) -> None:
        self._process, self._owners = process, owners
        self.sentinel = os.dup(process.sentinel)
        self.pid = process.pid
        self._exitcode: int | None = None
        self._closed = False

    @property
    def exitcode(self) -> int | None:
        if self._exitcode is None and self._owners:
            self._exitcode = self._process.exitcode
        return self._exitcode

    def join(self, timeout: float | None = None) -> None:
        if self._exitcode is None:
            self._process.join(timeout)
            self._exitcode = self._process.exitcode

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        os.close(self.sentinel)
        self._owners.remove(id(self))
        if not self._owners:  # the last rank of the host lets the process object go
            self._process.close()


class ThreadHostGroup(RankGroup):
    """The ranks of an XLA launch whose devices are threads of one process.

    Everything else (signals, stop sequence, reaping, containment) is :class:`RankGroup`'s:
    every rank has the host's pid, so stopping one stops them all.
    """

    def start(self) -> None:
        ctx = __import__("multiprocessing").get_context(self.start_method)
        try:
            with (
                self.server.starts,
                self.server.ranks_starting(self.specs, self.start_method),
                containment.sigint_deferred(),
            ):
                self._start_host(ctx)
        except BaseException:
            self.stop(grace=0)
            raise

    def _start_host(self, ctx: Any) -> None:
        pipes = [[ctx.Pipe(duplex=False) for _ in range(4)] for _ in self.specs]
        writers = [tuple(w for _, w in p) for p in pipes]
        process = ctx.Process(
            target=rank_xla.run_device_threads,
            args=(self.specs, writers),
            name=f"nbaccel-xla-ranks{self.specs[0].rank}-{self.specs[-1].rank}",
            daemon=False,
        )
        try:
            process.start()
            self.server.started(process.pid, self.start_method)
        finally:
            for ws in writers:
                for w in ws:
                    w.close()
        owners: list[int] = []
        for spec, p in zip(self.specs, pipes):
            readers = [r for r, _ in p]
            for r in readers[:3]:
                os.set_blocking(r.fileno(), False)
            shared = _SharedProcess(process, owners)
            owners.append(id(shared))
            self.ranks.append(RankProcess(spec.rank, shared, *readers))


def make_group(specs: list[RankSpec], start_method: str, threads: bool) -> RankGroup:
    """The group that starts ``specs``: one host process for device threads, else one each.

    Example::

        group = make_group(plan.specs, plan.info.start_method, plan.xla_threads)
    """
    if threads:
        return ThreadHostGroup(specs, start_method)
    if specs and xla_runtime.requested(specs[0].env):
        return _ProcessPerDeviceGroup(specs, start_method)
    return RankGroup(specs, start_method)


class _ProcessPerDeviceGroup(RankGroup):
    """One process per device: each rank starts PJRT for its own device before the function."""

    def _start_one(self, ctx: Any, spec: RankSpec) -> RankProcess:
        return super()._start_one(ctx, rank_xla.with_runtime_started(spec))
