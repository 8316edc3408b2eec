"""The Accelerator: one object that makes a training loop run unchanged on 1 or N processes.

It reads the launch settings, then hands each concern to its own module: ``process`` and
``partial_state`` (ranks, device, process group), ``strategies`` (DDP/FSDP/DeepSpeed/XLA:
preparing, backward, clipping, checkpoint files), ``precision`` (autocast,
scaler), ``data`` (sharded loaders), ``accelerator_processes`` (collectives, process control),
``accelerator_step`` (backward, accumulation, clipping), ``accelerator_saving`` (models and
checkpoints) and ``trackers``. Names, signatures and meanings follow Hugging Face Accelerate
1.x, so ported notebooks only change their import.

Example::

    from nbaccel import Accelerator
    acc = Accelerator()
    model, opt, dl = acc.prepare(model, opt, dl)
    for x, y in dl:
        with acc.accumulate(model):
            loss = loss_fn(model(x), y)
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
"""

from __future__ import annotations

import collections
import os
import warnings
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import DataLoader

from nbaccel.core.config import ENV_GRADIENT_ACCUMULATION_STEPS, ENV_MIXED_PRECISION, ENV_STRATEGY
from nbaccel.rank import settings_report
from nbaccel.training import data, data_compat
from nbaccel.training.accelerator import mesh_setup
from nbaccel.training.accelerator import pickling as accelerator_pickling
from nbaccel.training.accelerator.arguments import resolve_options
from nbaccel.training.accelerator.collectives import ProcessControl
from nbaccel.training.accelerator.mesh import MeshFacts
from nbaccel.training.accelerator.saving import Saving
from nbaccel.training.accelerator.step import TrainingStep
from nbaccel.training.accumulation import GradientState
from nbaccel.training.distributed import DistributedType, detect_state
from nbaccel.training.kwargs_handlers import LoggerType
from nbaccel.training.partial_state import AcceleratorState
from nbaccel.training.precision import select_precision
from nbaccel.training.registry import PreparedObjects, Registry
from nbaccel.training.strategies import PreparedOptimizer, PreparedScheduler, select_strategy
from nbaccel.training.strategies.prepared import PREPARED_MARK
from nbaccel.training.trackers import GeneralTracker, Tracking

if TYPE_CHECKING:
    from nbaccel.training.deepspeed_plugin import DeepSpeedPlugin
    from nbaccel.training.fsdp_plugin import FullyShardedDataParallelPlugin
    from nbaccel.training.kwargs_handlers import (
        DataLoaderConfiguration,
        GradientAccumulationPlugin,
        KwargsHandler,
        ProjectConfiguration,
        RNGType,
    )
    from nbaccel.training.parallelism_config import ParallelismConfig

# A tracker for ``log_with``: a name ("tensorboard", "all"), a LoggerType, or a tracker object.
TrackerChoice = str | LoggerType | GeneralTracker

_PREPARED = PREPARED_MARK
_UNSET: Any = object()  # "not given", so dataloader_config can supply split_batches


