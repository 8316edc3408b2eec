"""The Accelerator's training-step methods: backward, accumulation, uneven inputs over the
ranks, clipping, unscaling, autocast, profiling, freeing memory and resuming a loader mid-epoch.

Mixed into :class:`nbaccel.Accelerator`; relies on its strategy, precision and gradient state.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch

from nbaccel.training import data
from nbaccel.training.accelerator.parts import AcceleratorParts
from nbaccel.training.kwargs_handlers import AutocastKwargs, ProfileKwargs
from nbaccel.training.memory import release_memory


class TrainingStep(AcceleratorParts):
    """Mixed into :class:`nbaccel.Accelerator`."""

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward()`` with fp16 loss scaling and division for gradient accumulation.

        Example::

            loss = loss_fn(model(x), y)
            accelerator.backward(loss)   # instead of loss.backward()
        """
        if not self._registry.models:
            raise RuntimeError(
                "accelerator.backward() was called before any model was prepared; call "
                "model, optimizer = accelerator.prepare(model, optimizer) first."
            )
        self._strategy.backward(loss, self._precision, self._gs, **kwargs)

    def autocast(
        self, autocast_handler: AutocastKwargs | None = None
    ) -> contextlib.AbstractContextManager[Any]:
        """The mixed-precision context (prepared models already run their forward in it);
        ``AutocastKwargs(enabled=False)`` turns it off for a block.

        Example::

            with accelerator.autocast():
                loss = loss_fn(outputs, targets)   # a loss computed outside the model
        """
        return self._precision.forward_context(autocast_handler or self.autocast_handler)

    @contextlib.contextmanager
    def accumulate(self, *models: torch.nn.Module) -> Iterator[None]:
        """Accumulate gradients over ``gradient_accumulation_steps`` micro-steps.

        Gradients are synchronised (and optimizer/scheduler step) only on the last micro-step
        of each group, and on the last batch of a prepared DataLoader (unless
        ``GradientAccumulationPlugin(sync_with_dataloader=False)``). With
        ``GradientAccumulationPlugin(sync_each_batch=True)`` every backward all-reduces (less
        memory with large models), while the optimizer still steps once per group.

        Example::

            with accelerator.accumulate(model):
                accelerator.backward(loss_fn(model(x), y))
                optimizer.step()        # a real step every gradient_accumulation_steps
                optimizer.zero_grad()
        """
        gs = self._gs
        if gs.sync_with_dataloader and gs.end_of_dataloader:
            gs.micro_step, gs.sync_gradients = 0, True  # the next epoch starts a fresh group
        else:
            gs.micro_step += 1
            gs.sync_gradients = gs.micro_step % gs.accumulation_steps == 0
        with contextlib.ExitStack() as stack:
            if not gs.sync_gradients and not gs.sync_each_batch:
                for model in models:
                    stack.enter_context(self._strategy.no_sync(model))
            yield

    def no_sync(self, model: torch.nn.Module) -> contextlib.AbstractContextManager:
        """Skip gradient synchronisation for backward passes inside this context.

        Example::

            with accelerator.no_sync(model):
                accelerator.backward(loss)   # gradients stay local until the next synced backward
        """
        return self._strategy.no_sync(model)

    @contextlib.contextmanager
    def join_uneven_inputs(
        self, joinables: list[Any], even_batches: bool | None = None
    ) -> Iterator[None]:
        """Let ranks with fewer batches finish while DDP keeps the others going (torch's
        ``Join``); ``even_batches=False`` turns off evening-out for prepared loaders inside.

        Example::

            with accelerator.join_uneven_inputs([model], even_batches=False):
                for batch in loader:
                    ...
        """
        if not self.state.distributed:
            yield
            return
        kind = self.state.distributed_type.value
        if kind not in ("MULTI_CPU", "MULTI_GPU"):
            warnings.warn(
                f"join_uneven_inputs is only supported for multi-GPU or multi-CPU (DDP) "
                f"training; this run is {kind}, so the context does nothing.",
                UserWarning,
                stacklevel=3,
            )
            yield
            return
        from torch.distributed.algorithms.join import Join

        loaders = self._registry.dataloaders
        saved = [(dl, dl.even_batches) for dl in loaders if dl._sampler is not None]
        if even_batches is not None and len(saved) < len(loaders):
            warnings.warn(
                "join_uneven_inputs(even_batches=...) is only supported for map-style datasets; "
                "the prepared loaders of iterable datasets keep evening out their last batches.",
                UserWarning,
                stacklevel=3,
            )
        if even_batches is not None:
            for dl, _ in saved:
                dl.even_batches = even_batches
        even = even_batches if even_batches is not None else self.even_batches
        try:
            with Join(joinables, enable=not even, throw_on_early_termination=False):
                yield
        finally:
            for dl, value in saved:
                dl.even_batches = value

    @staticmethod
    @contextlib.contextmanager
    def trigger_sync_in_backward(model: torch.nn.Module) -> Iterator[None]:
        """Force DDP to synchronise gradients in the next backward, even inside ``no_sync``.

        Example::

            with accelerator.no_sync(model):
                ...
                with accelerator.trigger_sync_in_backward(model):
                    accelerator.backward(last_loss)
        """
        from torch.nn.parallel import DistributedDataParallel

        if not isinstance(model, DistributedDataParallel):
            yield
            return
        old = model.require_backward_grad_sync, model.require_forward_param_sync
        model.require_backward_grad_sync = model.require_forward_param_sync = True
        model.reducer.prepare_for_backward([])
        try:
            yield
        finally:
            model.require_backward_grad_sync, model.require_forward_param_sync = old

    def unscale_gradients(
        self, optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None
    ) -> None:
        """Divide fp16 gradients by the loss scale (before inspecting or clipping them).

        Example::

            accelerator.backward(loss)
            accelerator.unscale_gradients()
            print(model.weight.grad.norm())   # the true gradient, not the scaled one
        """
        optimizers: Sequence[Any]
        if optimizer is None:
            optimizers = self._registry.optimizers
        else:
            optimizers = optimizer if isinstance(optimizer, (list, tuple)) else [optimizer]
        for opt in optimizers:
            self._precision.unscale_(getattr(opt, "optimizer", opt))

    def clip_grad_norm_(
        self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2
    ) -> torch.Tensor | None:
        """Clip the total gradient norm (after unscaling fp16 gradients; FSDP-aware) and
        return it. It clips whenever it is called, as Accelerate's does: inside
        ``accumulate()`` a micro-step's gradients are partial (and local), so clip where
        ``accelerator.sync_gradients`` is True.

        Example::

            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), max_norm=1.0)
            optimizer.step()
        """
        self.unscale_gradients()
        return self._strategy.clip_grad_norm_(parameters, max_norm, norm_type)

    def clip_grad_value_(self, parameters: Iterable[torch.Tensor], clip_value: float) -> None:
        """Clamp every gradient to ``[-clip_value, clip_value]`` (after unscaling fp16),
        whenever it is called (as :meth:`clip_grad_norm_`).

        Example::

            accelerator.clip_grad_value_(model.parameters(), clip_value=0.5)
        """
        self.unscale_gradients()
        torch.nn.utils.clip_grad_value_(parameters, clip_value)

    @contextlib.contextmanager
    def profile(
        self, profile_handler: ProfileKwargs | None = None
    ) -> Iterator[torch.profiler.profile]:
        """``torch.profiler.profile`` configured by a ProfileKwargs; with ``output_trace_dir``
        each rank writes ``profile_<i>.json`` (Chrome trace; Accelerate's name) when the block ends.

        Example::

            with accelerator.profile(ProfileKwargs(activities=["cpu"])) as prof:
                train_step()
            print(prof.key_averages().table(row_limit=5))
        """
        handler = profile_handler or self.profile_handler or ProfileKwargs()
        names = handler.activities or ["cpu"] + (["cuda"] if self.device.type == "cuda" else [])
        kinds = torch.profiler.ProfilerActivity
        activities = [getattr(kinds, name.upper()) for name in names]
        schedule = (
            torch.profiler.schedule(**handler.schedule_option) if handler.schedule_option else None
        )
        with torch.profiler.profile(
            activities=activities,
            schedule=schedule,
            on_trace_ready=handler.on_trace_ready,
            record_shapes=handler.record_shapes,
            profile_memory=handler.profile_memory,
            with_stack=handler.with_stack,
            with_flops=handler.with_flops,
            with_modules=handler.with_modules,
        ) as profiler:
            yield profiler
        if handler.output_trace_dir is not None:
            os.makedirs(handler.output_trace_dir, exist_ok=True)
            name = f"profile_{self.process_index}.json"  # Accelerate's PROFILE_PATTERN_NAME
            profiler.export_chrome_trace(os.path.join(handler.output_trace_dir, name))
            self.wait_for_everyone()

    def free_memory(self, *objects: Any) -> Any:
        """Forget everything prepared (to start over, e.g. with a smaller batch) and free memory;
        returns ``objects`` as Nones for ``model, opt = accelerator.free_memory(model, opt)``.

        Example::

            model, optimizer = accelerator.free_memory(model, optimizer)
        """
        released = release_memory(*objects)
        self._registry.forget()
        self.step = 0
        return released

    def clear(self, *objects: Any) -> Any:
        """Alias of :meth:`free_memory` (Accelerate's name too)."""
        return self.free_memory(*objects)

    def skip_first_batches(self, dataloader: Any, num_batches: int = 0) -> Any:
        """A loader that skips the first ``num_batches`` batches of every epoch it runs (to
        resume mid-epoch: use it for the interrupted epoch, the original one afterwards).

        Example::

            accelerator.load_state(ckpt)
            active = accelerator.skip_first_batches(train_dl, batches_done_in_this_epoch)
        """
        return data.skip_first_batches(dataloader, num_batches)
