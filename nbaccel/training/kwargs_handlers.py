"""The option objects an Accelerate loop passes to the Accelerator, under Accelerate's names.

``ProjectConfiguration`` (where checkpoints and logs go), ``DataLoaderConfiguration`` (how
loaders are sharded), and the ``*Kwargs`` handlers that tune DDP, the fp16 scaler, the process
group, autocast and the profiler. Fields and defaults are Accelerate 1.x's, so
``kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=True)]`` ports as is.

>>> DistributedDataParallelKwargs(find_unused_parameters=True).to_kwargs()
{'find_unused_parameters': True}
"""

from __future__ import annotations

import dataclasses
import datetime
import enum
import os
from collections.abc import Callable
from typing import Any


class KwargsHandler:
    """Base of the ``*Kwargs`` handlers: ``to_kwargs()`` gives only the fields you changed."""

    def to_dict(self) -> dict[str, Any]:
        if not dataclasses.is_dataclass(self) or isinstance(self, type):
            raise TypeError(f"{type(self).__name__} is a KwargsHandler, so it must be a dataclass.")
        return dataclasses.asdict(self)

    def to_kwargs(self) -> dict[str, Any]:
        """The fields that differ from the defaults, ready to pass on as keyword arguments.

        ``DistributedDataParallel(model, **DistributedDataParallelKwargs(bucket_cap_mb=50)
        .to_kwargs())`` passes only that:

        >>> DistributedDataParallelKwargs(bucket_cap_mb=50).to_kwargs()
        {'bucket_cap_mb': 50}
        """
        default = type(self)().to_dict()
        return {k: v for k, v in self.to_dict().items() if default[k] != v}


class DDPCommunicationHookType(str, enum.Enum):
    """DDP gradient communication hooks (Accelerate's names), for
    ``DistributedDataParallelKwargs(comm_hook=...)``; plain strings compare equal.

    >>> DistributedDataParallelKwargs(comm_hook="fp16").comm_hook == DDPCommunicationHookType.FP16
    True
    """

    NO = "no"
    FP16 = "fp16"
    BF16 = "bf16"
    POWER_SGD = "power_sgd"
    BATCHED_POWER_SGD = "batched_power_sgd"


@dataclasses.dataclass
class DistributedDataParallelKwargs(KwargsHandler):
    """Options for ``torch.nn.parallel.DistributedDataParallel`` (only changed ones are passed).

    ``Accelerator(kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=True)])``
    wraps every prepared model with it:

    >>> DistributedDataParallelKwargs(find_unused_parameters=True).to_kwargs()
    {'find_unused_parameters': True}
    """

    dim: int = 0
    broadcast_buffers: bool = True
    bucket_cap_mb: int = 25
    find_unused_parameters: bool = False
    check_reduction: bool = False
    gradient_as_bucket_view: bool = False
    static_graph: bool = False
    comm_hook: DDPCommunicationHookType = DDPCommunicationHookType.NO
    comm_wrapper: DDPCommunicationHookType = DDPCommunicationHookType.NO
    comm_state_option: dict = dataclasses.field(default_factory=dict)

    def ddp_kwargs(self) -> dict[str, Any]:
        """The keyword arguments for DistributedDataParallel itself (hooks are not arguments)."""
        hooks = ("comm_hook", "comm_wrapper", "comm_state_option")
        return {k: v for k, v in self.to_kwargs().items() if k not in hooks}

    def register_comm_hook(self, model: Any) -> None:
        """Register ``comm_hook`` (wrapped in ``comm_wrapper``) on a DDP ``model``, as
        ``prepare`` does (for a model you wrapped in DistributedDataParallel yourself)."""
        from nbaccel.training.strategies.ddp import register_comm_hook

        register_comm_hook(model, self)


@dataclasses.dataclass
class GradScalerKwargs(KwargsHandler):
    """Options for the fp16 ``torch.amp.GradScaler``.

    ``Accelerator(mixed_precision="fp16", kwargs_handlers=[GradScalerKwargs(init_scale=1024)])``
    starts the loss scale at 1024:

    >>> GradScalerKwargs(init_scale=1024).to_kwargs()
    {'init_scale': 1024}
    """

    init_scale: float = 65536.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    enabled: bool = True


@dataclasses.dataclass
class InitProcessGroupKwargs(KwargsHandler):
    """Options for ``torch.distributed.init_process_group``: ``timeout``, ``init_method`` (how
    the processes find each other; default: the launcher's address) and ``backend`` (left at
    Accelerate's default "nccl", the device's own is used: gloo on CPU, NCCL on GPUs; any
    other, e.g. "gloo" on GPUs, is used as given).

    ``Accelerator(kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(hours=2))])``
    gives collectives two hours:

    >>> from datetime import timedelta
    >>> InitProcessGroupKwargs(timeout=timedelta(hours=2)).to_kwargs()
    {'timeout': datetime.timedelta(seconds=7200)}
    """

    backend: str | None = "nccl"
    init_method: str | None = None
    timeout: datetime.timedelta | None = None


