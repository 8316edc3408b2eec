"""Accelerate's ``PartialState`` and ``AcceleratorState``: where this process stands, for code
that asks without holding the Accelerator (data helpers, logging, ``split_between_processes``).

``PartialState()`` reads the launch (and starts the process group) once per process; later
calls share it. ``AcceleratorState()`` adds what the latest :class:`~nbaccel.Accelerator` runs
(mixed precision, strategy); ``accelerator.state`` is one.

>>> state = PartialState(cpu=True)
>>> (state.process_index, state.num_processes, state.distributed_type.value)
(0, 1, 'NO')
"""

from __future__ import annotations

import os
import threading
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from nbaccel.core import xla_runtime
from nbaccel.training import ops
from nbaccel.training.accelerator.collectives import ProcessControl
from nbaccel.training.accumulation import GradientState
from nbaccel.training.distributed import DistributedType, ProcessState, detect_state

_State = TypeVar("_State", bound="PartialState")


class _Shared(dict):
    """What every PartialState/AcceleratorState of this process reads (Accelerate shares it
    too); per device thread where XLA devices are threads of one process (rank.xla)."""

    _threads = threading.local()

    def _own(self) -> dict[str, Any]:
        if not os.environ.get(xla_runtime.ENV_XLA_THREADS):
            return self
        if not hasattr(self._threads, "shared"):
            self._threads.shared = {}
        return self._threads.shared

    def get(self, key: str, default: Any = None) -> Any:
        own = self._own()
        return dict.get(own, key, default) if own is self else own.get(key, default)

    def __setitem__(self, key: str, value: Any) -> None:
        own = self._own()
        dict.__setitem__(own, key, value) if own is self else own.__setitem__(key, value)

    def pop(self, key: str, default: Any = None) -> Any:
        own = self._own()
        return dict.pop(own, key, default) if own is self else own.pop(key, default)

    def update(self, *args: Any, **kwargs: Any) -> None:
        for key, value in dict(*args, **kwargs).items():
            self[key] = value


_SHARED: dict[str, Any] = _Shared()


class PartialState(ProcessControl):
    """Rank, world, device and backend of this process, plus the process-control methods
    (``wait_for_everyone``, ``main_process_first``, ``split_between_processes``, ``print``...).

    >>> import nbaccel
    >>> def my_prompts(prompts):
    ...     with PartialState().split_between_processes(prompts) as mine:
    ...         return mine  # in practice: [generate(p) for p in mine]
    >>> nbaccel.notebook_launcher(
    ...     my_prompts, args=(["a", "b", "c"],), num_processes=2, return_all=True, progress=False
    ... )  # doctest: +ELLIPSIS
    nbaccel: launching 2 processes...
    [['a', 'b'], ['c']]
    """

    def __init__(self, cpu: bool = False, **kwargs: Any) -> None:
        current = _SHARED.get("process")
        if current is None or (cpu and current.device.type != "cpu"):
            current = _SHARED["process"] = detect_state(cpu=cpu)
        self._process = current
        self._gs = GradientState()

    @classmethod
    def _from(cls: type[_State], process: ProcessState, **extra: Any) -> _State:
        """The state an Accelerator made; it becomes what later ``PartialState()`` calls see."""
        _SHARED["process"] = process
        _SHARED["distributed_type"] = None  # a new Accelerator: what it runs, not a set value
        _SHARED.update(extra)
        return cls()

    # ProcessState's facts, read by the strategies and loaders as well.
    device = property(lambda self: self._process.device, doc="This process's device.")
    process_index = property(lambda self: self._process.process_index, doc="Global rank.")
    local_process_index = property(lambda self: self._process.local_process_index)
    num_processes = property(lambda self: self._process.num_processes, doc="World size.")
    local_num_processes = property(lambda self: self._process.local_num_processes)
    backend = property(lambda self: self._process.backend, doc="'gloo', 'nccl' or None.")
    distributed = property(lambda self: self._process.distributed)
    use_distributed = property(lambda self: self._process.distributed)
    is_main_process = property(lambda self: self._process.is_main_process)
    is_local_main_process = property(lambda self: self._process.is_local_main_process)
    initialized = property(lambda self: True)

    @property
    def debug(self) -> bool:
        """Whether collectives first check that every rank passes matching shapes
        (``ACCELERATE_DEBUG_MODE=1``); settable, for this process."""
        return ops.debug_mode()

    @debug.setter
    def debug(self, on: bool) -> None:
        ops.set_debug_mode(on)

    @property
    def is_last_process(self) -> bool:
        return self.process_index == self.num_processes - 1

    @property
    def state(self) -> PartialState:
        return self  # ProcessControl's methods read ``self.state``

    @property
    def distributed_type(self) -> DistributedType:
        """NO, MULTI_CPU or MULTI_GPU (``AcceleratorState`` also knows FSDP). Settable, as in
        Accelerate, for code that tries another kind's branch; nbaccel's behaviour follows the
        strategy it runs, not this value."""
        chosen = _SHARED.get("distributed_type")
        if chosen is not None:
            return chosen
        return self._detected_type()

    @distributed_type.setter
    def distributed_type(self, value: DistributedType | str | None) -> None:
        _SHARED["distributed_type"] = None if value is None else DistributedType(value)

    def _detected_type(self) -> DistributedType:
        if self.device.type == "xla":
            return DistributedType.XLA  # as Accelerate: XLA on one device too
        if not self.distributed:
            return DistributedType.NO
        return (
            DistributedType.MULTI_GPU if self.device.type == "cuda" else DistributedType.MULTI_CPU
        )

    @property
    def default_device(self) -> torch.device:
        """The device this machine would train on: the first GPU (CUDA, XPU, MPS), else CPU."""
        if torch.cuda.is_available():
            return torch.device("cuda")
        if hasattr(torch, "xpu") and torch.xpu.is_available():
            return torch.device("xpu")
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")

    def set_device(self) -> None:
        """Make this process's device the current one of its kind (``torch.cuda.set_device``);
        nothing to do on CPU. nbaccel's ranks already start this way."""
        if self.device.type in ("cuda", "xpu") and self.device.index is not None:
            getattr(torch, self.device.type).set_device(self.device)

    def destroy_process_group(self, group: Any = None) -> None:
        """Tear the process group down (the launcher also does it when the function returns)."""
        if dist.is_initialized():
            dist.destroy_process_group(group)

    def __repr__(self) -> str:
        backend = f"  Backend: {self.backend}" if self.backend else ""
        return (
            f"Distributed environment: {self.distributed_type}{backend}\n"
            f"Num processes: {self.num_processes}\n"
            f"Process index: {self.process_index}\n"
            f"Local process index: {self.local_process_index}\n"
            f"Device: {self.device}\n"
        )


