"""The parts the Accelerator's mixins share, declared once: what each mixin may read of the
others (``accelerator_processes``, ``accelerator_step``, ``accelerator_saving``, ``trackers``).

Nothing here runs: the declarations give the attributes ``Accelerator.__init__`` sets, and the
methods one mixin calls on another, their types, so the type checker holds every mixin to them
and a reader finds in one place what the ``Accelerator`` is made of.

>>> from nbaccel import Accelerator
>>> issubclass(Accelerator, AcceleratorParts)
True
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from nbaccel.training.accelerator.collectives import ProcessFacts
from nbaccel.training.accumulation import GradientState

if TYPE_CHECKING:
    from nbaccel.training.kwargs_handlers import (
        AutocastKwargs,
        DataLoaderConfiguration,
        ProfileKwargs,
        ProjectConfiguration,
    )
    from nbaccel.training.partial_state import AcceleratorState
    from nbaccel.training.precision import Precision
    from nbaccel.training.registry import PreparedObjects, Registry
    from nbaccel.training.strategies import Strategy


class AcceleratorParts(ProcessFacts):
    """What ``Accelerator.__init__`` builds, and the methods its mixins call on each other."""

    state: AcceleratorState
    gradient_state: GradientState  # Accelerate's public name for ``_gs``
    _strategy: Strategy
    _precision: Precision
    _registry: Registry
    dataloader_config: DataLoaderConfiguration
    project_configuration: ProjectConfiguration
    autocast_handler: AutocastKwargs | None
    profile_handler: ProfileKwargs | None
    step: int  # Accelerate's accumulate() counter (the gradient state's micro_step)
    _save_model_state_pre_hook: dict[int, Callable[..., None]]
    _load_model_state_pre_hook: dict[int, Callable[..., None]]

    if TYPE_CHECKING:

        @property
        def logging_dir(self) -> str | None: ...
        @property
        def even_batches(self) -> bool: ...
        @property
        def scaler(self) -> torch.amp.GradScaler | None: ...
        def wait_for_everyone(self) -> None: ...
        def prepared(self) -> PreparedObjects: ...
        def unwrap_model(
            self,
            model: torch.nn.Module,
            keep_fp32_wrapper: bool = True,
            keep_torch_compile: bool = True,
        ) -> Any: ...
