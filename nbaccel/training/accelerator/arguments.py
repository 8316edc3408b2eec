"""Turning the Accelerator's many keywords into one checked set of options.

Accelerate lets a setting come from several places (``split_batches=`` or
``dataloader_config=``, ``gradient_accumulation_steps=`` or a plugin, ``project_dir=`` or
``project_config=``, handlers in ``kwargs_handlers``); this module merges them with the same
precedence and says clearly when two disagree or a value is invalid.

>>> opts = resolve_options(gradient_accumulation_steps=4)
>>> (opts.steps, opts.mixed_precision, opts.dataloader_config.even_batches)
(4, 'no', True)
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from nbaccel.core.config import normalize_mixed_precision
from nbaccel.training.kwargs_handlers import (
    AutocastKwargs,
    DataLoaderConfiguration,
    DistributedDataParallelKwargs,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    ProfileKwargs,
    ProjectConfiguration,
)
from nbaccel.training.rng import check_rng_types

_HANDLERS = {
    DistributedDataParallelKwargs: "ddp_handler",
    GradScalerKwargs: "scaler_handler",
    InitProcessGroupKwargs: "init_handler",
    AutocastKwargs: "autocast_handler",
    ProfileKwargs: "profile_handler",
}


@dataclasses.dataclass
class Options:
    """Every Accelerator setting after merging; ``None`` handlers were not given."""

    mixed_precision: str = "no"
    steps: int = 1
    # GradientAccumulationPlugin's other fields (its defaults without a plugin)
    sync_each_batch: bool = False
    sync_with_dataloader: bool = True
    adjust_scheduler: bool = True
    steps_given: bool = True  # False: a plugin without num_steps (1 step, as in Accelerate)
    dataloader_config: DataLoaderConfiguration = dataclasses.field(
        default_factory=DataLoaderConfiguration
    )
    project_config: ProjectConfiguration = dataclasses.field(default_factory=ProjectConfiguration)
    rng_types: list[str] = dataclasses.field(default_factory=lambda: ["generator"])
    log_with: Any = None
    dynamo_backend: str | None = None
    ddp_handler: DistributedDataParallelKwargs | None = None
    scaler_handler: GradScalerKwargs | None = None
    init_handler: InitProcessGroupKwargs | None = None
    autocast_handler: AutocastKwargs | None = None
    profile_handler: ProfileKwargs | None = None


def resolve_options(
    *,
    mixed_precision: str | None = None,
    gradient_accumulation_steps: int | None = None,
    env_steps: str | None = None,
    gradient_accumulation_plugin: Any = None,
    dataloader_config: DataLoaderConfiguration | None = None,
    split_batches: bool | None = None,
    even_batches: bool | None = None,
    dispatch_batches: bool | None = None,
    kwargs_handlers: list[Any] | None = None,
    project_dir: str | os.PathLike[str] | None = None,
    project_config: ProjectConfiguration | None = None,
    rng_types: Any = None,
    dynamo_backend: Any = None,
    log_with: Any = None,
) -> Options:
    """Merge the Accelerator's keywords into :class:`Options`, refusing contradictions.

    Example::

        opts = resolve_options(split_batches=True, kwargs_handlers=[GradScalerKwargs()])
    """
    opts = Options(log_with=log_with)
    try:
        opts.mixed_precision = normalize_mixed_precision(mixed_precision)
    except ValueError as exc:
        raise ValueError(f"Accelerator(mixed_precision=...): {exc}") from None
    opts.steps = _steps(gradient_accumulation_steps, env_steps, gradient_accumulation_plugin)
    plugin = gradient_accumulation_plugin
    if plugin is not None:
        opts.sync_each_batch = bool(plugin.sync_each_batch)
        opts.sync_with_dataloader = bool(plugin.sync_with_dataloader)
        opts.adjust_scheduler = bool(plugin.adjust_scheduler)
        opts.steps_given = plugin.num_steps is not None
    cfg = dataloader_config if dataloader_config is not None else DataLoaderConfiguration()
    if dataloader_config is not None and split_batches is not None:
        raise ValueError(
            "pass split_batches either to Accelerator(...) or in dataloader_config=..., not both."
        )
    cfg = dataclasses.replace(cfg)  # the caller's object stays as given
    for name, value in (
        ("split_batches", split_batches),
        ("even_batches", even_batches),
        ("dispatch_batches", dispatch_batches),
    ):
        if value is not None:
            setattr(cfg, name, value)
    opts.dataloader_config = cfg
    config = project_config if project_config is not None else ProjectConfiguration()
    if project_dir is not None:
        config.set_directories(project_dir)
    opts.project_config = config
    opts.rng_types = check_rng_types(rng_types)
    for handler in kwargs_handlers or []:
        slot = _HANDLERS.get(type(handler))
        if slot is None:
            raise ValueError(
                f"kwargs_handlers: {type(handler).__name__} is not supported; nbaccel takes "
                f"{', '.join(sorted(k.__name__ for k in _HANDLERS))}."
            )
        if getattr(opts, slot) is not None:
            raise ValueError(f"kwargs_handlers has more than one {type(handler).__name__}.")
        setattr(opts, slot, handler)
    backend = getattr(dynamo_backend, "backend", dynamo_backend)  # a TorchDynamoPlugin or a name
    backend = getattr(backend, "value", backend)
    if backend is not None and str(backend).lower() != "no":
        opts.dynamo_backend = str(backend).lower()
    return opts


def _steps(given: int | None, env: str | None, plugin: Any) -> int:
    if plugin is not None:
        if given not in (None, 1):
            raise ValueError(
                "pass gradient_accumulation_steps or gradient_accumulation_plugin, not both."
            )
        given = 1 if plugin.num_steps is None else plugin.num_steps  # the environment is not read
    steps = given if given is not None else int(env or 1)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"gradient_accumulation_steps must be an integer >= 1, got {steps!r}.")
    return steps
