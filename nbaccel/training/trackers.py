"""Experiment trackers (``log_with=``): TensorBoard, W&B, MLflow, Comet, Aim, ClearML, DVCLive
or your own ``GeneralTracker``, with Accelerate's names and calls.

A tracker whose package is not installed is skipped with a warning, never a crash; ``"all"``
picks every installed one. Trackers run on the main process; ``accelerator.log`` also sends the
values to the launching kernel's live dashboard from every rank.

>>> [t for t in filter_trackers("all", "/tmp") if t == "nope"]
[]
"""

from __future__ import annotations

import functools
import os
import time
import warnings
from collections.abc import Callable
from typing import Any, ClassVar

from nbaccel.core import capabilities
from nbaccel.rank import reporting
from nbaccel.training.accelerator.parts import AcceleratorParts
from nbaccel.training.distributed import env_int
from nbaccel.training.kwargs_handlers import LoggerType


def on_main_process(function: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate a tracker method so it runs on the main process only, when the tracker's
    ``main_process_only`` is True (Accelerate's decorator for custom trackers).

    Example::

        class Printer(GeneralTracker):
            @on_main_process
            def log(self, values, step=None, **kwargs): print(step, values)
    """

    @functools.wraps(function)
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(self, "main_process_only", False) and env_int("RANK", 0):
            return None
        return function(self, *args, **kwargs)

    return run


class GeneralTracker:
    """Base of every tracker: set ``name``, ``requires_logging_directory`` and a ``tracker``
    property, and implement ``store_init_configuration``, ``log`` and ``finish``.

    Example::

        class Printer(GeneralTracker):
            name, requires_logging_directory = "printer", False
            tracker = property(lambda self: None)
            def log(self, values, step=None, **kwargs): print(step, values)
    """

    main_process_only = True
    # What a subclass defines (checked in __init__); declared for the type checker only.
    name: ClassVar[str]
    requires_logging_directory: ClassVar[bool]
    package: ClassVar[str]  # nbaccel's built-in trackers: the package they need installed
    tracker: Any

    def __init__(self, _blank: bool = False) -> None:
        missing = [
            a
            for a in ("name", "requires_logging_directory", "tracker")
            if not hasattr(type(self), a)
        ]
        if missing and not _blank:
            raise NotImplementedError(
                f"{type(self).__name__} is missing {', '.join(missing)}; define them on the class."
            )

    def start(self) -> None:
        """Open the run (called by ``init_trackers``)."""

    def store_init_configuration(self, values: dict) -> None:
        """Record the run's hyperparameters."""

    def log(self, values: dict, step: int | None = None, **kwargs: Any) -> None:
        """Record metric values at ``step``."""

    def finish(self) -> None:
        """Close the run (called by ``end_training``)."""


class TensorBoardTracker(GeneralTracker):
    """Event files under ``<logging_dir>/<run_name>`` through ``torch.utils.tensorboard``."""

    name, requires_logging_directory, package = "tensorboard", True, "tensorboard"

    def __init__(self, run_name: str, logging_dir: str | os.PathLike[str], **kwargs: Any) -> None:
        super().__init__()
        self.run_name, self.logging_dir_param, self.init_kwargs = run_name, logging_dir, kwargs
        self.writer: Any = None

    def start(self) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.logging_dir = os.path.join(self.logging_dir_param, self.run_name)
        self.writer = SummaryWriter(self.logging_dir, **self.init_kwargs)

    tracker = property(lambda self: self.writer)

    def store_init_configuration(self, values: dict) -> None:
        """The config as TensorBoard hparams, and as ``<run>/<time>/hparams.yml`` (where
        Accelerate writes a copy too)."""
        import yaml

        self.writer.add_hparams(values, metric_dict={})
        self.writer.flush()
        folder = os.path.join(self.logging_dir, str(time.time()))
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "hparams.yml"), "w") as file:
            yaml.dump(values, file)

    def log(self, values: dict, step: int | None = None, **kwargs: Any) -> None:
        for key, value in values.items():
            if isinstance(value, (int, float)) or hasattr(value, "item"):
                self.writer.add_scalar(key, float(value), global_step=step, **kwargs)
            elif isinstance(value, str):
                self.writer.add_text(key, value, global_step=step, **kwargs)
            elif isinstance(value, dict):
                self.writer.add_scalars(key, value, global_step=step, **kwargs)
        self.writer.flush()

    def finish(self) -> None:
        if self.writer is not None:
            self.writer.close()


