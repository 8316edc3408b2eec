"""``DummyOptim`` and ``DummyScheduler``: stand-ins for the optimizer and scheduler a DeepSpeed
config defines (its ``"optimizer"``/``"scheduler"`` sections), as in Accelerate.

Pass them to ``accelerator.prepare`` with the model; the engine builds the real ones from the
config, filling its ``"auto"`` values from the stand-ins (``lr``, ``weight_decay``,
``warmup_num_steps``, ``total_num_steps``). What ``prepare`` returns for a ``DummyScheduler``
follows the engine's scheduler, which the engine steps itself.

>>> import torch
>>> opt = DummyOptim(torch.nn.Linear(2, 1).parameters(), lr=3e-4)
>>> opt.param_groups[0]["lr"]
0.0003
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch


def _not_for_use(what: str) -> RuntimeError:
    return RuntimeError(
        f"{what} only stands for what the DeepSpeed config defines: pass it to "
        "accelerator.prepare() together with the model, with an Accelerator that uses DeepSpeed "
        "(deepspeed_plugin=...), and use what prepare() returns."
    )


class DummyOptim(torch.optim.Optimizer):
    """The DeepSpeed config's optimizer, with the hyperparameters its ``"auto"`` values take.

    Example::

        optimizer = DummyOptim(model.parameters(), lr=3e-4, weight_decay=0.01)
        model, optimizer = accelerator.prepare(model, optimizer)   # the config's optimizer
    """

    def __init__(
        self, params: Iterable[Any], lr: float = 0.001, weight_decay: float = 0, **kwargs: Any
    ) -> None:
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay, **kwargs})
        self.lr, self.weight_decay, self.kwargs = lr, weight_decay, kwargs

    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        raise _not_for_use("DummyOptim")


class DummyScheduler:
    """The DeepSpeed config's scheduler (or ``lr_scheduler_callable(optimizer)``), with the
    step counts its ``"auto"`` values take.

    Example::

        scheduler = DummyScheduler(optimizer, total_num_steps=1000, warmup_num_steps=100)
        model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    """

    def __init__(
        self,
        optimizer: Any,
        total_num_steps: int | None = None,
        warmup_num_steps: int = 0,
        lr_scheduler_callable: Callable[[Any], Any] | None = None,
        **kwargs: Any,
    ) -> None:
        self.optimizer, self.total_num_steps = optimizer, total_num_steps
        self.warmup_num_steps, self.lr_scheduler_callable = warmup_num_steps, lr_scheduler_callable
        self.kwargs = kwargs

    def step(self, *args: Any, **kwargs: Any) -> None:
        raise _not_for_use("DummyScheduler")


class EngineScheduler:
    """What ``prepare`` returns for a ``DummyScheduler``: the engine's scheduler, read-only from
    the loop (the engine steps it with each optimizer step, so ``step()`` here does nothing).

    Example::

        scheduler.step()            # fine in a ported loop: the engine already stepped it
        scheduler.get_last_lr()     # the engine scheduler's learning rates
    """

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    @property
    def scheduler(self) -> Any:
        return self.engine.lr_scheduler

    def step(self, *args: Any, **kwargs: Any) -> None:
        pass

    def get_last_lr(self) -> list[float]:
        return self.scheduler.get_last_lr()

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state)

    def __getattr__(self, name: str) -> Any:
        if name == "engine":
            raise AttributeError(name)
        return getattr(self.engine.lr_scheduler, name)


def refuse_stand_ins(objects: Iterable[Any]) -> None:
    """Raise if a stand-in is prepared by an Accelerator without DeepSpeed (nothing would
    build the real optimizer or scheduler)."""
    names = [type(o).__name__ for o in objects if isinstance(o, (DummyOptim, DummyScheduler))]
    if names:
        raise ValueError(
            f"{', '.join(names)} stands for what a DeepSpeed config defines, but this "
            "Accelerator does not use DeepSpeed: pass a torch optimizer/scheduler, or create the "
            "Accelerator with deepspeed_plugin=DeepSpeedPlugin(...)."
        )
