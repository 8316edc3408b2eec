"""Strategies own how objects are prepared and trained on N ranks (DDP, FSDP2, DeepSpeed, XLA):
wrapping, backward, gradient sync, clipping, state dicts and checkpoint files
(:class:`~nbaccel.training.strategies.base.Strategy`), and the prepared optimizer and scheduler
that step through the precision and gradient accumulation (``prepared``).

Adding a strategy means adding one module with a :class:`Strategy` subclass and a line in
:func:`select_strategy`; the Accelerator only calls the interface.

>>> from nbaccel.training.process import detect_state
>>> select_strategy("ddp", detect_state(cpu=True)).name
'ddp'
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from nbaccel.core.config import STRATEGY_CHOICES
from nbaccel.training.process import ProcessState
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
    """The strategy called ``name`` ("ddp", "fsdp" or "deepspeed") for this process.

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
    if name == "ddp":
        from nbaccel.training.strategies.ddp import DDPStrategy

        return DDPStrategy(state)
    if name == "fsdp":
        from nbaccel.training.strategies.fsdp import FSDPStrategy

        return FSDPStrategy(state, fsdp_plugin)  # None: settings from NBACCEL_FSDP_*
    if name == "deepspeed":
        from nbaccel.training.strategies.deepspeed import DeepSpeedStrategy

        return DeepSpeedStrategy(state, deepspeed_plugin)  # None: NBACCEL_DEEPSPEED_*
    raise ValueError(
        f"strategy={name!r} is not known; choose one of {', '.join(map(repr, STRATEGY_CHOICES))}."
    )
