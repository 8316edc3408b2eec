"""Gradient accumulation's state: which micro-step this is, whether it ends with an optimizer
step, and which prepared loader is running (Accelerate's ``GradientState``). Each Accelerator
has its own, shared by the objects it prepared.

>>> GradientState(accumulation_steps=4).sync_gradients
True
>>> print(GradientState(accumulation_steps=4, sync_each_batch=True))
Sync Gradients: True
At end of current dataloader: False
Extra samples added: -1
Gradient accumulation plugin: {'num_steps': 4, 'sync_each_batch': True}
<BLANKLINE>
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(repr=False)
class GradientState:
    """Whether this micro-step ends with an optimizer step; shared by the prepared objects.

    ``active_dataloader`` is the prepared loader being iterated (the innermost one while a loop
    runs inside another loader's loop), ``None`` outside any. ``end_of_dataloader`` and
    ``remainder`` are that loader's, as in Accelerate: after an inner loop ends, the outer
    loop's last batch is still the end of its loader.

    >>> GradientState(accumulation_steps=2).active_dataloader is None
    True
    """

    accumulation_steps: int = 1
    sync_gradients: bool = True
    micro_step: int = 0  # Accelerate's Accelerator.step: accumulate() calls since the last reset
    optimizer_step_was_skipped: bool = False
    sync_each_batch: bool = False  # all-reduce every backward, step every accumulation_steps
    # False: the end of a loader neither forces a sync nor starts a new accumulation group.
    sync_with_dataloader: bool = True
    # The plugin's adjust_scheduler. Accelerate's GradientState reads it from the plugin's
    # non-default fields, so its adjust_scheduler is False either way: it changes nothing.
    plugin_adjust_scheduler: bool = True
    steps_given: bool = True  # whether num_steps is in plugin_kwargs (a plugin may leave it out)
    iterating: list[Any] = dataclasses.field(default_factory=list)  # loaders, outermost first

    # Accelerate's names for the same facts, for loops that read accelerator.gradient_state.
    num_steps = property(lambda self: self.accumulation_steps)
    active_dataloader = property(lambda self: self.iterating[-1] if self.iterating else None)
    in_dataloader = property(lambda self: bool(self.iterating))
    dataloader_references = property(lambda self: [None, *self.iterating])
    adjust_scheduler = property(lambda self: False, doc="Accelerate's, as it reads (above).")

    @property
    def end_of_dataloader(self) -> bool:
        """Whether the active loader is yielding its epoch's last batch (False outside one)."""
        return bool(self.iterating and self.iterating[-1].end_of_dataloader)

    @property
    def remainder(self) -> int:
        """The active loader's ``remainder`` (samples of its last step over all ranks; what
        ``gather_for_metrics`` keeps there), -1 outside a loader or where it is not known."""
        return self.iterating[-1].remainder if self.iterating else -1

    @property
    def plugin_kwargs(self) -> dict[str, Any]:
        """The GradientAccumulationPlugin's fields that differ from its defaults (Accelerate's
        ``plugin_kwargs``; an Accelerator built without a plugin has ``num_steps`` only)."""
        kwargs: dict[str, Any] = {"num_steps": self.accumulation_steps} if self.steps_given else {}
        if not self.plugin_adjust_scheduler:
            kwargs["adjust_scheduler"] = False
        if not self.sync_with_dataloader:
            kwargs["sync_with_dataloader"] = False
        if self.sync_each_batch:
            kwargs["sync_each_batch"] = True
        return kwargs

    def __repr__(self) -> str:
        return (
            f"Sync Gradients: {self.sync_gradients}\n"
            f"At end of current dataloader: {self.end_of_dataloader}\n"
            f"Extra samples added: {self.remainder}\n"
            f"Gradient accumulation plugin: {self.plugin_kwargs}\n"
        )

    @classmethod
    def _reset_state(cls) -> None:
        """Accelerate's reset of its process-wide gradient state, which ported test code calls
        between cases. nbaccel's belongs to one Accelerator, so there is nothing to reset."""
