"""How ``Accelerator(parallelism_config=...)`` starts: the config checked against the launch,
the ``DeviceMesh`` built, and the strategy that trains over it chosen.

A config given, or one the launch asked for (``ACCELERATE_USE_PARALLELISM_CONFIG=true`` with
``PARALLELISM_CONFIG_*`` sizes, set by a launch config or ``nbaccel launch
--parallelism-config-*``), is checked first: sizes that do not make the number of processes,
and context parallelism where torch cannot run it (CPU), are refused naming the values.

>>> from nbaccel.training.distributed import detect_state
>>> build(None, detect_state(cpu=True))
(None, None)
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from nbaccel.core.parallelism_settings import USE_ENV, context_parallel_problem
from nbaccel.training.distributed import ProcessState

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from nbaccel.training.fsdp_plugin import FullyShardedDataParallelPlugin
    from nbaccel.training.parallelism_config import ParallelismConfig
    from nbaccel.training.strategies import Strategy


def build(
    config: ParallelismConfig | None, process: ProcessState
) -> tuple[ParallelismConfig | None, DeviceMesh | None]:
    """The config in force (given, or from the launch's variables) and its mesh."""
    if config is None:
        if os.environ.get(USE_ENV, "false").lower() != "true":
            return None, None
        from nbaccel.training.parallelism_config import ParallelismConfig

        config = ParallelismConfig()
    problem = context_parallel_problem(config.size("cp"), process.device.type)
    if problem:
        raise NotImplementedError(f"{problem}.")
    has_dims = bool(config.active_mesh_dims)
    config._validate_accelerator(process.num_processes, process.is_main_process)
    # As Accelerate: a config with no dimension above 1 is plain data parallelism (its
    # dp_replicate_size becomes the world size) without a mesh.
    mesh = config.get_device_mesh(process.device.type) if has_dims else None
    return config, mesh


def strategy(
    config: ParallelismConfig,
    mesh: DeviceMesh,
    process: ProcessState,
    current: Strategy,
    fsdp_plugin: FullyShardedDataParallelPlugin | None,
) -> Strategy:
    """The strategy that trains over ``mesh``: ``current`` where the config is plain
    replication (DDP), else the mesh strategy (FSDP2 settings from ``current``'s plugin)."""
    if not (config.tp_enabled or config.dp_shard_enabled or config.cp_enabled):
        return current
    if current.name == "deepspeed":
        raise ValueError(
            "parallelism_config with DeepSpeed is not supported by nbaccel; use FSDP2 "
            "(dp_shard_size) with tensor parallelism instead of a deepspeed_plugin."
        )
    from nbaccel.training.strategies.mesh import MeshStrategy

    plugin = getattr(current, "plugin", None) or fsdp_plugin
    return MeshStrategy(process, config, mesh, plugin)
