"""Data parallelism on XLA devices: replicas start equal, gradients are averaged by an XLA
all-reduce just before each optimizer step (what ``xm.optimizer_step`` does).

There is no wrapper module (no DDP on XLA): the model is moved to the device and rank 0's
parameters are broadcast, because device threads share one process's RNG and would otherwise
initialise different replicas.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from nbaccel.training.distributed import ProcessState
from nbaccel.training.strategies.base import Strategy


class XLAStrategy(Strategy):
    """One replica per XLA device; ``xm.reduce_gradients`` before every optimizer step.

    Example::

        strategy = XLAStrategy(state)            # state.device is an XLA device
        model = strategy.setup_module(model)     # on the device, rank 0's weights everywhere
    """

    name = "xla"

    def __init__(self, state: ProcessState) -> None:
        super().__init__(state)
        self._optimizers: list[torch.optim.Optimizer] = []
        self._reduced: set[int] = set()  # optimizers whose gradients clipping already reduced
        self._moved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(old): (old, new)

    def setup_module(self, module: torch.nn.Module) -> torch.nn.Module:
        before = dict(module.named_parameters())
        # Moving to XLA makes new Parameter objects (no shallow copy between CPU and XLA), so
        # an optimizer built before prepare() would step the CPU copies: remember who became whom.
        module = module.to(self.state.device)
        after = dict(module.named_parameters())
        self._moved.update({id(p): (p, after[n]) for n, p in before.items() if n in after})
        if self.state.num_processes > 1:
            import torch_xla.core.xla_model as xm

            xm.broadcast_master_param(module)
        return module

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        for group in optimizer.param_groups:  # step the parameters that are on the device
            group["params"] = [self._moved.get(id(p), (p, p))[1] for p in group["params"]]
        state = {self._moved.get(id(p), (p, p))[1]: v for p, v in optimizer.state.items()}
        optimizer.state.clear()
        optimizer.state.update(state)
        optimizer.register_step_pre_hook(self._before_step)
        self._optimizers.append(optimizer)
        return optimizer

    def _before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._reduce(optimizer)  # unless clipping did already
        self._reduced.discard(id(optimizer))

    def _reduce(self, optimizer: torch.optim.Optimizer) -> None:
        if self.state.num_processes > 1 and id(optimizer) not in self._reduced:
            import torch_xla.core.xla_model as xm

            xm.reduce_gradients(optimizer)  # all-reduce, scaled by 1/world: the mean gradient
            self._reduced.add(id(optimizer))

    def clip_grad_norm_(
        self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float
    ) -> torch.Tensor:
        for optimizer in self._optimizers:  # clip the averaged gradients, not the local ones
            self._reduce(optimizer)
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type=norm_type)

    def model_state_dict(self, module: torch.nn.Module, unwrap: bool = True) -> dict[str, Any]:
        return module.state_dict()

    def load_model_state_dict(self, module: torch.nn.Module, state: dict[str, Any]) -> None:
        module.load_state_dict(state)