# What an Accelerator sets in _SHARED (AcceleratorState._from's keywords); _reset_state forgets it.
_ACCELERATOR_KEYS = (
    "mixed_precision",
    "strategy",
    "strategy_type",
    "is_fsdp2",
    "fsdp_plugin",
    "deepspeed_plugin",
    "parallelism_config",
    "device_mesh",
)


class AcceleratorState(PartialState):
    """PartialState plus the latest Accelerator's settings: mixed precision and strategy.

    >>> import nbaccel
    >>> _ = nbaccel.Accelerator(cpu=True, mixed_precision="bf16")
    >>> AcceleratorState().mixed_precision, AcceleratorState().num_processes
    ('bf16', 1)
    """

    mixed_precision = property(lambda self: _SHARED.get("mixed_precision", "no"))
    strategy = property(lambda self: _SHARED.get("strategy", "ddp"))
    fsdp_plugin = property(lambda self: _SHARED.get("fsdp_plugin"))
    deepspeed_plugin = property(lambda self: _SHARED.get("deepspeed_plugin"))
    parallelism_config = property(lambda self: _SHARED.get("parallelism_config"))
    device_mesh = property(lambda self: _SHARED.get("device_mesh"), doc="The ranks' DeviceMesh.")

    is_fsdp2 = property(lambda self: _SHARED.get("is_fsdp2", False), doc="nbaccel's FSDP is FSDP2.")
    fork_launched = property(lambda self: False, doc="Ranks come from a fork server, not fork.")

    @classmethod
    def _reset_state(cls, reset_partial_state: bool = False) -> None:
        """Accelerate's reset between two Accelerators with different settings, which ported
        test code calls. Each nbaccel Accelerator sets its own, so this only forgets the last
        one's settings (mixed precision, strategy, a set ``distributed_type``); the process and
        its process group stay."""
        for key in _ACCELERATOR_KEYS:
            _SHARED.pop(key, None)
        _SHARED["distributed_type"] = None

    def get_deepspeed_plugin(self, name: str | None = None) -> Any:
        """The DeepSpeedPlugin in use (nbaccel takes one per Accelerator)."""
        if name is not None:
            raise ValueError(
                f"get_deepspeed_plugin({name!r}): nbaccel takes one DeepSpeedPlugin per "
                "Accelerator, not a dict of named ones; call it without a name."
            )
        return self.deepspeed_plugin

    def select_deepspeed_plugin(self, name: str | None = None) -> None:
        """Accelerate's switch between named DeepSpeed plugins; nbaccel has the one."""
        self.get_deepspeed_plugin(name)

    def _detected_type(self) -> DistributedType:
        strategy_type = _SHARED.get("strategy_type")  # what the strategy makes the run
        return strategy_type if strategy_type is not None else super()._detected_type()

    def __repr__(self) -> str:
        text = super().__repr__() + f"\nMixed precision type: {self.mixed_precision}\n"
        if self.distributed_type == DistributedType.DEEPSPEED and self.deepspeed_plugin:
            text += f"ds_config: {self.deepspeed_plugin.deepspeed_config}\n"
        return text
