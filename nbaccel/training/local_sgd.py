"""Local SGD (Accelerate's ``LocalSGD``, ``accelerate.local_sgd``): inside its ``with`` block
each rank trains its own copy of the model, with no gradient all-reduce, and every
``local_sgd_steps`` calls of ``step()`` (and when the block ends) the ranks replace their
parameters by the mean over all ranks. Fewer collectives per step, at the price of ranks
drifting apart between averages.

Example::

    with LocalSGD(accelerator, model, local_sgd_steps=8) as local_sgd:
        for x, y in loader:
            accelerator.backward(loss_fn(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
            local_sgd.step()
"""

from __future__ import annotations

from typing import Any

import torch

from nbaccel.training.distributed import DistributedType

__all__ = ["LocalSGD"]

# Where Accelerate allows it: one process (then it does nothing) or plain data parallelism.
_SUPPORTED = {
    DistributedType.NO,
    DistributedType.MULTI_CPU,
    DistributedType.MULTI_GPU,
    DistributedType.MULTI_XPU,
    DistributedType.MULTI_MLU,
    DistributedType.MULTI_HPU,
    DistributedType.MULTI_SDAA,
    DistributedType.MULTI_MUSA,
    DistributedType.MULTI_NPU,
    DistributedType.MULTI_NEURON,
}


class LocalSGD:
    """Average the model's parameters over the ranks every ``local_sgd_steps`` steps instead
    of all-reducing gradients every step. ``enabled=False`` (or one process) turns it into
    plain local training with nothing averaged."""

    def __init__(
        self, accelerator: Any, model: torch.nn.Module, local_sgd_steps: int, enabled: bool = True
    ) -> None:
        kind = accelerator.distributed_type
        if kind not in _SUPPORTED:
            raise NotImplementedError(
                f"LocalSGD runs on plain data parallelism over CPUs or GPUs (DDP) only; this "
                f"Accelerator runs {kind.value} (FSDP, DeepSpeed and XLA are not supported)."
            )
        self.enabled = enabled and kind != DistributedType.NO
        self.num_steps = 0
        self.accelerator, self.model, self.local_sgd_steps = accelerator, model, local_sgd_steps
        self._no_sync: Any = None

    def __enter__(self) -> LocalSGD:
        if self.enabled:
            self._no_sync = self.accelerator.no_sync(self.model)
            self._no_sync.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.enabled:
            self._average()
            self._no_sync.__exit__(*exc)

    def step(self) -> None:
        """Count one optimizer step; every ``local_sgd_steps``-th averages the parameters."""
        self.num_steps += 1
        if self.enabled and self.num_steps % self.local_sgd_steps == 0:
            self._average()

    def _average(self) -> None:
        self.accelerator.wait_for_everyone()
        with self.accelerator.autocast():
            for parameter in self.model.parameters():
                parameter.data = self.accelerator.reduce(parameter.data, reduction="mean")
