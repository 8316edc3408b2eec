"""The Accelerator's XLA side (torch_xla's PJRT runtime: TPU, or XLA's CPU devices).

One job: what is different on XLA, kept out of the CUDA/CPU code paths. Where this process
stands comes from the runtime (``torch_xla.runtime.global_ordinal()``/``world_size()``, which
are per device thread where devices are threads); collectives run through XLA's own
(``xm.all_gather``/``all_reduce``/``collective_broadcast``/``rendezvous``) behind the same
calls ``nbaccel.training.ops`` makes on ``torch.distributed``; prepared loaders cut the lazy
graph at every batch, as ``MpDeviceLoader`` does. torch_xla is imported only here, and only when
the environment asks for XLA (``PJRT_DEVICE``, or a TPU host).

>>> in_use()          # the test process runs plain torch
False
"""

from __future__ import annotations

import importlib.util
import pickle
import sys
from collections.abc import Iterator
from typing import Any

import torch

from nbaccel.core import xla_runtime


def wanted() -> bool:
    """Whether this process should train on XLA (the environment asks, torch_xla is there)."""
    return xla_runtime.requested() is not None and importlib.util.find_spec("torch_xla") is not None


def in_use() -> bool:
    """Whether XLA collectives replace torch.distributed here (an XLA world of several)."""
    xr = sys.modules.get("torch_xla.runtime")
    return xr is not None and wanted() and xr.world_size() > 1


def detect() -> tuple[int, int, int, int, torch.device]:
    """``(rank, local_rank, world, local_world, device)`` from the XLA runtime.

    Example::

        rank, local_rank, world, local_world, device = detect()   # (1, 1, 2, 2, xla:1)
    """
    import torch_xla
    import torch_xla.runtime as xr

    device = torch_xla.device()
    world = xr.world_size()
    local_world = xr.local_device_count() if world > 1 else 1
    local_rank = xr.local_ordinal() if world > 1 else 0
    return xr.global_ordinal(), local_rank, world, local_world, device


def sync() -> None:
    """Cut the lazy graph here and run it (``torch_xla.sync()``, a.k.a. ``xm.mark_step()``)."""
    import torch_xla

    torch_xla.sync()


# -- torch.distributed's calls, answered with XLA collectives (for nbaccel.training.ops) -------
#
# Every device must trace the same graph: where devices are threads of one process they share
# one compiled executable, and a graph that differs per device (torch_xla's own all_gather and
# rendezvous put the device's ordinal into the graph as a constant) gets an executable of its
# own whose all-reduce never meets the others'. So the rank enters the graph as data here.


class _ReduceOp:
    SUM, MAX = "sum", "max"


def _rows(value: torch.Tensor) -> torch.Tensor:
    """``[world, *value.shape]``: every device's ``value`` (an XLA tensor), ready on all."""
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr

    device = value.device
    me = torch.tensor([xr.global_ordinal()]).to(device)  # data, not a constant in the graph
    rows = torch.zeros((xr.world_size(), *value.shape), dtype=value.dtype, device=device)
    rows = rows.index_copy(0, me, value[None])
    total = xm.all_reduce(xm.REDUCE_SUM, rows)
    torch_xla.sync()
    return total


def _exchange(payload: bytes) -> list[bytes]:
    """Every device's ``payload``, in rank order."""
    import torch_xla

    device = torch_xla.device()
    sizes = _rows(torch.tensor([len(payload)]).to(device)).cpu().flatten().tolist()
    data = torch.zeros(max(sizes) or 1, dtype=torch.uint8)
    data[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    rows = _rows(data.to(device)).cpu()
    return [bytes(rows[i, :n].tolist()) for i, n in enumerate(sizes)]


class Collectives:
    """The part of ``torch.distributed`` that ``ops`` uses, on XLA devices (threads or
    processes). Every call ends with a graph cut so results are ready on every device."""

    ReduceOp = _ReduceOp

    @staticmethod
    def get_world_size() -> int:
        import torch_xla.runtime as xr

        return xr.world_size()

    @staticmethod
    def get_rank() -> int:
        import torch_xla.runtime as xr

        return xr.global_ordinal()

    @staticmethod
    def all_gather(parts: list[torch.Tensor], tensor: torch.Tensor) -> None:
        import torch_xla

        rows = _rows(tensor.to(torch_xla.device()))
        for i, part in enumerate(parts):
            part.copy_(rows[i].to(part.device))

    @staticmethod
    def all_reduce(tensor: torch.Tensor, op: Any = _ReduceOp.SUM) -> None:
        import torch_xla
        import torch_xla.core.xla_model as xm

        kind = xm.REDUCE_MAX if str(op).lower().endswith("max") else xm.REDUCE_SUM
        out = xm.all_reduce(kind, tensor.to(torch_xla.device()))
        sync()
        tensor.copy_(out.to(tensor.device))

    @staticmethod
    def broadcast(tensor: torch.Tensor, src: int = 0) -> None:
        import torch_xla
        import torch_xla.core.xla_model as xm

        on_device = tensor.to(torch_xla.device())
        xm.collective_broadcast([on_device], root_ordinal=src)  # its ordinal test is data
        sync()
        tensor.copy_(on_device.to(tensor.device))

    @staticmethod
    def all_gather_object(out: list[Any], obj: Any) -> None:
        out[:] = [pickle.loads(p) for p in _exchange(pickle.dumps(obj))]

    @staticmethod
    def broadcast_object_list(objects: list[Any], src: int = 0) -> None:
        objects[:] = pickle.loads(_exchange(pickle.dumps(objects))[src])

    @staticmethod
    def barrier() -> None:
        import torch_xla

        _rows(torch.zeros(1).to(torch_xla.device()))


def device_batches(batches: Iterator[Any]) -> Iterator[Any]:
    """Yield ``batches`` (already on the XLA device), cutting the graph before each one, so a
    training step is one graph, as ``MpDeviceLoader`` does; and once more at the end.

    Unlike ``MpDeviceLoader`` nothing runs in a background thread: the loader's own work
    (sharding, end-of-epoch accounting, its collectives) stays on the device's thread, where
    torch_xla's per-thread default device is the right one.
    """
    for batch in batches:
        sync()
        yield batch
    sync()


def to_cpu(obj: Any) -> Any:
    """``obj`` with every XLA tensor copied to the CPU, as ``xm.save`` does before writing."""
    import torch_xla.core.xla_model as xm

    return xm._maybe_convert_to_cpu(obj)
