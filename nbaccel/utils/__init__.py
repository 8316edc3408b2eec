"""The names a training loop imports from ``accelerate.utils``, at ``nbaccel.utils``.

``from accelerate.utils import ProjectConfiguration, set_seed`` becomes
``from nbaccel.utils import ProjectConfiguration, set_seed``. Training-side only (rank code):
importing it never loads the kernel side. Names load on first use.

May import: core, rank, training (it re-exports training's names).

>>> from nbaccel.utils import ProjectConfiguration, gather
>>> ProjectConfiguration("runs/a").logging_dir
'runs/a'
"""

from __future__ import annotations

import importlib
from typing import Any

from nbaccel.training import availability  # only its table of names: it imports no package

_T = "nbaccel.training."
_LAZY = {
    **dict.fromkeys(
        [
            "AutocastKwargs",
            "DataLoaderConfiguration",
            "DDPCommunicationHookType",
            "DistributedDataParallelKwargs",
            "GradientAccumulationPlugin",
            "GradScalerKwargs",
            "InitProcessGroupKwargs",
            "KwargsHandler",
            "LoggerType",
            "PrecisionType",
            "ProfileKwargs",
            "ProjectConfiguration",
            "RNGType",
        ],
        _T + "kwargs_handlers",
    ),
    **dict.fromkeys(
        [
            "DistributedOperationException",
            "broadcast",
            "broadcast_object_list",
            "copy_tensor_to_devices",
            "gather",
            "gather_object",
            "pad_across_processes",
            "recursively_apply",
            "reduce",
            "send_to_device",
        ],
        _T + "ops",
    ),
    **dict.fromkeys(
        ["find_executable_batch_size", "release_memory", "should_reduce_batch_size"],
        _T + "memory",
    ),
    **dict.fromkeys(["set_seed", "synchronize_rng_states"], _T + "rng"),
    **dict.fromkeys(["load_checkpoint_in_model"], _T + "model_files"),
    **dict.fromkeys(["skip_first_batches"], _T + "data"),
    **dict.fromkeys(["FullyShardedDataParallelPlugin"], _T + "fsdp_plugin"),
    **dict.fromkeys(["merge_fsdp_weights", "save_fsdp_model"], _T + "fsdp_files"),
    **dict.fromkeys(["DeepSpeedPlugin"], _T + "deepspeed_plugin"),
    **dict.fromkeys(
        [
            "ParallelismConfig",
            "TorchTensorParallelConfig",
            "TorchContextParallelConfig",
            "DeepSpeedSequenceParallelConfig",
        ],
        _T + "parallelism_config",
    ),
    **dict.fromkeys(["DummyOptim", "DummyScheduler"], _T + "deepspeed_dummies"),
    **dict.fromkeys(["DistributedType"], _T + "distributed"),
    **dict.fromkeys(["PartialState", "AcceleratorState"], _T + "partial_state"),
    **dict.fromkeys(["GeneralTracker", "filter_trackers"], _T + "trackers"),
    **dict.fromkeys(["concatenate", "wait_for_everyone"], _T + "ops"),
    **dict.fromkeys(["extract_model_from_parallel"], _T + "strategies.ddp"),
    **dict.fromkeys(["patch_environment", "write_basic_config"], _T + "environment"),
    **dict.fromkeys(["save"], _T + "model_files"),
    **dict.fromkeys(["tqdm"], _T + "multiprocess_logging"),
    **dict.fromkeys(["convert_outputs_to_fp32", "convert_to_fp32"], _T + "precision"),
    **dict.fromkeys(availability.NAMES, _T + "availability"),
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module 'nbaccel.utils' has no attribute {name!r}")
    value = getattr(importlib.import_module(module_name), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