class _ModuleTracker(GeneralTracker):
    """Trackers whose package has an init/log/finish style API; each says how in 3 methods."""

    requires_logging_directory = False

    def __init__(self, run_name: str, logging_dir: Any = None, **kwargs: Any) -> None:
        super().__init__()
        self.run_name, self.logging_dir, self.init_kwargs = run_name, logging_dir, kwargs
        self.run: Any = None

    tracker = property(lambda self: self.run)


class WandBTracker(_ModuleTracker):
    name = package = "wandb"

    def start(self) -> None:
        import wandb

        self.run = wandb.init(project=self.run_name, **self.init_kwargs)

    def store_init_configuration(self, values: dict) -> None:
        self.run.config.update(values, allow_val_change=True)

    def log(self, values: dict, step: int | None = None, **kwargs: Any) -> None:
        self.run.log(values, step=step, **kwargs)

    def finish(self) -> None:
        self.run.finish()


class MLflowTracker(_ModuleTracker):
    name = package = "mlflow"

    def start(self) -> None:
        import mlflow

        mlflow.set_experiment(self.run_name)
        self.run = mlflow.start_run(**self.init_kwargs)

    def store_init_configuration(self, values: dict) -> None:
        import mlflow

        mlflow.log_params(values)

    def log(self, values: dict, step: int | None = None, **kwargs: Any) -> None:
        import mlflow

        numbers = {k: float(v) for k, v in values.items() if isinstance(v, (int, float))}
        mlflow.log_metrics(numbers, step=step)

    def finish(self) -> None:
        import mlflow

        mlflow.end_run()


class CometMLTracker(_ModuleTracker):
    name = package = "comet_ml"

    def start(self) -> None:
        import comet_ml

        self.run = comet_ml.start(project_name=self.run_name, **self.init_kwargs)

    def store_init_configuration(self, values: dict) -> None:
        self.run.log_parameters(values)

    def log(self, values: dict, step: int | None = None, **kwargs: Any) -> None:
        self.run.log_metrics(values, step=step, **kwargs)

    def finish(self) -> None:
        self.run.end()


class AimTracker(_ModuleTracker):
    name = package = "aim"
    requires_logging_directory = True

    def start(self) -> None:
        import aim

        self.run = aim.Run(repo=self.logging_dir, experiment=self.run_name, **self.init_kwargs)

    def store_init_configuration(self, values: dict) -> None:
        self.run["hparams"] = values

    def log(self, values: dict, step: int | None = None, **kwargs: Any) -> None:
        for key, value in values.items():
            self.run.track(value, name=key, step=step, **kwargs)

    def finish(self) -> None:
        self.run.close()


class ClearMLTracker(_ModuleTracker):
    name = package = "clearml"

    def start(self) -> None:
        import clearml

        self.run = clearml.Task.init(project_name=self.run_name, **self.init_kwargs)

    def store_init_configuration(self, values: dict) -> None:
        self.run.connect_configuration(values)

    def log(self, values: dict, step: int | None = None, **kwargs: Any) -> None:
        for key, value in values.items():
            self.run.get_logger().report_scalar(key, key, value, iteration=step or 0)

    def finish(self) -> None:
        self.run.close()


class DVCLiveTracker(_ModuleTracker):
    name = package = "dvclive"

    def start(self) -> None:
        import dvclive

        self.run = dvclive.Live(**self.init_kwargs)

    def store_init_configuration(self, values: dict) -> None:
        self.run.log_params(values)

    def log(self, values: dict, step: int | None = None, **kwargs: Any) -> None:
        if step is not None:
            self.run.step = step
        for key, value in values.items():
            self.run.log_metric(key, value, **kwargs)
        self.run.next_step()

    def finish(self) -> None:
        self.run.end()


TRACKERS: dict[str, type[GeneralTracker]] = {
    cls.name: cls
    for cls in (TensorBoardTracker, WandBTracker, MLflowTracker, CometMLTracker, AimTracker)
    + (ClearMLTracker, DVCLiveTracker)
}


def _installed(name: str) -> bool:
    return capabilities.package_available(TRACKERS[name].package)


