"""The prepared optimizer and scheduler: the user's objects, stepping through the precision and
gradient accumulation (one real step per accumulation group, none on skipped fp16 steps)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from nbaccel.training.accumulation import GradientState

# Set on each object prepare() was given, so passing it again is refused; an attribute of a
# scheduler lands in its state_dict(), which leaves it out (checkpoints are Accelerate's).
PREPARED_MARK = "_nbaccel_prepared"


class PreparedOptimizer(torch.optim.Optimizer):
    """The user's optimizer, stepping through the precision (fp16 scaler) and doing nothing on
    accumulation micro-steps. Everything else (``param_groups``, ``state``, hooks) is the
    original's, so LR schedulers built on either object work.

    Example::

        model, opt = accelerator.prepare(model, opt)
        opt.step(); opt.zero_grad()      # skipped inside accumulate() until the last micro-step
    """

    def __init__(self, optimizer: torch.optim.Optimizer, precision: Any, gs: GradientState):
        # Deliberately no super().__init__: the wrapped optimizer holds all the state.
        self.optimizer, self._precision, self._gs = optimizer, precision, gs
        self.step_was_skipped = False

    def __getattr__(self, name: str) -> Any:
        if name == "optimizer":
            raise AttributeError(name)
        return getattr(self.optimizer, name)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self) -> Any:
        return self.optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    def step(self, closure: Callable | None = None) -> None:
        if not self._gs.sync_gradients:
            return
        self.step_was_skipped = not self._precision.optimizer_step(self.optimizer, closure)
        self._gs.optimizer_step_was_skipped = self.step_was_skipped

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._gs.sync_gradients:
            self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)

    def __repr__(self) -> str:
        return f"PreparedOptimizer({self.optimizer!r})"

    # torch.optim.Optimizer's own __getstate__/__setstate__ expect the state on self; here it
    # all lives in the wrapped optimizer, which pickles itself (as Accelerate's wrapper does).
    def __getstate__(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)


class PreparedScheduler:
    """An LR scheduler that advances once per process for each real optimizer step.

    Schedules are usually sized from the unsharded DataLoader's length; each rank sees only
    1/N of the batches, so stepping N times per optimizer step makes the schedule end on time.
    Accumulation micro-steps and steps skipped by the fp16 scaler do not advance it. With
    ``step_scheduler_with_optimizer=False`` every ``step()`` advances it exactly once.
    """

    def __init__(
        self,
        scheduler: Any,
        optimizers: list[PreparedOptimizer],
        gs: GradientState,
        steps_per_update: int,
        step_with_optimizer: bool = True,
    ) -> None:
        self.scheduler, self._optimizers, self._gs = scheduler, optimizers, gs
        self._n, self._with_optimizer = steps_per_update, step_with_optimizer

    def __getattr__(self, name: str) -> Any:
        if name == "scheduler":
            raise AttributeError(name)
        return getattr(self.scheduler, name)

    def step(self, *args: Any, **kwargs: Any) -> None:
        if not self._with_optimizer:
            # step_scheduler_with_optimizer=False: the user steps it on their own schedule.
            self.scheduler.step(*args, **kwargs)
            return
        if not self._gs.sync_gradients:
            return
        if any(opt.step_was_skipped for opt in self._optimizers):
            return
        for _ in range(self._n):
            total = getattr(self.scheduler, "total_steps", None)
            if total is not None and self.scheduler.last_epoch >= total:
                break  # OneCycleLR raises past its end; the last partial step is not an error
            self.scheduler.step(*args, **kwargs)

    def state_dict(self) -> dict[str, Any]:
        state = self.scheduler.state_dict()
        state.pop(PREPARED_MARK, None)
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state_dict)

    def get_last_lr(self) -> list[float]:
        return self.scheduler.get_last_lr()
