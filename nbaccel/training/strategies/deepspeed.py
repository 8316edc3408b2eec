"""The DeepSpeed strategy: ZeRO stages 0-3 through one ``deepspeed.initialize`` engine.

DeepSpeed wants the model and optimizer together, so this strategy's :meth:`~DeepSpeedStrategy.prepare`
takes them at once. The engine then owns loss scaling, accumulation
boundaries, clipping and the optimizer step: ``backward`` runs ``engine.backward`` and, at a
boundary, ``engine.step``; the returned optimizer does nothing on ``step``/``zero_grad``
(Accelerate's behaviour). A torch LR scheduler stays nbaccel's prepared scheduler, so it
advances exactly as under DDP. ``save_state``/``load_state`` write DeepSpeed's own per-rank checkpoint;
``get_state_dict``/``save_model`` gather full weights under ZeRO-3.

On CPU, ``DS_ACCELERATOR=cpu`` is set before DeepSpeed is imported, and DeepSpeed's shared-memory
all-reduce (used for inference only, and JIT-compiled with g++ on first use, ~55 s) is marked
unavailable so training starts at once; set ``NBACCEL_DEEPSPEED_SHM_COMM=1`` to keep it.

Example::

    acc = Accelerator(deepspeed_plugin=DeepSpeedPlugin(zero_stage=3))
    model, opt, dl = acc.prepare(model, torch.optim.AdamW(model.parameters()), dl)
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

from nbaccel.training.accumulation import GradientState
from nbaccel.training.deepspeed_dummies import DummyOptim, DummyScheduler, EngineScheduler
from nbaccel.training.deepspeed_plugin import (
    DeepSpeedPlugin,
    fill_auto,
    import_deepspeed,
    join_process_group,
)
from nbaccel.training.distributed import DistributedType, ProcessState
from nbaccel.training.precision import Precision
from nbaccel.training.strategies.base import Prepared, Preparer, Strategy
from nbaccel.training.strategies.prepared import PreparedOptimizer


class DeepSpeedOptimizer(PreparedOptimizer):
    """The engine's optimizer: ``step``/``zero_grad`` are done by ``accelerator.backward`` at
    each accumulation boundary, so here they only record whether the step was skipped."""

    def __init__(self, engine: Any, gs: GradientState) -> None:
        super().__init__(engine.optimizer, Precision(torch.device("cpu")), gs)
        self._engine = engine

    def step(self, closure: Any = None) -> None:
        if self._gs.sync_gradients:
            self.step_was_skipped = bool(getattr(self._engine.optimizer, "overflow", False))
            self._gs.optimizer_step_was_skipped = self.step_was_skipped

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass  # engine.step() zeroes the gradients


class DeepSpeedStrategy(Strategy):
    """One DeepSpeed engine per Accelerator, configured by a :class:`DeepSpeedPlugin`."""

    name = "deepspeed"

    def __init__(self, state: ProcessState, plugin: DeepSpeedPlugin | None = None) -> None:
        super().__init__(state)
        self.plugin = plugin if plugin is not None else DeepSpeedPlugin()
        self.engine: Any = None
        self.config: dict[str, Any] = {}
        self.mixed_precision = "no"
        self._warned_clip = False
        self._ds = import_deepspeed(cpu=state.device.type == "cpu")  # fail early if missing

    def adapt_precision(self, precision: Precision) -> Precision:
        """A precision that casts nothing (the engine's bf16/fp16 sections do) but keeps the
        name, so ``accelerator.mixed_precision`` still reports it."""
        self.mixed_precision = precision.name
        plain = Precision(precision.device)
        plain.name = precision.name
        return plain

    def distributed_type(self) -> DistributedType | None:
        return DistributedType.DEEPSPEED  # as Accelerate: on one process too

    def plugins(self) -> dict[str, Any]:
        return {"deepspeed_plugin": self.plugin}

    # -- prepare ------------------------------------------------------------------------------

    def setup_module(self, module: torch.nn.Module) -> torch.nn.Module:
        raise RuntimeError(
            "with DeepSpeed, pass the model, its optimizer (and scheduler, DataLoader) to one "
            "accelerator.prepare(model, optimizer, dataloader) call: the engine wraps them "
            "together."
        )

    def prepare(
        self,
        objects: Sequence[Any],
        placement: Sequence[bool] | None,
        preparer: Preparer,
        registry: Prepared,
    ) -> list[Any]:
        """Prepare loaders as usual and model/optimizer/scheduler as one engine, entered in
        ``registry`` like what the one-object paths prepare."""
        args = list(objects)
        kinds = {
            kind: [i for i, a in enumerate(args) if isinstance(a, cls)]
            for kind, cls in (
                ("model", torch.nn.Module),
                ("optimizer", torch.optim.Optimizer),
                ("scheduler", (torch.optim.lr_scheduler.LRScheduler, DummyScheduler)),
                ("loader", DataLoader),
            )
        }
        # An engine forgotten by free_memory() may be replaced; a live one may not.
        live = self.engine is not None and any(m is self.engine for m in registry.models)
        for kind in ("model", "optimizer", "scheduler"):
            if len(kinds[kind]) > 1 or kinds[kind] and live:
                raise ValueError(
                    f"DeepSpeed trains one model with one optimizer and scheduler per "
                    f"Accelerator; this prepare() got another {kind}. Use one Accelerator per "
                    "model."
                )
        out = list(args)
        for i in kinds["loader"]:
            out[i] = preparer.prepare_data_loader(args[i], placement[i] if placement else None)
        if not kinds["model"]:
            if kinds["optimizer"] or kinds["scheduler"]:
                raise ValueError(
                    "with DeepSpeed, pass the optimizer and scheduler to the same prepare() call "
                    "as their model."
                )
            return out
        model = args[kinds["model"][0]]
        optimizer = args[kinds["optimizer"][0]] if kinds["optimizer"] else None
        scheduler = args[kinds["scheduler"][0]] if kinds["scheduler"] else None
        loaders = [out[i] for i in kinds["loader"]] or list(registry.dataloaders)
        gs = preparer.gradient_state
        self.engine = self._initialize(gs, model, optimizer, scheduler, loaders)
        out[kinds["model"][0]] = self.engine
        registry.models.append(self.engine)
        if optimizer is not None:
            opt = DeepSpeedOptimizer(self.engine, gs)
            out[kinds["optimizer"][0]] = opt
            registry.optimizers.append(opt)
        if isinstance(scheduler, DummyScheduler):
            out[kinds["scheduler"][0]] = EngineScheduler(self.engine)  # the engine steps it
        elif scheduler is not None:
            # Stepped like every prepared scheduler (N times per optimizer step on N ranks,
            # not on skipped steps), so a schedule runs as under DDP; saved by save_state.
            out[kinds["scheduler"][0]] = preparer.prepare_scheduler(scheduler)
        for obj in (model, optimizer):
            if obj is not None:
                obj._nbaccel_prepared = True
        return out

    def _initialize(
        self, gs: GradientState, model: Any, optimizer: Any, scheduler: Any, loaders: list[Any]
    ) -> Any:
        join_process_group(self._ds, self.state.local_process_index)
        config = self.plugin.deepspeed_config
        steps = self.plugin.gradient_accumulation_steps
        if config.get("gradient_accumulation_steps", "auto") != "auto":
            steps = config["gradient_accumulation_steps"]  # the config file is the authority
        if steps not in (None, "auto"):
            gs.accumulation_steps = int(steps)  # accumulate() must agree with the engine
        micro = loaders[0].batch_size if loaders else None  # per rank (split_batches applied)
        filled = fill_auto(
            config,
            micro_batch=micro,
            accumulation_steps=gs.accumulation_steps,
            world_size=self.state.num_processes,
            mixed_precision=self.mixed_precision,
            gradient_clipping=self.plugin.gradient_clipping,
            optimizer=optimizer,
            scheduler=scheduler if isinstance(scheduler, DummyScheduler) else None,
        )
        _check_stand_ins(filled, optimizer, scheduler)
        kwargs: dict[str, Any] = {"model": model, "config": filled}
        if isinstance(scheduler, DummyScheduler) and "scheduler" not in filled:
            kwargs["lr_scheduler"] = scheduler.lr_scheduler_callable  # called with the optimizer
        if optimizer is not None and "optimizer" in filled:
            # The config's optimizer type over the torch optimizer's parameter groups.
            kwargs["model_parameters"] = optimizer.param_groups
        elif optimizer is not None:
            filled.setdefault("zero_allow_untested_optimizer", True)  # SGD etc., as Accelerate
            # ZeRO-Offload would refuse a torch optimizer and ask for DeepSpeedCPUAdam, a
            # compiled op (~75 s JIT build); pass that optimizer yourself to get its speed.
            filled.setdefault("zero_force_ds_cpu_optimizer", False)
            kwargs["optimizer"] = optimizer
        if isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler) and "scheduler" in filled:
            raise ValueError(
                "the DeepSpeed config has a 'scheduler' section and a torch scheduler was "
                "passed to prepare(); keep one of them."
            )
        self.config = filled
        engine, *_ = self._ds.initialize(**kwargs)
        return engine

    # -- training -----------------------------------------------------------------------------

    def backward(
        self, loss: torch.Tensor, precision: Precision, gs: GradientState, **kwargs: Any
    ) -> None:
        """``engine.backward`` (scaled by 1/accumulation steps: not the precision's), then
        ``engine.step`` at the accumulation boundary (optimizer step, clipping, scheduler step,
        zeroing)."""
        engine = self._require_engine()
        engine.set_gradient_accumulation_boundary(gs.sync_gradients)
        engine.backward(loss, **kwargs)
        if gs.sync_gradients:
            engine.step()

    def clip_grad_norm_(
        self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float
    ) -> torch.Tensor | None:
        configured = self.config.get("gradient_clipping") if self.engine else None
        if not self._warned_clip and configured != max_norm:
            self._warned_clip = True
            warnings.warn(
                f"DeepSpeed clips gradients inside its step with gradient_clipping="
                f"{configured} from its config; clip_grad_norm_(max_norm={max_norm}) only "
                f"returns the norm. Set DeepSpeedPlugin(gradient_clipping={max_norm}) instead.",
                stacklevel=3,
            )
        norm = self._require_engine().get_global_grad_norm()
        return None if norm is None else torch.as_tensor(float(norm))

    def unwrap(self, module: torch.nn.Module) -> torch.nn.Module:
        return module.module if isinstance(module, self._ds.DeepSpeedEngine) else module

    # -- state --------------------------------------------------------------------------------

    def model_state_dict(self, module: torch.nn.Module, unwrap: bool = True) -> dict[str, Any]:
        """Full weights on every rank (ZeRO-3 gathers them: call it on every rank)."""
        inner = self.unwrap(module)
        params = [p for p in inner.parameters() if hasattr(p, "ds_id")]  # ZeRO-3 partitioned
        with self._ds.zero.GatheredParameters(params, modifier_rank=None, enabled=bool(params)):
            return {k: v.detach().cpu().clone() for k, v in inner.state_dict().items()}

    def load_model_state_dict(self, module: torch.nn.Module, state: dict[str, Any]) -> None:
        raise NotImplementedError(
            "a DeepSpeed engine restores its weights from its own checkpoint: use "
            "accelerator.load_state(folder), or load the weights into the model before prepare()."
        )

    # save_state/load_state: engine.save_checkpoint/load_checkpoint, the optimizer inside.

    @property
    def collective_checkpoint(self) -> bool:
        return True

    def models_for_hooks(
        self,
        models: Sequence[torch.nn.Module],
        unwrap: Callable[[torch.nn.Module], torch.nn.Module],
    ) -> list[torch.nn.Module]:
        return list(models)  # the engines, as Accelerate's hooks get them

    def save_model(self, module: torch.nn.Module, target: Path) -> dict[str, Any] | None:
        """``engine.save_checkpoint``: every rank writes its shard of weights and optimizer."""
        engine: Any = module  # a DeepSpeedEngine (DeepSpeed ships no annotations)
        engine.save_checkpoint(str(target.parent), tag=target.name, save_latest=False)
        return None

    def save_optimizer(
        self, module: torch.nn.Module | None, optimizer: torch.optim.Optimizer, target: Path
    ) -> dict[str, Any] | None:
        return None  # in the engine's checkpoint

    def load_model(self, module: torch.nn.Module, target: Path) -> None:
        """``engine.load_checkpoint`` of what :meth:`save_model` wrote."""
        if not target.is_dir():
            raise FileNotFoundError(
                f"{target} is missing: the checkpoint was not written by a DeepSpeed "
                "run; resume with the strategy that saved it."
            )
        engine: Any = module
        path, _ = engine.load_checkpoint(str(target.parent), tag=target.name)
        if path is None:
            raise RuntimeError(f"DeepSpeed could not load the checkpoint in {target}.")

    def load_optimizer(
        self, module: torch.nn.Module | None, optimizer: torch.optim.Optimizer, target: Path
    ) -> None:
        pass  # loaded with the engine's checkpoint

    def _require_engine(self) -> Any:
        if self.engine is None:
            raise RuntimeError(
                "no DeepSpeed engine yet: call accelerator.prepare(model, optimizer, dataloader) "
                "first."
            )
        return self.engine


def _check_stand_ins(config: dict[str, Any], optimizer: Any, scheduler: Any) -> None:
    """A DummyOptim/DummyScheduler needs the config section (or callable) it stands for."""
    if isinstance(optimizer, DummyOptim) and "optimizer" not in config:
        raise ValueError(
            "DummyOptim stands for the DeepSpeed config's optimizer, but the config has no "
            "'optimizer' section: add one ({'type': 'AdamW', 'params': {'lr': 'auto'}}) or pass "
            "a torch optimizer."
        )
    if (
        isinstance(scheduler, DummyScheduler)
        and "scheduler" not in config
        and scheduler.lr_scheduler_callable is None
    ):
        raise ValueError(
            "DummyScheduler stands for the DeepSpeed config's scheduler, but the config has no "
            "'scheduler' section: add one, give DummyScheduler(lr_scheduler_callable=...), or "
            "pass a torch scheduler."
        )
