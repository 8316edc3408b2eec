"""The interface every strategy implements: everything the Accelerator asks of DDP, FSDP,
DeepSpeed or XLA, so it never asks which one it holds.

A strategy decides how objects are prepared (one at a time, or all at once into an engine),
how a model is wrapped and unwrapped, how backward, gradient sync and clipping run, how full
state dicts are read and written, and how ``save_state``/``load_state`` store each model and
optimizer. The defaults suit a plain model on one device; a strategy overrides what differs.

>>> import torch
>>> from nbaccel.training.accumulation import GradientState
>>> from nbaccel.training.distributed import detect_state
>>> from nbaccel.training.precision import Precision
>>> strategy = Strategy(detect_state(cpu=True))
>>> loss = torch.nn.Linear(2, 1)(torch.ones(1, 2)).sum()
>>> strategy.backward(loss, Precision(torch.device("cpu")), GradientState(accumulation_steps=2))
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, ClassVar, Protocol

import torch
from torch.utils.data import DataLoader

from nbaccel.training import deepspeed_dummies
from nbaccel.training.accumulation import GradientState
from nbaccel.training.data import PreparedDataLoader
from nbaccel.training.distributed import DistributedType, ProcessState
from nbaccel.training.file_reading import torch_load
from nbaccel.training.precision import Precision
from nbaccel.training.strategies.prepared import PreparedOptimizer


class Preparer(Protocol):
    """What a strategy may ask of the Accelerator while preparing: its one-object paths."""

    @property
    def gradient_state(self) -> GradientState: ...

    def prepare_model(
        self, model: torch.nn.Module, device_placement: bool | None = None
    ) -> torch.nn.Module: ...

    def prepare_optimizer(
        self, optimizer: torch.optim.Optimizer, device_placement: bool | None = None
    ) -> Any: ...

    def prepare_scheduler(self, scheduler: Any) -> Any: ...

    def prepare_data_loader(
        self, data_loader: DataLoader | PreparedDataLoader, device_placement: bool | None = None
    ) -> PreparedDataLoader: ...


class Prepared(Protocol):
    """The lists of what an Accelerator prepared (its ``registry.Registry``) that a strategy
    preparing several objects at once reads and adds to."""

    models: list[torch.nn.Module]
    optimizers: list[PreparedOptimizer]
    dataloaders: list[Any]


class Strategy:
    """The interface every strategy implements; the defaults suit a plain local model."""

    name: ClassVar[str] = "base"
    is_fsdp2: ClassVar[bool] = False  # Accelerate's ``accelerator.is_fsdp2``
    ddp_handler: Any = None  # a DistributedDataParallelKwargs, for strategies that use DDP

    def __init__(self, state: ProcessState) -> None:
        self.state = state

    # -- settings ---------------------------------------------------------------------------

    def adapt_precision(self, precision: Precision) -> Precision:
        """The precision the Accelerator runs with (an engine that casts itself replaces it)."""
        return precision

    def distributed_type(self) -> DistributedType | None:
        """Accelerate's ``distributed_type`` this strategy makes the run (FSDP, DEEPSPEED), or
        None where the process's own kind (NO, MULTI_CPU, MULTI_GPU, XLA) stands."""
        return None

    def plugins(self) -> dict[str, Any]:
        """Accelerate's plugin attributes this strategy fills (``fsdp_plugin``...), so a plugin
        built from the launch settings reads back from the Accelerator like a passed one."""
        return {}

    # -- prepare ----------------------------------------------------------------------------

    def prepare(
        self,
        objects: Sequence[Any],
        placement: Sequence[bool] | None,
        preparer: Preparer,
        registry: Prepared,
    ) -> list[Any]:
        """Prepare ``objects`` (``accelerator.prepare``'s arguments) in place of the originals.

        One at a time through ``preparer``; models first, since FSDP replaces parameters and
        optimizers must then follow them. ``registry`` holds what was prepared before.
        """
        deepspeed_dummies.refuse_stand_ins(objects)
        out: list[Any] = list(objects)
        kinds = (
            torch.nn.Module,
            torch.optim.Optimizer,
            torch.optim.lr_scheduler.LRScheduler,
            (DataLoader, PreparedDataLoader),
        )
        for kind in kinds:
            for i, obj in enumerate(objects):
                if not isinstance(obj, kind):
                    continue
                place = placement[i] if placement else None
                if isinstance(obj, torch.nn.Module):
                    out[i] = preparer.prepare_model(obj, device_placement=place)
                elif isinstance(obj, torch.optim.Optimizer):
                    out[i] = preparer.prepare_optimizer(obj, device_placement=place)
                elif isinstance(obj, torch.optim.lr_scheduler.LRScheduler):
                    out[i] = preparer.prepare_scheduler(obj)
                else:
                    out[i] = preparer.prepare_data_loader(obj, device_placement=place)
        return out

    def setup_module(self, module: torch.nn.Module) -> torch.nn.Module:
        raise NotImplementedError

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        return optimizer

    def unwrap(self, module: torch.nn.Module) -> torch.nn.Module:
        return module

    # -- training step ----------------------------------------------------------------------

    def backward(
        self, loss: torch.Tensor, precision: Precision, gs: GradientState, **kwargs: Any
    ) -> None:
        """``loss.backward()``, divided over the accumulation steps and scaled for fp16."""
        if gs.accumulation_steps > 1:
            loss = loss / gs.accumulation_steps
        precision.backward(loss, **kwargs)

    def no_sync(self, module: torch.nn.Module) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def clip_grad_norm_(
        self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float
    ) -> torch.Tensor | None:
        raise NotImplementedError

    # -- full state dicts -------------------------------------------------------------------

    def model_state_dict(self, module: torch.nn.Module, unwrap: bool = True) -> dict[str, Any]:
        """The full state dict; ``unwrap=False`` keeps a wrapper's names (DDP's ``module.``),
        where the strategy has a plain wrapper; sharded strategies give the model's own."""
        raise NotImplementedError

    def load_model_state_dict(self, module: torch.nn.Module, state: dict[str, Any]) -> None:
        raise NotImplementedError

    def optimizer_state_dict(
        self, module: torch.nn.Module | None, optimizer: torch.optim.Optimizer
    ) -> dict[str, Any]:
        return optimizer.state_dict()

    def load_optimizer_state_dict(
        self,
        module: torch.nn.Module | None,
        optimizer: torch.optim.Optimizer,
        state: dict[str, Any],
    ) -> None:
        optimizer.load_state_dict(state)

    # -- save_state / load_state ------------------------------------------------------------
    # ``target`` names one object's place in a checkpoint folder (``<folder>/model_0``): a
    # strategy writes a folder or files there itself, or returns a state dict that the main
    # process writes as ``<target>.pt``.

    @property
    def collective_checkpoint(self) -> bool:
        """Whether models are written and read by every rank's own collective (an engine's
        checkpoint, sharded folders) rather than as full state dicts; then, as in Accelerate,
        the pre-hooks get no ``weights`` and no load-time ``models``."""
        return False

    @property
    def full_state_on_every_rank(self) -> bool:
        """Whether every rank holds the whole model and optimizer state (replicas), so a rank
        can write a whole checkpoint of its own (ranks that pass ``save_state`` different
        folders)."""
        return False

    def models_for_hooks(
        self,
        models: Sequence[torch.nn.Module],
        unwrap: Callable[[torch.nn.Module], torch.nn.Module],
    ) -> list[torch.nn.Module]:
        """The models as Accelerate's save/load pre-hooks see them: the user's modules."""
        return [unwrap(model) for model in models]

    def save_model(self, module: torch.nn.Module, target: Path) -> dict[str, Any] | None:
        """Every rank: the full state dict to write at ``target`` (or None: written here)."""
        return self.model_state_dict(module)

    def save_optimizer(
        self, module: torch.nn.Module | None, optimizer: torch.optim.Optimizer, target: Path
    ) -> dict[str, Any] | None:
        """Every rank: the optimizer's state to write at ``target`` (or None: written here)."""
        return self.optimizer_state_dict(module, optimizer)

    def load_model(self, module: torch.nn.Module, target: Path) -> None:
        """Read what :meth:`save_model` left at ``target`` into ``module``: a full state dict,
        or a sharded folder (any strategy reads those; they reshard on load)."""
        if target.is_dir():
            from nbaccel.training.strategies import sharded_files  # imports slowly

            sharded_files.load_sharded_model(module, target)
        else:
            self.load_model_state_dict(module, torch_load(state_file(target)))

    def load_optimizer(
        self, module: torch.nn.Module | None, optimizer: torch.optim.Optimizer, target: Path
    ) -> None:
        """Read what :meth:`save_optimizer` left at ``target`` into ``optimizer``."""
        if target.is_dir() and module is not None:  # sharded: read through its model
            from nbaccel.training.strategies import sharded_files

            sharded_files.load_sharded_optimizer(module, optimizer, target)
        else:
            self.load_optimizer_state_dict(module, optimizer, torch_load(state_file(target)))


def state_file(target: Path) -> Path:
    """Where a state dict for ``target`` (``model_0``) is written: ``model_0.pt``."""
    return target.with_name(target.name + ".pt")
