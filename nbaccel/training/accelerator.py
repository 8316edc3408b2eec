"""The Accelerator: one object that makes a training loop run unchanged on 1 or N processes.

It reads the launch settings, then hands each concern to its own module: ``state`` (ranks,
device, process group), ``strategies`` (DDP/FSDP wrapping), ``precision`` (autocast, scaler),
``data`` (sharded loaders), ``ops`` (collectives) and ``checkpoint`` (save/resume). Names and
meanings follow Hugging Face Accelerate, so ported notebooks only change their import.

Example::

    from nbaccel import Accelerator
    acc = Accelerator()
    model, opt, dl = acc.prepare(model, opt, dl)
    for x, y in dl:
        with acc.accumulate(model):
            loss = loss_fn(model(x), y)
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

from nbaccel.core.config import (
    ENV_GRADIENT_ACCUMULATION_STEPS,
    ENV_MIXED_PRECISION,
    ENV_STRATEGY,
    normalize_mixed_precision,
)
from nbaccel.rank import reporting
from nbaccel.training import checkpoint, data
from nbaccel.training.accelerator_processes import ProcessControl
from nbaccel.training.precision import select_precision
from nbaccel.training.random import check_rng_types
from nbaccel.training.registry import PreparedObjects, pair_optimizer
from nbaccel.training.state import DistributedType, GradientState, detect_state
from nbaccel.training.strategies import PreparedOptimizer, PreparedScheduler, select_strategy

_PREPARED = "_nbaccel_prepared"


class Accelerator(ProcessControl):
    """Training on whatever this process was launched on: kernel, notebook_launcher, torchrun.

    Arguments left as ``None`` take the launcher's settings (``NBACCEL_*`` variables), else the
    defaults: full precision, no accumulation, DDP. Multi-process CPU runs use gloo by themselves.
    """

    def __init__(
        self,
        mixed_precision: str | None = None,
        gradient_accumulation_steps: int | None = None,
        cpu: bool = False,
        device_placement: bool = True,
        split_batches: bool = False,
        even_batches: bool = True,
        strategy: str | None = None,
        project_dir: str | os.PathLike[str] | None = None,
        rng_types: list[str] | None = None,
    ) -> None:
        mp = mixed_precision if mixed_precision is not None else os.environ.get(ENV_MIXED_PRECISION)
        try:
            mp = normalize_mixed_precision(mp)
        except ValueError as exc:
            raise ValueError(f"Accelerator(mixed_precision=...): {exc}") from None
        steps = gradient_accumulation_steps
        if steps is None:
            steps = int(os.environ.get(ENV_GRADIENT_ACCUMULATION_STEPS) or 1)
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"gradient_accumulation_steps must be an integer >= 1, got {steps!r}.")
        strategy = strategy if strategy is not None else os.environ.get(ENV_STRATEGY) or "ddp"
        self.state = detect_state(cpu=cpu)
        self._strategy = select_strategy(strategy, self.state)
        self._precision = select_precision(mp, self.state.device)
        self._gs = GradientState(accumulation_steps=steps)
        self.gradient_state = self._gs  # Accelerate's public name for the same object
        reporting.report_settings(self.mixed_precision, self.strategy, str(self.device), steps)
        self.device_placement, self.split_batches = device_placement, split_batches
        self.even_batches = even_batches
        self.project_dir = Path(project_dir) if project_dir is not None else None
        self.rng_types = check_rng_types(rng_types)
        self._models: list[torch.nn.Module] = []
        self._optimizers: list[PreparedOptimizer] = []
        self._schedulers: list[PreparedScheduler] = []
        self._dataloaders: list[data.PreparedDataLoader] = []
        self._custom_objects: list[Any] = []

    # -- where we run ---------------------------------------------------------------------

    device = property(lambda self: self.state.device, doc="This process's device.")
    process_index = property(lambda self: self.state.process_index, doc="Global rank.")
    local_process_index = property(lambda self: self.state.local_process_index)
    num_processes = property(lambda self: self.state.num_processes, doc="World size.")
    is_main_process = property(lambda self: self.state.is_main_process)
    is_local_main_process = property(lambda self: self.state.is_local_main_process)
    mixed_precision = property(lambda self: self._precision.name)
    gradient_accumulation_steps = property(lambda self: self._gs.accumulation_steps)
    sync_gradients = property(lambda self: self._gs.sync_gradients)
    scaler = property(lambda self: self._precision.scaler, doc="The fp16 GradScaler, or None.")
    strategy = property(lambda self: self._strategy.name)

    @property
    def distributed_type(self) -> DistributedType:
        """NO, MULTI_CPU, MULTI_GPU or FSDP (Accelerate's names)."""
        if not self.state.distributed:
            return DistributedType.NO
        if self._strategy.name == "fsdp":
            return DistributedType.FSDP
        return (
            DistributedType.MULTI_GPU if self.device.type == "cuda" else DistributedType.MULTI_CPU
        )

    @property
    def optimizer_step_was_skipped(self) -> bool:
        """Whether the last optimizer step was skipped (fp16 found inf/NaN gradients)."""
        return self._gs.optimizer_step_was_skipped

    def __repr__(self) -> str:
        return (
            f"Accelerator(rank {self.process_index}/{self.num_processes}, device={self.device}, "
            f"mixed_precision={self.mixed_precision!r}, strategy={self.strategy!r})"
        )

    # -- prepare --------------------------------------------------------------------------

    def prepare(self, *objects: Any, device_placement: list[bool] | None = None) -> Any:
        """Wrap models, optimizers, LR schedulers and DataLoaders; return them in the same order.

        Example::

            model, opt, train_dl, sched = acc.prepare(model, opt, train_dl, sched)
        """
        if device_placement is not None and len(device_placement) != len(objects):
            raise ValueError(
                f"device_placement has {len(device_placement)} entries for {len(objects)} objects;"
                " give one bool per object, or leave it out."
            )
        for i, obj in enumerate(objects):
            if getattr(obj, _PREPARED, False) or isinstance(
                obj, (PreparedOptimizer, PreparedScheduler, data.PreparedDataLoader)
            ):
                raise ValueError(
                    f"prepare() argument {i} ({type(obj).__name__}) was already prepared; pass "
                    "the original object only once and keep using what prepare() returned."
                )
        out: list[Any] = list(objects)
        # Models first: FSDP replaces parameters, and optimizers must then follow them.
        order = [torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]
        for kind in order + [DataLoader]:
            for i, obj in enumerate(objects):
                if isinstance(obj, kind):
                    place = device_placement[i] if device_placement else self.device_placement
                    out[i] = self._prepare_one(obj, place)
        return out[0] if len(out) == 1 else tuple(out)

    def _prepare_one(self, obj: Any, place: bool) -> Any:
        if isinstance(obj, torch.nn.Module):
            setattr(obj, _PREPARED, True)
            return self.prepare_model(obj)
        if isinstance(obj, torch.optim.Optimizer):
            setattr(obj, _PREPARED, True)
            opt = PreparedOptimizer(self._strategy.setup_optimizer(obj), self._precision, self._gs)
            self._optimizers.append(opt)
            return opt
        if isinstance(obj, torch.optim.lr_scheduler.LRScheduler):
            setattr(obj, _PREPARED, True)
            opts = [o for o in self._optimizers if o.optimizer is obj.optimizer]
            n = 1 if self.split_batches else self.num_processes
            sched = PreparedScheduler(obj, opts or self._optimizers, self._gs, n)
            self._schedulers.append(sched)
            return sched
        setattr(obj, _PREPARED, True)
        loader = data.PreparedDataLoader(
            obj,
            self.state,
            self._gs,
            split_batches=self.split_batches,
            even_batches=self.even_batches,
            device_placement=place,
            seed=data.shared_seed(obj),
            sync_rng=tuple(self.rng_types),
        )
        self._dataloaders.append(loader)
        return loader

    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """Convert for the precision, place on the device, wrap for the strategy.

        Example::

            model = accelerator.prepare_model(model)   # prepare() does this for modules
        """
        model = self._precision.convert_module(model)
        wrapped = self._strategy.setup_module(model)
        if self._precision.name != "no":
            # Run the forward under autocast so users need no `with accelerator.autocast()`.
            original = wrapped.forward
            context = self._precision.forward_context

            @functools.wraps(original)
            def forward(*args: Any, **kwargs: Any) -> Any:
                with context():
                    return original(*args, **kwargs)

            forward.__nbaccel_original__ = original
            wrapped.forward = forward
        self._models.append(wrapped)
        return wrapped

    def prepared(self) -> PreparedObjects:
        """What this Accelerator prepared: models, optimizers (each with its model), schedulers,
        dataloaders, custom checkpoint objects, and the strategy that reads their state.

        Example::

            for opt, model in zip(acc.prepared().optimizers, acc.prepared().optimizer_models):
                print(type(model).__name__, opt)
        """
        models = list(self._models)
        return PreparedObjects(
            models=tuple(models),
            optimizers=tuple(self._optimizers),
            optimizer_models=tuple(pair_optimizer(o, models) for o in self._optimizers),
            schedulers=tuple(self._schedulers),
            dataloaders=tuple(self._dataloaders),
            custom_objects=tuple(self._custom_objects),
            strategy=self._strategy,
        )

    def register_for_checkpointing(self, *objects: Any) -> None:
        """Include objects with ``state_dict``/``load_state_dict`` in save_state/load_state.

        Example::

            accelerator.register_for_checkpointing(ema)   # saved and restored with the rest
        """
        for obj in objects:
            if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                raise TypeError(
                    f"{type(obj).__name__} cannot be checkpointed: it needs state_dict() and "
                    "load_state_dict() methods."
                )
            self._custom_objects.append(obj)

    # -- training step --------------------------------------------------------------------

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward()`` with fp16 loss scaling and division for gradient accumulation.

        Example::

            loss = loss_fn(model(x), y)
            accelerator.backward(loss)   # instead of loss.backward()
        """
        if not self._models:
            raise RuntimeError(
                "accelerator.backward() was called before any model was prepared; call "
                "model, optimizer = accelerator.prepare(model, optimizer) first."
            )
        if self._gs.accumulation_steps > 1:
            loss = loss / self._gs.accumulation_steps
        self._precision.backward(loss, **kwargs)

    def autocast(self) -> contextlib.AbstractContextManager:
        """The mixed-precision context (prepared models already run their forward in it).

        Example::

            with accelerator.autocast():
                loss = loss_fn(outputs, targets)   # a loss computed outside the model
        """
        return self._precision.forward_context()

    @contextlib.contextmanager
    def accumulate(self, *models: torch.nn.Module) -> Iterator[None]:
        """Accumulate gradients over ``gradient_accumulation_steps`` micro-steps.

        Gradients are synchronised (and optimizer/scheduler step) only on the last micro-step
        of each group, and on the last batch of a prepared DataLoader.

        Example::

            with accelerator.accumulate(model):
                accelerator.backward(loss_fn(model(x), y))
                optimizer.step()        # a real step every gradient_accumulation_steps
                optimizer.zero_grad()
        """
        gs = self._gs
        gs.micro_step += 1
        gs.sync_gradients = gs.micro_step % gs.accumulation_steps == 0 or gs.at_loader_end
        if gs.at_loader_end:
            gs.micro_step = 0  # the next epoch starts a fresh accumulation group
        with contextlib.ExitStack() as stack:
            if not gs.sync_gradients:
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

    def _unscale(self) -> None:
        for opt in self._optimizers:
            self._precision.unscale_(opt.optimizer)

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2.0) -> Any:
        """Clip the total gradient norm (after unscaling fp16 gradients; FSDP-aware).

        Example::

            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), max_norm=1.0)
            optimizer.step()
        """
        if not self._gs.sync_gradients:
            return None  # gradients are partial mid-accumulation; clip once they are complete
        self._unscale()
        return self._strategy.clip_grad_norm_(parameters, max_norm, norm_type)

    def clip_grad_value_(self, parameters: Any, clip_value: float) -> None:
        """Clamp every gradient to ``[-clip_value, clip_value]`` (after unscaling fp16).

        Example::

            accelerator.clip_grad_value_(model.parameters(), clip_value=0.5)
        """
        if self._gs.sync_gradients:
            self._unscale()
            torch.nn.utils.clip_grad_value_(parameters, clip_value)

    # -- models and checkpoints -----------------------------------------------------------

    def unwrap_model(self, model: torch.nn.Module, keep_fp32_wrapper: bool = True) -> Any:
        """The user's module without DDP (FSDP modules are returned as they are).

        Example::

            return accelerator.unwrap_model(model)   # a plain nn.Module for the kernel
        """
        if not keep_fp32_wrapper and hasattr(model.forward, "__nbaccel_original__"):
            model.__dict__.pop("forward", None)  # back to the class's own forward
        return self._strategy.unwrap(model)

    def get_state_dict(self, model: torch.nn.Module) -> dict[str, Any]:
        """The model's full state dict (FSDP shards are gathered; call it on every rank).

        Example::

            state = accelerator.get_state_dict(model)
            accelerator.save(state, "model.pt")
        """
        return self._strategy.model_state_dict(model)

    def save(self, obj: Any, path: str | os.PathLike[str]) -> None:
        """``torch.save`` on the main process only, atomically (never a truncated file).

        Example::

            accelerator.save(accelerator.get_state_dict(model), "checkpoints/model.pt")
        """
        if self.is_main_process:
            checkpoint.atomic_save(obj, path)

    def _checkpoint_dir(self, directory: Any) -> Path:
        if directory is not None:
            return Path(directory)
        if self.project_dir is None:
            raise ValueError(
                "save_state()/load_state() need a folder: pass one, or create the Accelerator "
                "with project_dir=... to use <project_dir>/checkpoint."
            )
        return self.project_dir / "checkpoint"

    def save_state(self, output_dir: str | os.PathLike[str] | None = None) -> Path:
        """Save model, optimizer, scheduler, scaler, dataloader position and every rank's RNG
        states. Call it on every rank.

        Example::

            if step == 5:
                accelerator.save_state("checkpoints/step5")
        """
        return checkpoint.save_state(self, self._checkpoint_dir(output_dir))

    def load_state(self, input_dir: str | os.PathLike[str] | None = None) -> Path:
        """Restore a :meth:`save_state` folder into the prepared objects (every rank).

        Example::

            accelerator.load_state("checkpoints/step5")   # then continue the loop
        """
        return checkpoint.load_state(self, self._checkpoint_dir(input_dir))

    def log(self, values: dict[str, Any], step: int | None = None) -> None:
        """Send metrics to the launching kernel's dashboard (from every rank; no-op elsewhere).

        Example::

            accelerator.log({"loss": loss, "lr": scheduler.get_last_lr()[0]}, step=step)
        """
        reporting.log(values, step=step)
