"""What an Accelerator has prepared, and which model each optimizer updates.

A :class:`Registry` holds the lists that ``prepare()`` (and a strategy preparing several objects
at once, DeepSpeed) add to. ``Accelerator.prepared()`` returns a :class:`PreparedObjects`: the
one public view of the prepared models, optimizers (each paired with the model whose parameters
it holds), schedulers, dataloaders and custom checkpoint objects, used by ``save_state`` /
``load_state`` and anyone else who needs them. Pairing by parameters, not by position, keeps two models with two optimizers
(a GAN's G and D, a model and its EMA copy) right under FSDP, where the optimizer state can only
be gathered through its own model.

>>> import torch
>>> a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
>>> pair_optimizer(torch.optim.SGD(b.parameters(), lr=0.1), [a, b]) is b
True
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from nbaccel.training.strategies.base import Strategy
    from nbaccel.training.strategies.prepared import PreparedOptimizer, PreparedScheduler


def pair_optimizer(optimizer: Any, models: list[torch.nn.Module]) -> torch.nn.Module | None:
    """The model holding most of ``optimizer``'s parameters (None when it holds none of them).

    Example::

        model = pair_optimizer(opt_d, [generator, discriminator])   # -> discriminator
    """
    params = {id(p) for group in optimizer.param_groups for p in group["params"]}
    best, best_count = None, 0
    for model in models:
        count = sum(1 for p in model.parameters() if id(p) in params)
        if count > best_count:
            best, best_count = model, count
    return best


@dataclasses.dataclass(frozen=True)
class PreparedObjects:
    """Everything one Accelerator prepared, in the order it was prepared.

    ``optimizer_models[i]`` is the model whose parameters ``optimizers[i]`` updates (None for an
    optimizer over parameters of no prepared model). ``strategy`` wraps and unwraps the models
    and reads or writes their full state dicts (gathered under FSDP).

    Example::

        prepared = accelerator.prepared()
        for opt, model in zip(prepared.optimizers, prepared.optimizer_models):
            state = prepared.strategy.optimizer_state_dict(model, opt.optimizer)
    """

    models: tuple[torch.nn.Module, ...]
    optimizers: tuple[Any, ...]
    optimizer_models: tuple[torch.nn.Module | None, ...]
    schedulers: tuple[Any, ...]
    dataloaders: tuple[Any, ...]
    custom_objects: tuple[Any, ...]
    strategy: Strategy


@dataclasses.dataclass
class Registry:
    """The objects one Accelerator prepared, in the order it prepared them (mutable lists).

    >>> registry = Registry()
    >>> registry.models.append(torch.nn.Linear(1, 1))
    >>> registry.forget(); registry.models
    []
    """

    models: list[torch.nn.Module] = dataclasses.field(default_factory=list)
    optimizers: list[PreparedOptimizer] = dataclasses.field(default_factory=list)
    schedulers: list[PreparedScheduler] = dataclasses.field(default_factory=list)
    dataloaders: list[Any] = dataclasses.field(default_factory=list)
    custom_objects: list[Any] = dataclasses.field(
        default_factory=list
    )  # register_for_checkpointing

    def forget(self) -> None:
        """Drop the prepared models, optimizers, schedulers and loaders (``free_memory``); the
        checkpointed custom objects stay. New lists: a scheduler keeps the optimizers it had."""
        self.models, self.optimizers, self.schedulers, self.dataloaders = [], [], [], []

    def view(self, strategy: Strategy) -> PreparedObjects:
        """The read-only :class:`PreparedObjects`, each optimizer paired with its model."""
        models = list(self.models)
        return PreparedObjects(
            models=tuple(models),
            optimizers=tuple(self.optimizers),
            optimizer_models=tuple(pair_optimizer(o, models) for o in self.optimizers),
            schedulers=tuple(self.schedulers),
            dataloaders=tuple(self.dataloaders),
            custom_objects=tuple(self.custom_objects),
            strategy=strategy,
        )
