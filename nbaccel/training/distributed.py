"""Where this process stands: rank, world, device and backend, and the process group behind them.

One job: read what the launcher (``notebook_launcher``, ``nbaccel launch``, torchrun) put in the
environment, pick the device and backend (gloo on CPU, NCCL with one GPU per local rank), and
start the process group once. Running in the kernel with no launcher means one process and no
process group at all.

>>> state = detect_state(cpu=True)
>>> (state.process_index, state.num_processes, state.backend)
(0, 1, None)
"""

from __future__ import annotations

import dataclasses
import datetime
import enum
import os
from typing import Any

import torch
import torch.distributed as dist

from nbaccel.training import xla


class DistributedType(str, enum.Enum):
    """How the processes work together (Accelerate's names); plain strings compare equal.

    >>> import nbaccel
    >>> def kind():
    ...     return nbaccel.Accelerator().distributed_type
    >>> nbaccel.notebook_launcher(kind, num_processes=2, progress=False)  # doctest: +ELLIPSIS
    nbaccel: launching 2 processes...
    <DistributedType.MULTI_CPU: 'MULTI_CPU'>
    >>> DistributedType.MULTI_CPU == "MULTI_CPU"
    True
    """

    NO = "NO"
    MULTI_CPU = "MULTI_CPU"
    MULTI_GPU = "MULTI_GPU"
    FSDP = "FSDP"
    DEEPSPEED = "DEEPSPEED"
    XLA = "XLA"  # torch_xla's PJRT runtime: TPU, or XLA's CPU devices (nbaccel.training.xla)
    # Accelerate's other kinds, so ported comparisons (``== DistributedType.MULTI_XPU``) run;
    # nbaccel never reports them (it runs on CPU, CUDA GPUs and XLA).
    MULTI_NPU = "MULTI_NPU"
    MULTI_MLU = "MULTI_MLU"
    MULTI_SDAA = "MULTI_SDAA"
    MULTI_MUSA = "MULTI_MUSA"
    MULTI_XPU = "MULTI_XPU"
    MEGATRON_LM = "MEGATRON_LM"
    MULTI_HPU = "MULTI_HPU"
    MULTI_NEURON = "MULTI_NEURON"


@dataclasses.dataclass(frozen=True)
class ProcessState:
    """The facts about this process that every other module asks for."""

    process_index: int
    local_process_index: int
    num_processes: int
    local_num_processes: int
    device: torch.device
    backend: str | None  # None when there is only one process

    @property
    def is_main_process(self) -> bool:
        return self.process_index == 0

    @property
    def is_local_main_process(self) -> bool:
        return self.local_process_index == 0

    @property
    def distributed(self) -> bool:
        return self.num_processes > 1


def env_int(name: str, default: int) -> int:
    """The launcher's integer variable ``name`` (``RANK``, ``LOCAL_RANK``...), else ``default``."""
    value = os.environ.get(name)
    if value in (None, ""):
        return default
    try:
        return int(value)
    except ValueError:
        raise RuntimeError(
            f"environment variable {name}={value!r} is not an integer; it is set by the "
            "launcher, so start the script with notebook_launcher, `nbaccel launch` or torchrun."
        ) from None


def detect_state(cpu: bool = False, init_kwargs: Any = None) -> ProcessState:
    """Read rank and world from the environment, choose the device, start the process group.

    ``cpu=True`` forces the CPU (and gloo) even where GPUs are visible; ``init_kwargs`` (an
    ``InitProcessGroupKwargs``) may set the process group's timeout.

    Example::

        state = detect_state()        # under torchrun --nproc_per_node 2: rank 0 or 1, gloo/nccl
    """
    if not cpu and xla.wanted():  # rank and world come from the runtime (per device thread)
        rank, local_rank, world, local_world, device = xla.detect()
        return ProcessState(
            rank, local_rank, world, local_world, device, "xla" if world > 1 else None
        )
    world = env_int("WORLD_SIZE", 1)
    rank = env_int("RANK", 0)
    local_rank = env_int("LOCAL_RANK", rank if world > 1 else 0)
    local_world = env_int("LOCAL_WORLD_SIZE", world)
    use_cuda = not cpu and torch.cuda.is_available()
    if use_cuda:
        count = torch.cuda.device_count()
        if local_world > count:
            raise RuntimeError(
                f"{local_world} processes on this machine but only {count} GPU(s) are visible; "
                "CUDA runs one process per GPU. Start fewer processes, or pass "
                "Accelerator(cpu=True) to train on the CPU."
            )
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    elif world > 1 or env_int("LOCAL_RANK", -1) != -1:
        # A launched CPU process (any number of them): Accelerate's `cpu:0` there, and
        # `cpu` in a plain one, so code that prints or compares the device sees the same.
        device = torch.device("cpu", 0)
    else:
        device = torch.device("cpu")
    backend = None
    if world > 1:
        # InitProcessGroupKwargs as Accelerate reads it: a backend other than its default
        # "nccl" is used as given (gloo on GPUs, "cpu:gloo,cuda:nccl"); else the device's.
        chosen = getattr(init_kwargs, "backend", None)
        backend = chosen if chosen not in (None, "nccl") else ("nccl" if use_cuda else "gloo")
        timeout = getattr(init_kwargs, "timeout", None) or datetime.timedelta(minutes=30)
        init_method = getattr(init_kwargs, "init_method", None)
        _init_process_group(backend, rank, world, device, timeout, init_method)
    return ProcessState(rank, local_rank, world, local_world, device, backend)


def _init_process_group(
    backend: str,
    rank: int,
    world: int,
    device: torch.device,
    timeout: datetime.timedelta,
    init_method: str | None = None,
) -> None:
    if dist.is_initialized():
        current = dist.get_backend()
        if backend not in str(current):
            raise RuntimeError(
                f"a process group with backend {current!r} already exists, but this Accelerator "
                f"needs {backend!r} (device {device}). Create the Accelerator before calling "
                "torch.distributed.init_process_group yourself, or use the same backend."
            )
        return
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        if not init_method and not os.environ.get(name):
            raise RuntimeError(
                f"WORLD_SIZE={world} but {name} is not set, so the processes cannot find each "
                "other. Start them with notebook_launcher, `nbaccel launch` or torchrun."
            )
    dist.init_process_group(
        backend,
        rank=rank,
        world_size=world,
        timeout=timeout,
        init_method=init_method,
        device_id=device if device.type == "cuda" else None,
    )
