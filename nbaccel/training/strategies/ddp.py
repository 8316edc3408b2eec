"""The DDP strategy: one full copy of the model per rank, gradients averaged by DDP.

With one process the model is only moved to the device; with several it is wrapped in
``DistributedDataParallel`` (one GPU per rank on CUDA, gloo on CPU).

>>> import torch
>>> from nbaccel.training.state import detect_state
>>> s = DDPStrategy(detect_state(cpu=True))
>>> type(s.setup_module(torch.nn.Linear(2, 2))).__name__     # one process: no wrapper
'Linear'
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from nbaccel.training.strategies.base import Strategy


class DDPStrategy(Strategy):
    """Replicate the model; DDP all-reduces gradients during backward."""

    name = "ddp"

    def setup_module(self, module: torch.nn.Module) -> torch.nn.Module:
        module = module.to(self.state.device)
        if not self.state.distributed:
            return module
        device_ids = [self.state.device.index] if self.state.device.type == "cuda" else None
        return DistributedDataParallel(module, device_ids=device_ids, **self.ddp_kwargs)

    def unwrap(self, module: torch.nn.Module) -> torch.nn.Module:
        return module.module if isinstance(module, DistributedDataParallel) else module

    def no_sync(self, module: torch.nn.Module) -> contextlib.AbstractContextManager:
        if isinstance(module, DistributedDataParallel):
            return module.no_sync()
        return contextlib.nullcontext()

    def clip_grad_norm_(
        self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float
    ) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type=norm_type)

    def model_state_dict(self, module: torch.nn.Module) -> dict[str, Any]:
        return self.unwrap(module).state_dict()

    def load_model_state_dict(self, module: torch.nn.Module, state: dict[str, Any]) -> None:
        self.unwrap(module).load_state_dict(state)