def filter_trackers(log_with: Any, logging_dir: Any = None) -> list[Any]:
    """The usable trackers among ``log_with`` (names, LoggerTypes or GeneralTracker objects).

    Missing packages are skipped with a warning; ``"all"`` means every installed tracker.

    Example::

        filter_trackers(["tensorboard", "wandb"], "runs/")   # ["tensorboard"] without wandb
    """
    if log_with is None:
        return []
    wanted = list(log_with) if isinstance(log_with, (list, tuple)) else [log_with]
    chosen: list[Any] = [t for t in wanted if isinstance(t, GeneralTracker)]
    names = [str(getattr(t, "value", t)) for t in wanted if not isinstance(t, GeneralTracker)]
    if LoggerType.ALL.value in names:
        names = [n for n in TRACKERS if _installed(n)]
    for name in names:
        if name not in TRACKERS:
            known = ", ".join(["all", *TRACKERS])
            raise ValueError(f"log_with={name!r} is not a known tracker; choose from {known}.")
        if name in chosen:
            continue
        if not _installed(name):
            warnings.warn(
                f"log_with={name!r}: the {TRACKERS[name].package!r} package is not installed, "
                "so this run is not tracked there (pip install it to enable).",
                stacklevel=3,
            )
            continue
        if TRACKERS[name].requires_logging_directory and logging_dir is None:
            raise ValueError(
                f"log_with={name!r} writes files, so it needs a folder: pass "
                "project_dir=... or ProjectConfiguration(logging_dir=...) to the Accelerator."
            )
        chosen.append(name)
    return chosen


def _chartable(value: Any) -> bool:
    """Whether the dashboard can chart ``value``: a number, or a one-element tensor/array."""
    if isinstance(value, (int, float)):
        return True
    numel = getattr(value, "numel", None)
    if callable(numel):
        return bool(numel() == 1)
    return type(value).__module__ == "numpy" and getattr(value, "size", 0) == 1


class Tracking(AcceleratorParts):
    """Mixed into :class:`nbaccel.Accelerator`: init_trackers, log, get_tracker, end_training."""

    def _init_tracking(self, log_with: Any) -> None:
        self.log_with = filter_trackers(log_with, self.logging_dir)
        self.trackers: list[GeneralTracker] = []

    def init_trackers(
        self, project_name: str, config: dict | None = None, init_kwargs: dict | None = None
    ) -> None:
        """Start the trackers chosen with ``log_with=`` (main process), storing ``config``.

        Example::

            accelerator.init_trackers("mnist", config={"lr": 1e-3}, init_kwargs={"wandb": {}})
        """
        init_kwargs = init_kwargs or {}
        for chosen in self.log_with:
            if isinstance(chosen, GeneralTracker):
                tracker = chosen
            elif self.is_main_process:
                tracker = TRACKERS[chosen](
                    project_name, self.logging_dir, **init_kwargs.get(chosen, {})
                )
            else:
                continue
            if tracker.main_process_only and not self.is_main_process:
                continue
            tracker.start()
            self.trackers.append(tracker)
        if config is not None:
            for tracker in self.trackers:
                tracker.store_init_configuration(config)

    def get_tracker(self, name: str, unwrap: bool = False) -> Any:
        """The tracker called ``name`` (its raw run/writer with ``unwrap=True``); on other ranks
        a do-nothing tracker, so ``get_tracker(...).log(...)`` is safe everywhere.

        Example::

            writer = accelerator.get_tracker("tensorboard", unwrap=True)
        """
        for tracker in self.trackers:
            if tracker.name == name:
                return tracker.tracker if unwrap else tracker
        if self.trackers:
            raise ValueError(f"{name!r} is not one of this Accelerator's trackers.")
        return GeneralTracker(_blank=True)

    def log(
        self, values: dict[str, Any], step: int | None = None, log_kwargs: dict | None = None
    ) -> None:
        """Send metrics to the trackers (main process) and to the launching kernel's dashboard
        (every rank; a no-op outside a launch). The trackers get every value, as with
        Accelerate (TensorBoard logs a string as text, a dict as grouped scalars); the
        dashboard charts the numbers among them.

        Example::

            accelerator.log({"loss": loss, "lr": scheduler.get_last_lr()[0]}, step=step)
        """
        reporting.log({k: v for k, v in values.items() if _chartable(v)}, step=step)
        log_kwargs = log_kwargs or {}
        for tracker in self.trackers:
            plain = {k: v.item() if hasattr(v, "item") else v for k, v in values.items()}
            tracker.log(plain, step=step, **log_kwargs.get(tracker.name, {}))

    def end_training(self) -> None:
        """Close every tracker and wait for every rank.

        Example::

            accelerator.end_training()
        """
        for tracker in self.trackers:
            tracker.finish()
        self.trackers = []
        self.wait_for_everyone()
