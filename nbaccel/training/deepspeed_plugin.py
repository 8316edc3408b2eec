"""``DeepSpeedPlugin``: how DeepSpeed ZeRO trains a model, with Accelerate's field names.

A field left as ``None`` takes the launch's setting (``NBACCEL_DEEPSPEED_*``, written by
``LaunchConfig``/``nbaccel config``), else Accelerate's default (ZeRO stage 2, no offload).
``hf_ds_config`` (a dict or a JSON file) replaces the config built from the fields; its
``"auto"`` values are filled at ``prepare`` from the plugin and the prepared objects
(see :func:`fill_auto`).

Example::

    from nbaccel import Accelerator
    from nbaccel.training.deepspeed_plugin import DeepSpeedPlugin
    acc = Accelerator(deepspeed_plugin=DeepSpeedPlugin(zero_stage=3, gradient_clipping=1.0))
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import sys
import warnings
from typing import Any

from nbaccel.core import capabilities
from nbaccel.core import deepspeed_settings as settings

_FIELDS = {  # plugin field -> LaunchConfig field (and so NBACCEL_DEEPSPEED_* variable)
    "zero_stage": "deepspeed_zero_stage",
    "gradient_clipping": "deepspeed_gradient_clipping",
    "offload_optimizer_device": "deepspeed_offload_optimizer_device",
    "offload_param_device": "deepspeed_offload_param_device",
    "zero3_init_flag": "deepspeed_zero3_init_flag",
    "zero3_save_16bit_model": "deepspeed_zero3_save_16bit_model",
    "hf_ds_config": "deepspeed_config_file",
}


# DeepSpeed calls torch.distributed functions that torch 2.13 marks deprecated; the warnings
# repeat on every step and nobody but DeepSpeed can act on them.
_NOISE = r"`torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor)` is deprecated"


def import_deepspeed(cpu: bool) -> Any:
    """``import deepspeed`` set up for this process, or an ImportError that says how to install.

    Example::

        deepspeed = import_deepspeed(cpu=True)   # DS_ACCELERATOR=cpu unless already chosen
    """
    if cpu and "deepspeed" not in sys.modules:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # read once, when deepspeed is imported
    try:
        import deepspeed
        import deepspeed.ops
    except ImportError as exc:
        raise ImportError(
            f"strategy='deepspeed' needs the deepspeed package, which cannot be imported in "
            f"{sys.executable} ({exc}): {capabilities.DEEPSPEED_INSTALL}."
        ) from exc
    if cpu and os.environ.get("NBACCEL_DEEPSPEED_SHM_COMM", "") not in ("1", "true"):
        # Only inference_all_reduce uses this op; without it training needs no compiler. (A
        # DeepSpeed without this table just builds the op: slower, not wrong.)
        compatible = getattr(deepspeed.ops, "__compatible_ops__", None)
        if isinstance(compatible, dict):
            compatible["deepspeed_shm_comm"] = False
    warnings.filterwarnings("ignore", message=_NOISE, category=FutureWarning)
    return deepspeed


def join_process_group(deepspeed: Any, local_rank: int) -> None:
    """Let DeepSpeed's comm layer use this process's torch.distributed group (made by the
    Accelerator; a one-rank in-memory group when the kernel runs alone).

    Example::

        join_process_group(import_deepspeed(cpu=True), local_rank=0)
    """
    import torch.distributed as dist

    # DeepSpeed's engine insists on LOCAL_RANK, which a notebook kernel does not have.
    os.environ.setdefault("LOCAL_RANK", str(local_rank))
    if not dist.is_initialized():
        # An in-memory store: no port, no MPI discovery.
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    deepspeed.init_distributed(dist_backend=dist.get_backend())  # reuses the existing group


@dataclasses.dataclass
class DeepSpeedPlugin:
    """DeepSpeed settings, as Accelerate's ``DeepSpeedPlugin``.

    - ``zero_stage``: 0-3 (1 shards optimizer state, 2 also gradients, 3 also parameters).
    - ``gradient_accumulation_steps``: ``None`` takes the Accelerator's; a number wins over it.
    - ``gradient_clipping``: max gradient norm applied by the engine (``None``: no clipping).
    - ``offload_optimizer_device`` / ``offload_param_device``: "none", "cpu" or "nvme".
    - ``offload_optimizer_nvme_path`` / ``offload_param_nvme_path``: the folder "nvme" swaps
      to (ZeRO-3; checked with DeepSpeed's async_io op when the Accelerator is made:
      :mod:`nbaccel.training.nvme_offload`).
    - ``zero3_init_flag``: build models inside :meth:`zero3_init_context` sharded from the start.
    - ``zero3_save_16bit_model``: DeepSpeed's ``stage3_gather_16bit_weights_on_model_save``
      (``get_state_dict``/``save_model`` gather full weights under ZeRO-3 either way).
    - ``hf_ds_config``: a DeepSpeed config dict or JSON path used instead of the fields above.

    ``DeepSpeedPlugin(hf_ds_config="ds_config.json")`` reads a file ("auto" values are filled
    in at ``prepare``). The fields make the same config:

    >>> plugin = DeepSpeedPlugin(zero_stage=3, gradient_clipping=1.0)
    >>> config = plugin.deepspeed_config
    >>> config["zero_optimization"]["stage"], config["gradient_clipping"], config["train_batch_size"]
    (3, 1.0, 'auto')
    """

    hf_ds_config: Any = None
    gradient_accumulation_steps: int | str | None = None
    gradient_clipping: float | None = None
    zero_stage: int | None = None
    offload_optimizer_device: str | None = None
    offload_param_device: str | None = None
    zero3_init_flag: bool | None = None
    zero3_save_16bit_model: bool | None = None
    offload_optimizer_nvme_path: str | None = None
    offload_param_nvme_path: str | None = None

    def __post_init__(self) -> None:
        values = {}
        for field, key in _FIELDS.items():
            value = getattr(self, field)
            if value is None:
                env = os.environ.get(settings.ENV[key])
                value = env if env not in (None, "") else settings.DEFAULTS[key]
            values[key] = value
        checked = settings.check_fields(values)
        for field, key in _FIELDS.items():
            setattr(self, field, checked[key])
        steps = self.gradient_accumulation_steps
        if steps not in (None, "auto") and (
            isinstance(steps, bool) or not isinstance(steps, int) or steps < 1
        ):
            raise ValueError(f"gradient_accumulation_steps must be an integer >= 1, got {steps!r}.")
        self.deepspeed_config = self._base_config()

    def _base_config(self) -> dict[str, Any]:
        source = self.hf_ds_config
        if isinstance(source, (str, os.PathLike)):
            try:
                with open(source, encoding="utf-8") as f:
                    return json.load(f)
            except FileNotFoundError:
                raise FileNotFoundError(
                    f"hf_ds_config={str(source)!r}: no such DeepSpeed config file."
                ) from None
            except json.JSONDecodeError as exc:
                raise ValueError(f"hf_ds_config={str(source)!r} is not valid JSON: {exc}") from None
        if isinstance(source, dict):
            return copy.deepcopy(source)
        if source is not None:
            raise TypeError(
                f"hf_ds_config must be a dict or a JSON file path, got {type(source).__name__}."
            )
        zero: dict[str, Any] = {"stage": self.zero_stage}
        for section, device, path in (
            ("offload_optimizer", self.offload_optimizer_device, self.offload_optimizer_nvme_path),
            ("offload_param", self.offload_param_device, self.offload_param_nvme_path),
        ):
            if device != "none":
                zero[section] = {"device": device}
            if device == "nvme":
                zero[section]["nvme_path"] = path
        if self.zero_stage == 3:
            zero["stage3_gather_16bit_weights_on_model_save"] = self.zero3_save_16bit_model
        config = {
            "train_batch_size": "auto",
            "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto",
            "zero_optimization": zero,
            "steps_per_print": 2**31 - 1,  # DeepSpeed's own progress lines: off, as in Accelerate
        }
        if self.gradient_clipping is not None:
            config["gradient_clipping"] = self.gradient_clipping
        return config

    @property
    def zero_stage_in_config(self) -> int:
        """The ZeRO stage the engine will run (from ``hf_ds_config`` when one was given)."""
        return int(self.deepspeed_config.get("zero_optimization", {}).get("stage", 0))

    def zero3_init_context(self) -> Any:
        """``deepspeed.zero.Init`` when ``zero3_init_flag`` and ZeRO-3, else a no-op context:
        parameters of models built inside are partitioned at construction (big models).

        Example::

            with plugin.zero3_init_context():
                model = build_model()
        """
        import contextlib

        import torch

        from nbaccel.training.partial_state import AcceleratorState

        if not (self.zero3_init_flag and self.zero_stage_in_config == 3):
            return contextlib.nullcontext()
        deepspeed = import_deepspeed(cpu=not torch.cuda.is_available())
        state = AcceleratorState()  # the Accelerator made before the model knows the rest
        join_process_group(deepspeed, state.local_process_index)
        # zero.Init parses the whole config but only uses its ZeRO and dtype sections: fill
        # the batch "auto"s with placeholders and leave optimizer/scheduler to prepare().
        config = {k: v for k, v in self.deepspeed_config.items() if k not in _TRAINING_ONLY}
        config = fill_auto(
            config,
            micro_batch=1,
            accumulation_steps=1,
            world_size=state.num_processes,
            mixed_precision=state.mixed_precision,
            gradient_clipping=None,
        )
        return deepspeed.zero.Init(config_dict_or_path=config)


_TRAINING_ONLY = ("optimizer", "scheduler", "train_batch_size", "gradient_accumulation_steps")


def fill_auto(
    config: dict[str, Any],
    *,
    micro_batch: int | None,
    accumulation_steps: int,
    world_size: int,
    mixed_precision: str,
    gradient_clipping: float | None,
    optimizer: Any = None,
    scheduler: Any = None,
) -> dict[str, Any]:
    """A copy of ``config`` with its ``"auto"`` values filled and ``mixed_precision`` mapped to
    the ``bf16``/``fp16`` sections; raises ValueError naming any ``"auto"`` it cannot fill.

    Example::

        fill_auto({"train_micro_batch_size_per_gpu": "auto"}, micro_batch=8,
                  accumulation_steps=1, world_size=2, mixed_precision="bf16",
                  gradient_clipping=None)["bf16"]    # {'enabled': True}
    """
    out = copy.deepcopy(config)
    if out.get("train_micro_batch_size_per_gpu", "auto") == "auto":
        if micro_batch is None:
            raise ValueError(
                "the DeepSpeed config's train_micro_batch_size_per_gpu is 'auto' but no "
                "DataLoader was prepared to take it from: pass the DataLoader to the same "
                "prepare() call as the model, or set a number in the config."
            )
        out["train_micro_batch_size_per_gpu"] = micro_batch
    if out.get("gradient_accumulation_steps", "auto") == "auto":
        out["gradient_accumulation_steps"] = accumulation_steps
    if out.get("train_batch_size", "auto") == "auto":
        out["train_batch_size"] = (
            out["train_micro_batch_size_per_gpu"] * out["gradient_accumulation_steps"] * world_size
        )
    if out.get("gradient_clipping") == "auto":
        if gradient_clipping is None:
            del out["gradient_clipping"]
        else:
            out["gradient_clipping"] = gradient_clipping
    _fill_precision(out, mixed_precision)
    if optimizer is not None and "optimizer" in out:
        group = optimizer.param_groups[0]
        params = out["optimizer"].setdefault("params", {})
        for key in ("lr", "betas", "eps", "weight_decay", "momentum"):
            if params.get(key) == "auto" and key in group:
                value = group[key]
                params[key] = list(value) if isinstance(value, tuple) else float(value)
    schedule = out.get("scheduler", {}).get("params", {})
    if optimizer is not None and schedule.get("warmup_max_lr") == "auto":
        schedule["warmup_max_lr"] = float(optimizer.param_groups[0]["lr"])
    for key in ("warmup_num_steps", "total_num_steps"):  # from a DummyScheduler
        if schedule.get(key) == "auto" and getattr(scheduler, key, None) is not None:
            schedule[key] = int(getattr(scheduler, key))
    left = _autos(out)
    if left:
        raise ValueError(
            f"the DeepSpeed config still has 'auto' at {', '.join(left)}: nbaccel fills batch "
            "size, accumulation, clipping, precision, optimizer hyperparameters and "
            "warmup_max_lr; put numbers in the config for the rest."
        )
    return out


def _fill_precision(config: dict[str, Any], mixed_precision: str) -> None:
    if mixed_precision == "fp8":
        raise ValueError("mixed_precision='fp8' is not available with DeepSpeed; use 'bf16'.")
    for name in ("fp16", "bf16"):
        section = config.get(name)
        wanted = mixed_precision == name
        if section is None:
            if wanted:
                config[name] = {"enabled": True}
            continue
        enabled = section.get("enabled", "auto")
        if enabled == "auto":
            section["enabled"] = wanted
        elif enabled and not wanted and mixed_precision != "no":
            raise ValueError(
                f"the DeepSpeed config enables {name} but mixed_precision={mixed_precision!r}; "
                "make them agree (or set the config's value to 'auto')."
            )


def _autos(value: Any, path: str = "") -> list[str]:
    if value == "auto":
        return [path or "<root>"]
    if isinstance(value, dict):
        return [a for k, v in value.items() for a in _autos(v, f"{path}.{k}" if path else k)]
    return []
