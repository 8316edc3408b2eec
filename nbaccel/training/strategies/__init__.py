"""Strategies own how objects are prepared and trained on N ranks (DDP, FSDP2, DeepSpeed, XLA):
wrapping, backward, gradient sync, clipping, state dicts and checkpoint files
(:class:`~nbaccel.training.strategies.base.Strategy`), and the prepared optimizer and scheduler
that step through the precision and gradient accumulation (``prepared``).

Adding a strategy means adding one module with a :class:`Strategy` subclass and one line that
registers it by name (:func:`nbaccel.core.strategy_registry.register`); the config file, the
command line, the config panel, the capability checks and :func:`select_strategy` read that
registry, and the Accelerator only calls the interface.

>>> from nbaccel.training.distributed import detect_state
>>> select_strategy("ddp", detect_state(cpu=True)).name
'ddp'
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from nbaccel.core import strategy_registry
from nbaccel.training.distributed import ProcessState
from nbaccel.training.strategies.base import Preparer, Strategy
from nbaccel.training.strategies.prepared import PreparedOptimizer, PreparedScheduler

if TYPE_CHECKING:
    from nbaccel.training.deepspeed_plugin import DeepSpeedPlugin
    from nbaccel.training.fsdp_plugin import FullyShardedDataParallelPlugin

__all__ = ["PreparedOptimizer", "PreparedScheduler", "Preparer", "Strategy", "select_strategy"]


def select_strategy(
    name: str,
    state: ProcessState,
    fsdp_plugin: FullyShardedDataParallelPlugin | None = None,
    deepspeed_plugin: DeepSpeedPlugin | None = None,
) -> Strategy:
    """The strategy registered as ``name`` ("ddp", "fsdp", "deepspeed", ...) for this process.

    Example::

        strategy = select_strategy("fsdp", detect_state())
    """
    if state.device.type == "xla":  # data parallel through XLA collectives (strategies.xla)
        if name not in ("ddp", "xla"):
            raise ValueError(
                f"strategy={name!r} does not run on XLA devices; nbaccel trains on XLA with "
                "replicated data parallelism (leave strategy unset, or 'ddp')."
            )
        from nbaccel.training.strategies.xla import XLAStrategy

        return XLAStrategy(state)
    entry = strategy_registry.get(name)  # a ValueError listing the choices if unknown
    module, _, class_name = entry.implementation.partition(":")
    strategy_class = getattr(importlib.import_module(module), class_name)
    # None: the strategy reads its settings from NBACCEL_FSDP_* / NBACCEL_DEEPSPEED_*
    plugins = {"fsdp": fsdp_plugin, "deepspeed": deepspeed_plugin}
    if entry.plugin is not None:
        return strategy_class(state, plugins[entry.plugin])
    return strategy_class(state)
