"""Gradient accumulation's state: which micro-step this is, whether it ends with an optimizer
step, and which prepared loader is running (Accelerate's ``GradientState``). Each Accelerator
has its own, shared by the objects it prepared.

>>> GradientState(accumulation_steps=4).sync_gradients
True
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass
class GradientState:
    """Whether this micro-step ends with an optimizer step; shared by the prepared objects.

    ``active_dataloader`` is the prepared loader being iterated (the innermost one while a loop
    runs inside another loader's loop), ``None`` outside any.

    >>> GradientState(accumulation_steps=2).active_dataloader is None
    True
    """

    accumulation_steps: int = 1
    sync_gradients: bool = True
    micro_step: int = 0  # micro-steps taken inside accumulate(), counted from the start
    at_loader_end: bool = False  # the active dataloader is yielding its last batch
    # What gather_for_metrics keeps of that last step's gather (Accelerate's remainder; None,
    # 0 or -1: all of it).
    remainder: int | None = None
    optimizer_step_was_skipped: bool = False
    sync_each_batch: bool = False  # all-reduce every backward, step every accumulation_steps
    iterating: list[Any] = dataclasses.field(default_factory=list)  # loaders, outermost first

    # Accelerate's names for the same facts, for loops that read accelerator.gradient_state.
    end_of_dataloader = property(lambda self: self.at_loader_end)
    num_steps = property(lambda self: self.accumulation_steps)
    active_dataloader = property(lambda self: self.iterating[-1] if self.iterating else None)
    in_dataloader = property(lambda self: bool(self.iterating))

    @classmethod
    def _reset_state(cls) -> None:
        """Accelerate's reset of its process-wide gradient state, which ported test code calls
        between cases. nbaccel's belongs to one Accelerator, so there is nothing to reset."""