@dataclasses.dataclass
class AutocastKwargs(KwargsHandler):
    """Options for ``torch.autocast`` (``enabled=False`` turns mixed precision off in a block).

    >>> import torch, nbaccel
    >>> accelerator = nbaccel.Accelerator(cpu=True, mixed_precision="bf16")
    >>> with accelerator.autocast():
    ...     torch.is_autocast_enabled("cpu")
    True
    >>> with accelerator.autocast(AutocastKwargs(enabled=False)):  # e.g. an exact loss
    ...     torch.is_autocast_enabled("cpu")
    False
    """

    enabled: bool = True
    cache_enabled: bool | None = None


@dataclasses.dataclass
class ProfileKwargs(KwargsHandler):
    """Options for ``torch.profiler.profile`` used by ``accelerator.profile()``.

    >>> import torch, nbaccel
    >>> accelerator = nbaccel.Accelerator(cpu=True)
    >>> with accelerator.profile(ProfileKwargs(activities=["cpu"], record_shapes=True)) as prof:
    ...     _ = torch.ones(64, 64) @ torch.ones(64, 64)
    >>> any(event.key == "aten::matmul" for event in prof.key_averages())
    True
    """

    activities: list[str] | None = None
    schedule_option: dict[str, int] | None = None
    on_trace_ready: Callable | None = None
    record_shapes: bool = False
    profile_memory: bool = False
    with_stack: bool = False
    with_flops: bool = False
    with_modules: bool = False
    output_trace_dir: str | None = None


@dataclasses.dataclass
class GradientAccumulationPlugin(KwargsHandler):
    """``gradient_accumulation_plugin=`` form of ``gradient_accumulation_steps``.

    Example::

        Accelerator(gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=4))
    """

    num_steps: int | None = None
    adjust_scheduler: bool = True
    sync_with_dataloader: bool = True
    sync_each_batch: bool = False


@dataclasses.dataclass
class ProjectConfiguration:
    """Where checkpoints and tracker logs go, and how checkpoints are named and pruned.

    With ``automatic_checkpoint_naming=True``, ``save_state()`` writes
    ``<project_dir>/checkpoints/checkpoint_<iteration>`` and keeps the newest ``total_limit``.

    ``Accelerator(project_config=config)`` uses it:

    >>> config = ProjectConfiguration("runs/exp1", automatic_checkpoint_naming=True, total_limit=2)
    >>> config.logging_dir  # the project folder unless given
    'runs/exp1'
    """

    project_dir: str | None = None
    logging_dir: str | None = None
    automatic_checkpoint_naming: bool = False
    total_limit: int | None = None
    iteration: int = 0
    save_on_each_node: bool = False

    def set_directories(self, project_dir: str | os.PathLike[str] | None = None) -> None:
        """Set ``project_dir`` and, when unset, ``logging_dir`` to the same folder."""
        self.project_dir = os.fspath(project_dir) if project_dir is not None else None
        if self.logging_dir is None:
            self.logging_dir = self.project_dir

    def __post_init__(self) -> None:
        self.set_directories(self.project_dir)


@dataclasses.dataclass
class DataLoaderConfiguration:
    """How prepared DataLoaders are sharded over the ranks.

    ``split_batches``: the loader's batch is the global batch, cut into one slice per rank.
    ``even_batches``: pad the last batches (from the start of the epoch) so every rank gets as
    many batches of the same size; ``gather_for_metrics`` drops the padding again.
    ``dispatch_batches``: accepted for compatibility; every rank gets the same batches as
    Accelerate's dispatching would give it, but each rank loads its own.

    >>> import torch, nbaccel
    >>> def batch_sizes():
    ...     accelerator = nbaccel.Accelerator(
    ...         dataloader_config=DataLoaderConfiguration(even_batches=False)
    ...     )
    ...     loader = torch.utils.data.DataLoader(list(range(10)), batch_size=4)
    ...     return [len(batch) for batch in accelerator.prepare(loader)]
    >>> nbaccel.notebook_launcher(
    ...     batch_sizes, num_processes=2, return_all=True, progress=False
    ... )  # doctest: +ELLIPSIS
    nbaccel: launching 2 processes...
    [[4, 2], [4]]
    """

    split_batches: bool = False
    dispatch_batches: bool | None = None
    even_batches: bool = True
    use_seedable_sampler: bool = False
    data_seed: int | None = None
    non_blocking: bool = False
    use_stateful_dataloader: bool = False


class LoggerType(str, enum.Enum):
    """Tracker names for ``log_with=`` (Accelerate's names)."""

    ALL = "all"
    AIM = "aim"
    TENSORBOARD = "tensorboard"
    WANDB = "wandb"
    TRACKIO = "trackio"
    COMETML = "comet_ml"
    MLFLOW = "mlflow"
    CLEARML = "clearml"
    DVCLIVE = "dvclive"
    SWANLAB = "swanlab"


class PrecisionType(str, enum.Enum):
    """``mixed_precision`` values (Accelerate's names)."""

    NO = "no"
    FP8 = "fp8"
    FP16 = "fp16"
    BF16 = "bf16"


class RNGType(str, enum.Enum):
    """``rng_types`` values that apply to CPU and CUDA runs."""

    TORCH = "torch"
    CUDA = "cuda"
    GENERATOR = "generator"