class Accelerator(ProcessControl, TrainingStep, Saving, Tracking, MeshFacts):
    """Training on whatever this process was launched on: kernel, notebook_launcher, torchrun.

    Arguments left as ``None`` take the launcher's settings (``NBACCEL_*`` variables), else the
    defaults: full precision, no accumulation, DDP. Multi-process CPU runs use gloo by themselves.
    Keywords are Accelerate's; ``strategy`` and ``even_batches`` are nbaccel's own.

    >>> import nbaccel, torch
    >>> def train():
    ...     accelerator = nbaccel.Accelerator()
    ...     torch.manual_seed(accelerator.process_index)  # each rank its own initial weights...
    ...     model = torch.nn.Linear(4, 1)
    ...     optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ...     data = torch.utils.data.TensorDataset(torch.randn(16, 4), torch.randn(16, 1))
    ...     loader = torch.utils.data.DataLoader(data, batch_size=4)
    ...     model, optimizer, loader = accelerator.prepare(model, optimizer, loader)  # ...rank 0's
    ...     for x, y in loader:  # each rank gets half the batches
    ...         loss = torch.nn.functional.mse_loss(model(x), y)
    ...         accelerator.backward(loss)  # gradients averaged over the ranks
    ...         optimizer.step()
    ...         optimizer.zero_grad()
    ...     weights = accelerator.unwrap_model(model).weight
    ...     return accelerator.num_processes, len(loader), weights.sum().item()
    >>> results = nbaccel.notebook_launcher(
    ...     train, num_processes=2, return_all=True, progress=False
    ... )  # doctest: +ELLIPSIS
    nbaccel: launching 2 processes...
    >>> [r[:2] for r in results], results[0][2] == results[1][2]  # ranks ended in step
    ([(2, 2), (2, 2)], True)
    """

    def __init__(
        self,
        device_placement: bool = True,
        split_batches: bool = _UNSET,
        mixed_precision: str | None = None,
        gradient_accumulation_steps: int | None = None,
        cpu: bool = False,
        dataloader_config: DataLoaderConfiguration | None = None,
        deepspeed_plugin: DeepSpeedPlugin | None = None,
        fsdp_plugin: FullyShardedDataParallelPlugin | None = None,
        torch_tp_plugin: object = None,  # refused below, as the next ones
        megatron_lm_plugin: object = None,
        rng_types: list[str | RNGType] | None = None,
        log_with: TrackerChoice | list[TrackerChoice] | None = None,
        project_dir: str | os.PathLike[str] | None = None,
        project_config: ProjectConfiguration | None = None,
        gradient_accumulation_plugin: GradientAccumulationPlugin | None = None,
        step_scheduler_with_optimizer: bool = True,
        kwargs_handlers: list[KwargsHandler] | None = None,
        dynamo_backend: str | None = None,  # torch.compile's backend name, e.g. "inductor"
        dynamo_plugin: object = None,  # anything with a ``backend`` name (a TorchDynamoPlugin)
        deepspeed_plugins: object = None,
        parallelism_config: ParallelismConfig | None = None,
        *,
        even_batches: bool | None = None,
        dispatch_batches: bool | None = None,
        strategy: str | None = None,
    ) -> None:
        for name, value in (
            ("deepspeed_plugins", deepspeed_plugins),
            ("torch_tp_plugin", torch_tp_plugin),
            ("megatron_lm_plugin", megatron_lm_plugin),
        ):
            if value is not None:
                raise NotImplementedError(
                    f"Accelerator({name}=...) is not supported by nbaccel, which runs DDP, FSDP "
                    "and DeepSpeed (one deepspeed_plugin=...) for sharded training."
                )
        if split_batches is not _UNSET:
            warnings.warn(
                f"Accelerator(split_batches={split_batches!r}) is ignored, as Accelerate 1.x "
                "ignores it (the same numbers either way); to split batches over the processes "
                "pass dataloader_config=DataLoaderConfiguration(split_batches=True).",
                UserWarning,
                stacklevel=2,
            )
        opts = resolve_options(
            mixed_precision=mixed_precision
            if mixed_precision is not None
            else os.environ.get(ENV_MIXED_PRECISION),
            gradient_accumulation_steps=gradient_accumulation_steps,
            env_steps=os.environ.get(ENV_GRADIENT_ACCUMULATION_STEPS),
            gradient_accumulation_plugin=gradient_accumulation_plugin,
            dataloader_config=dataloader_config,
            split_batches=None,
            even_batches=even_batches,
            dispatch_batches=dispatch_batches,
            kwargs_handlers=kwargs_handlers,
            project_dir=project_dir,
            project_config=project_config,
            rng_types=rng_types,
            dynamo_backend=dynamo_plugin if dynamo_plugin is not None else dynamo_backend,
            log_with=log_with,
        )
        strategy = strategy or os.environ.get(ENV_STRATEGY) or "ddp"
        if fsdp_plugin is not None:
            strategy = "fsdp"
        if deepspeed_plugin is not None:
            strategy = "deepspeed"
        process = detect_state(cpu=cpu, init_kwargs=opts.init_handler)
        self._strategy = select_strategy(strategy, process, fsdp_plugin, deepspeed_plugin)
        self._parallelism, self._mesh = mesh_setup.build(parallelism_config, process)
        if self._mesh is not None and self._parallelism is not None:
            self._strategy = mesh_setup.strategy(
                self._parallelism, self._mesh, process, self._strategy, fsdp_plugin
            )
        self._strategy.ddp_handler = opts.ddp_handler
        # An engine that casts and scales itself (DeepSpeed) replaces autocast and the scaler.
        self._precision = self._strategy.adapt_precision(
            select_precision(opts.mixed_precision, process.device, opts.scaler_handler)
        )
        # A plugin built from the launch config (NBACCEL_FSDP_*/DEEPSPEED_*) is as real as one
        # passed in: Accelerate users read it back from here.
        plugins = self._strategy.plugins()
        self.fsdp_plugin = plugins.get("fsdp_plugin", fsdp_plugin)
        self.deepspeed_plugin = plugins.get("deepspeed_plugin", deepspeed_plugin)
        self.state = AcceleratorState._from(
            process,
            mixed_precision=self._precision.name,
            strategy=self._strategy.name,
            strategy_type=self._strategy.distributed_type(),
            is_fsdp2=self._strategy.is_fsdp2,
            fsdp_plugin=self.fsdp_plugin,
            deepspeed_plugin=self.deepspeed_plugin,
            parallelism_config=self._parallelism,
            device_mesh=self._mesh,
        )
        self._gs = GradientState(
            accumulation_steps=opts.steps,
            sync_each_batch=opts.sync_each_batch,
            sync_with_dataloader=opts.sync_with_dataloader,
            plugin_adjust_scheduler=opts.adjust_scheduler,
            steps_given=opts.steps_given,
        )
        self.gradient_state = self._gs  # Accelerate's public name for the same object
        settings_report.report_settings(
            self.mixed_precision,
            self.strategy,
            str(self.device),
            opts.steps,
            **self._mesh_report(),
        )
        self.device_placement = device_placement
        self.dataloader_config = opts.dataloader_config
        self.project_configuration = opts.project_config
        self.rng_types = opts.rng_types
        self.step_scheduler_with_optimizer = step_scheduler_with_optimizer
        self.ddp_handler, self.scaler_handler = opts.ddp_handler, opts.scaler_handler
        self.init_handler, self.autocast_handler = opts.init_handler, opts.autocast_handler
        self.profile_handler = opts.profile_handler
        self.dynamo_backend = opts.dynamo_backend
        self.native_amp = self._precision.name in ("fp16", "bf16")
        self.has_lomo_optimizer = False
        self.flag_tensor: torch.Tensor | None = None  # set_trigger/check_trigger
        self._registry = Registry()
        self._save_model_state_pre_hook: dict[int, Any] = collections.OrderedDict()
        self._load_model_state_pre_hook: dict[int, Any] = collections.OrderedDict()
        self._init_tracking(opts.log_with)

    # -- where we run ---------------------------------------------------------------------

    device = property(lambda self: self.state.device, doc="This process's device.")
    process_index = property(lambda self: self.state.process_index, doc="Global rank.")
    local_process_index = property(lambda self: self.state.local_process_index)
    num_processes = property(lambda self: self.state.num_processes, doc="World size.")
    is_main_process = property(lambda self: self.state.is_main_process)
    is_local_main_process = property(lambda self: self.state.is_local_main_process)
    is_last_process = property(lambda self: self.state.is_last_process)
    use_distributed = property(lambda self: self.state.distributed)
    multi_device = property(lambda self: self.state.distributed)
    distributed_type = property(
        lambda self: self.state.distributed_type, doc=DistributedType.__doc__
    )
    is_fsdp2 = property(lambda self: self._strategy.is_fsdp2)
    mixed_precision = property(lambda self: self._precision.name)
    fp8_enabled = property(lambda self: self._precision.name == "fp8")
    fp8_backend = property(lambda self: "AO" if self._precision.name == "fp8" else None)

    @property
    def gradient_accumulation_steps(self) -> int:
        """Micro-steps per optimizer step (settable, as in Accelerate)."""
        return self._gs.accumulation_steps

    @gradient_accumulation_steps.setter
    def gradient_accumulation_steps(self, steps: int) -> None:
        # Accelerate's examples/by_feature/automatic_gradient_accumulation.py sets it inside
        # find_executable_batch_size's retry, after the Accelerator was made.
        self._gs.accumulation_steps, self._gs.steps_given = steps, True

    @property
    def step(self) -> int:
        """Accelerate's counter of ``accumulate()`` calls: back to 0 at the end of a loader (and
        on ``free_memory``); saved with the random states by ``save_state``."""
        return self._gs.micro_step

    @step.setter
    def step(self, value: int) -> None:
        self._gs.micro_step = value

    @property
    def sync_gradients(self) -> bool:
        return self._gs.sync_gradients

    @sync_gradients.setter
    def sync_gradients(self, sync: bool) -> None:
        self._gs.sync_gradients = sync

    @property
    def even_batches(self) -> bool:
        return self.dataloader_config.even_batches

    @even_batches.setter
    def even_batches(self, even: bool) -> None:
        # as Accelerate's: loaders prepared from now on (prepared ones keep theirs)
        self.dataloader_config.even_batches = even

    scaler = property(lambda self: self._precision.scaler, doc="The fp16 GradScaler, or None.")
    strategy = property(
        lambda self: self._strategy.name, doc="'ddp', 'fsdp' or 'deepspeed' (nbaccel's)."
    )
    split_batches = property(lambda self: self.dataloader_config.split_batches)
    dispatch_batches = property(lambda self: self.dataloader_config.dispatch_batches)
    non_blocking = property(lambda self: self.dataloader_config.non_blocking)
    use_seedable_sampler = property(lambda self: self.dataloader_config.use_seedable_sampler)
    use_stateful_dataloader = property(lambda self: self.dataloader_config.use_stateful_dataloader)

    # The registry's lists under Accelerate's private names, which its own test scripts and
    # ported code reach for (``accelerator._optimizers[0]``).
    _models = property(lambda self: self._registry.models)
    _optimizers = property(lambda self: self._registry.optimizers)
    _schedulers = property(lambda self: self._registry.schedulers)
    _dataloaders = property(lambda self: self._registry.dataloaders)
    _custom_objects = property(lambda self: self._registry.custom_objects)

    @property
    def optimizer_step_was_skipped(self) -> bool:
        """Whether a prepared optimizer's last step was skipped (fp16 found inf/NaN
        gradients)."""
        return any(getattr(opt, "step_was_skipped", False) for opt in self._registry.optimizers)

    def __repr__(self) -> str:
        return (
            f"Accelerator(rank {self.process_index}/{self.num_processes}, device={self.device}, "
            f"mixed_precision={self.mixed_precision!r}, strategy={self.strategy!r})"
        )

    def __reduce_ex__(self, protocol: Any) -> Any:
        # A reference to this Accelerator, loadable in this process only (see
        # accelerator_pickling); nbaccel's transport refuses it up front (sending_error).
        return accelerator_pickling.reduce_to_reference(self)

    def __nbaccel_not_sendable__(self) -> TypeError:
        return accelerator_pickling.sending_error(self)

    def __deepcopy__(self, memo: dict[int, Any]) -> Accelerator:
        # One per process: deep-copying something that refers to it (a prepared model's
        # wrapper, a config object) shares it, as Accelerate's does by reference.
        return self

    # -- prepare --------------------------------------------------------------------------

    def prepare(self, *args: Any, device_placement: list[bool] | None = None) -> Any:
        """Wrap models, optimizers, LR schedulers and DataLoaders; return them in the same order.

        Example::

            model, opt, train_dl, sched = acc.prepare(model, opt, train_dl, sched)
        """
        if device_placement is not None and len(device_placement) != len(args):
            raise ValueError(
                f"device_placement has {len(device_placement)} entries for {len(args)} objects;"
                " give one bool per object, or leave it out."
            )
        for i, obj in enumerate(args):
            # A DataLoader may be prepared again (by a second Accelerator, or after pickling):
            # each time gives a new loader, and the earlier ones keep working.
            if isinstance(obj, (DataLoader, data.PreparedDataLoader)):
                continue
            if getattr(obj, _PREPARED, False) or isinstance(
                obj, (PreparedOptimizer, PreparedScheduler)
            ):
                raise ValueError(
                    f"prepare() argument {i} ({type(obj).__name__}) was already prepared; pass "
                    "the original object only once and keep using what prepare() returned."
                )
        # The strategy decides: one object at a time (through the prepare_* methods below), or
        # model, optimizer and scheduler into one engine (DeepSpeed).
        out = self._strategy.prepare(args, device_placement, self, self._registry)
        return out[0] if len(out) == 1 else tuple(out)

    def prepare_model(
        self,
        model: torch.nn.Module,
        device_placement: bool | None = None,
        evaluation_mode: bool = False,
    ) -> torch.nn.Module:
        """Convert for the precision, place on the device, wrap for the strategy (with
        ``evaluation_mode=True`` only convert and place: no DDP/FSDP wrapper for inference).

        Example::

            model = accelerator.prepare_model(model)   # prepare() does this for modules
        """
        setattr(model, _PREPARED, True)
        model = self._precision.convert_module(model)
        if evaluation_mode or device_placement is False and not self.state.distributed:
            wrapped = model.to(self.device) if device_placement is not False else model
        else:
            wrapped = self._strategy.setup_module(model)
        if self._precision.name != "no":
            # On the user's module, not the wrapper: unwrap_model() keeps it, as in Accelerate.
            self._precision.autocast_forward(self._strategy.unwrap(wrapped), self.autocast_handler)
        if self.dynamo_backend is not None:
            compiled = torch.compile(wrapped, backend=self.dynamo_backend)
            assert isinstance(compiled, torch.nn.Module)  # a module compiles to a module
            wrapped = compiled
        self._registry.models.append(wrapped)
        return wrapped

    def prepare_optimizer(
        self, optimizer: torch.optim.Optimizer, device_placement: bool | None = None
    ) -> PreparedOptimizer:
        """Wrap an optimizer so it steps through the precision and gradient accumulation.

        Example::

            optimizer = accelerator.prepare_optimizer(optimizer)
        """
        setattr(optimizer, _PREPARED, True)
        inner = self._strategy.setup_optimizer(optimizer)
        opt = PreparedOptimizer(inner, self._precision, self._gs)
        self._registry.optimizers.append(opt)
        return opt

    def prepare_scheduler(
        self, scheduler: torch.optim.lr_scheduler.LRScheduler
    ) -> PreparedScheduler:
        """Wrap an LR scheduler so it steps with real optimizer steps (N times per step across
        N processes when ``step_scheduler_with_optimizer``, as Accelerate does).

        Example::

            scheduler = accelerator.prepare_scheduler(scheduler)
        """
        setattr(scheduler, _PREPARED, True)
        prepared = self._registry.optimizers
        opts = [o for o in prepared if o.optimizer is scheduler.optimizer]
        split = self.split_batches or not self.step_scheduler_with_optimizer
        n = 1 if split else self.num_processes
        sched = PreparedScheduler(
            scheduler, opts or prepared, self._gs, n, self.step_scheduler_with_optimizer
        )
        self._registry.schedulers.append(sched)
        return sched

    def prepare_data_loader(
        self,
        data_loader: DataLoader | data.PreparedDataLoader,
        device_placement: bool | None = None,
        slice_fn_for_dispatch: Any = None,
    ) -> data.PreparedDataLoader:
        """Shard a DataLoader over the ranks (see :class:`~nbaccel.training.data.PreparedDataLoader`).

        Example::

            train_dl = accelerator.prepare_data_loader(train_dl)
        """
        if isinstance(data_loader, data.PreparedDataLoader):
            data_loader = data_loader.original  # sharded afresh for this Accelerator
        place = self.device_placement if device_placement is None else device_placement
        cfg = self.dataloader_config
        if cfg.use_seedable_sampler:
            data_loader = data_compat.seedable(data_loader, cfg.data_seed)
        loader = data.loader_class(data_loader, cfg.dispatch_batches)(
            data_loader,
            self._data_parallel_state(),  # the data-parallel ranks: a tp group shares batches
            self._gs,
            split_batches=cfg.split_batches,
            even_batches=cfg.even_batches,
            device_placement=place,
            data_seed=cfg.data_seed,
            sync_rng=tuple(self.rng_types),
            non_blocking=cfg.non_blocking,
        )
        self._registry.dataloaders.append(loader)
        return loader

    def prepared(self) -> PreparedObjects:
        """What this Accelerator prepared: models, optimizers (each with its model), schedulers,
        dataloaders, custom checkpoint objects, and the strategy that reads their state.

        Example::

            for opt, model in zip(acc.prepared().optimizers, acc.prepared().optimizer_models):
                print(type(model).__name__, opt)
        """
        return self._registry.view(self._strategy)

    def register_for_checkpointing(self, *objects: Any) -> None:
        """Include objects with ``state_dict``/``load_state_dict`` in save_state/load_state.

        Example::

            accelerator.register_for_checkpointing(ema)   # saved and restored with the rest
        """
        for obj in objects:
            if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                raise NotCheckpointableError(
                    f"{type(obj).__name__} cannot be checkpointed: it needs state_dict() and "
                    "load_state_dict() methods."
                )
            self._registry.custom_objects.append(obj)


class NotCheckpointableError(TypeError, ValueError):
    """An object given to ``register_for_checkpointing`` without ``state_dict`` and
    ``load_state_dict``; a ``ValueError`` too, as Accelerate raises there."""
