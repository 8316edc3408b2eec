"""The FSDP strategy: shard parameters, gradients and optimizer state with torch's FSDP2.

Every direct child module that owns parameters becomes one ``fully_shard`` unit, then the root;
the optimizer built on the unsharded parameters is pointed at the sharded ones. State dicts are
gathered to full tensors, so checkpoints and ``get_state_dict`` look like a plain model's.

Example::

    acc = Accelerator(strategy="fsdp")
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters()))
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from nbaccel.training.strategies.base import Strategy

_FULL = StateDictOptions(full_state_dict=True)


class FSDPStrategy(Strategy):
    """FSDP2 (``fully_shard``) over all ranks of this launch."""

    name = "fsdp"

    def __init__(self, state: Any) -> None:
        super().__init__(state)
        self._mesh = None
        self._new_params: dict[int, torch.nn.Parameter] = {}

    def setup_module(self, module: torch.nn.Module) -> torch.nn.Module:
        module = module.to(self.state.device)
        if not self.state.distributed:
            return module  # nothing to shard across; behaves like one DDP process
        if self._mesh is None:
            self._mesh = init_device_mesh(self.state.device.type, (self.state.num_processes,))
        before = dict(module.named_parameters())
        for child in module.children():
            if any(p.requires_grad for p in child.parameters()):
                fully_shard(child, mesh=self._mesh)
        fully_shard(module, mesh=self._mesh)
        after = dict(module.named_parameters())
        self._new_params.update({id(p): after[name] for name, p in before.items()})
        return module

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        # fully_shard replaced the parameters with sharded DTensors; an optimizer created before
        # prepare still holds the old ones and would update nothing.
        if optimizer.state:
            raise RuntimeError(
                "this optimizer has already taken steps; with strategy='fsdp' prepare it before "
                "training (its state cannot follow the parameters into their shards)."
            )
        for group in optimizer.param_groups:
            group["params"] = [self._new_params.get(id(p), p) for p in group["params"]]
        return optimizer

    def no_sync(self, module: torch.nn.Module) -> contextlib.AbstractContextManager:
        return _no_grad_sync(module) if isinstance(module, FSDPModule) else contextlib.nullcontext()

    def clip_grad_norm_(
        self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float
    ) -> torch.Tensor:
        norm = torch.nn.utils.clip_grad_norm_(list(parameters), max_norm, norm_type=norm_type)
        return norm.full_tensor() if isinstance(norm, DTensor) else norm

    def model_state_dict(self, module: torch.nn.Module) -> dict[str, Any]:
        if not isinstance(module, FSDPModule):
            return module.state_dict()
        return get_model_state_dict(module, options=_FULL)  # a collective: every rank calls it

    def load_model_state_dict(self, module: torch.nn.Module, state: dict[str, Any]) -> None:
        if not isinstance(module, FSDPModule):
            module.load_state_dict(state)
            return
        set_model_state_dict(module, state, options=_FULL)

    def optimizer_state_dict(
        self, module: torch.nn.Module, optimizer: torch.optim.Optimizer
    ) -> dict[str, Any]:
        if not isinstance(module, FSDPModule):
            return optimizer.state_dict()
        return get_optimizer_state_dict(module, optimizer, options=_FULL)

    def load_optimizer_state_dict(
        self, module: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
    ) -> None:
        if not isinstance(module, FSDPModule):
            optimizer.load_state_dict(state)
            return
        set_optimizer_state_dict(module, optimizer, state, options=_FULL)


@contextlib.contextmanager
def _no_grad_sync(module: FSDPModule) -> Iterator[None]:
    module.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        module.set_requires_gradient_sync(True)
