"""The DDP strategy: one full copy of the model per rank, gradients averaged by DDP.

With one process the model is only moved to the device; with several it is wrapped in
``DistributedDataParallel`` (one GPU per rank on CUDA, gloo on CPU);
``extract_model_from_parallel`` takes the wrapper off again (Accelerate's free function).

>>> import torch
>>> from nbaccel.training.distributed import detect_state
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

from nbaccel.training.precision import Precision
from nbaccel.training.strategies.base import Strategy


class DDPStrategy(Strategy):
    """Replicate the model; DDP all-reduces gradients during backward."""

    name = "ddp"

    def setup_module(self, module: torch.nn.Module) -> torch.nn.Module:
        module = module.to(self.state.device)
        if not self.state.distributed:
            return module
        device_ids = [self.state.device.index] if self.state.device.type == "cuda" else None
        handler = self.ddp_handler
        kwargs = handler.ddp_kwargs() if handler is not None else {}
        wrapped = DistributedDataParallel(module, device_ids=device_ids, **kwargs)
        if handler is not None:
            register_comm_hook(wrapped, handler)
        return wrapped

    def unwrap(self, module: torch.nn.Module) -> torch.nn.Module:
        return module.module if isinstance(module, DistributedDataParallel) else module

    @property
    def full_state_on_every_rank(self) -> bool:
        return True  # replicas: DDP keeps every rank's model and optimizer the same

    def no_sync(self, module: torch.nn.Module) -> contextlib.AbstractContextManager:
        if isinstance(module, DistributedDataParallel):
            return module.no_sync()
        return contextlib.nullcontext()

    def clip_grad_norm_(
        self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float
    ) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type=norm_type)

    def model_state_dict(self, module: torch.nn.Module, unwrap: bool = True) -> dict[str, Any]:
        return (self.unwrap(module) if unwrap else module).state_dict()

    def load_model_state_dict(self, module: torch.nn.Module, state: dict[str, Any]) -> None:
        self.unwrap(module).load_state_dict(state)


def register_comm_hook(model: DistributedDataParallel, handler: Any) -> None:
    """DistributedDataParallelKwargs(comm_hook=..., comm_wrapper=...) as Accelerate applies it:
    compress gradients to fp16/bf16, or PowerSGD, optionally wrapped in an fp16/bf16 cast."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    hook_name = getattr(handler.comm_hook, "value", handler.comm_hook)
    if hook_name == "no":
        return
    hooks = {
        "fp16": default_hooks.fp16_compress_hook,
        "bf16": default_hooks.bf16_compress_hook,
        "power_sgd": powerSGD_hook.powerSGD_hook,
        "batched_power_sgd": powerSGD_hook.batched_powerSGD_hook,
    }
    hook = hooks[hook_name]
    state = None
    if hook_name in ("power_sgd", "batched_power_sgd"):
        state = powerSGD_hook.PowerSGDState(process_group=None, **handler.comm_state_option)
        wrapper = getattr(handler.comm_wrapper, "value", handler.comm_wrapper)
        if wrapper in ("fp16", "bf16"):
            hook = getattr(default_hooks, f"{wrapper}_compress_wrapper")(hook)
    model.register_comm_hook(state=state, hook=hook)


def extract_model_from_parallel(
    model: torch.nn.Module,
    keep_fp32_wrapper: bool = True,
    keep_torch_compile: bool = True,
    recursive: bool = False,
) -> torch.nn.Module:
    """The module inside DDP (and torch.compile, unless ``keep_torch_compile``); with
    ``recursive=True`` also DDP wrappers nested among its submodules.

    Example::

        plain = extract_model_from_parallel(ddp_model)
    """
    from torch.nn.parallel import DistributedDataParallel

    compiled = getattr(model, "_orig_mod", None)
    inner: Any = compiled if compiled is not None else model
    while isinstance(inner, DistributedDataParallel):
        inner = inner.module
    if not keep_fp32_wrapper:
        Precision.remove_autocast_forward(inner)
    if recursive:
        for parent in inner.modules():
            for name, child in list(parent.named_children()):
                if isinstance(child, DistributedDataParallel):
                    setattr(parent, name, extract_model_from_parallel(child, keep_fp32_wrapper))
    if compiled is not None and keep_torch_compile and inner is compiled:
        return model
    return inner
