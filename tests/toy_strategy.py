"""A toy strategy: one module, one registration line (tests/test_extension_points.py)."""

from __future__ import annotations

from nbaccel.core.strategy_registry import StrategyEntry, register
from nbaccel.training.strategies.ddp import DDPStrategy


class ToyStrategy(DDPStrategy):
    """DDP under another name: enough to see every reader of the registry find it."""

    name = "toy"


ENTRY = register(StrategyEntry("toy", "tests.toy_strategy:ToyStrategy", accelerate_type="TOY"))
