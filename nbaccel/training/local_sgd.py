"""Accelerate's ``LocalSGD``: each rank takes ``local_sgd_steps`` optimizer steps on its own
(DDP's gradient all-reduce off), then every rank's parameters are averaged; a last average when
the ``with`` block ends. Complementary to gradient accumulation.

Example (Accelerate's ``examples/by_feature/local_sgd.py``)::

    with LocalSGD(accelerator=accelerator, model=model, local_sgd_steps=8) as local_sgd:
        for batch in train_dataloader:
            with accelerator.accumulate(model):
                accelerator.backward(model(**batch).loss)
                optimizer.step()
                optimizer.zero_grad()
                local_sgd.step()

On one process it does nothing (as Accelerate's); under FSDP, DeepSpeed or XLA it is refused,
as Accelerate refuses it (each rank does not hold a whole model to average, or XLA has no
``no_sync``).
"""

from __future__ import annotations

import contextlib
from typing import Any

from nbaccel.training.process import DistributedType

# The kinds a model is replicated whole on every rank under (Accelerate's list).
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
    """Average the model's parameters across ranks every ``local_sgd_steps`` calls of
    :meth:`step` and when the ``with`` block ends, with DDP's gradient sync off in between.

    ``accelerator``: the :class:`~nbaccel.Accelerator`; ``model``: the prepared model;
    ``enabled=False`` (or one process) makes every call a no-op.
    """

    def __init__(
        self,
        accelerator: Any,
        model: Any,  # the prepared model (DDP's, with ``no_sync``)
        local_sgd_steps: int,
        enabled: bool = True,
    ) -> None:
        if accelerator.distributed_type not in _SUPPORTED:
            raise NotImplementedError(
                "LocalSGD is supported only for CPUs and GPUs (no DeepSpeed or MegatronLM)"
            )
        self.enabled = enabled and accelerator.distributed_type != DistributedType.NO
        self.num_steps = 0
        self._no_sync: contextlib.AbstractContextManager | None = None
        if self.enabled:
            self.accelerator = accelerator
            self.model = model
            self.local_sgd_steps = local_sgd_steps

    def __enter__(self) -> LocalSGD:
        if self.enabled:
            self._no_sync = self.model.no_sync()
            self._no_sync.__enter__()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if self.enabled:
            self._sync_and_avg_model_params()  # every rank leaves with the same weights
            assert self._no_sync is not None
            self._no_sync.__exit__(exc_type, exc, tb)

    def step(self) -> None:
        """One optimizer step taken: average the parameters every ``local_sgd_steps`` steps."""
        self.num_steps += 1
        if self.enabled and self.num_steps % self.local_sgd_steps == 0:
            self._sync_and_avg_model_params()

    def _sync_and_avg_model_params(self) -> None:
        self.accelerator.wait_for_everyone()
        with self.accelerator.autocast():
            for param in self.model.parameters():
                param.data = self.accelerator.reduce(param.data, reduction="mean")
