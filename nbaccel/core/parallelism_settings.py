"""The N-D parallelism sizes that travel from a launch to the ranks: names, order, checks.

A launch config (``parallelism_config_tp_size: 2``...), ``nbaccel launch
--parallelism-config-tp-size 2`` and ``ParallelismConfig()`` in a rank share this one list: the
sizes travel as Accelerate's ``PARALLELISM_CONFIG_*`` variables (with
``ACCELERATE_USE_PARALLELISM_CONFIG=true``), which ``ParallelismConfig()`` reads for a size left
unset, as Accelerate's does. Kept in core so the launch plan can refuse sizes that do not fit
the number of processes before any rank starts.

>>> parallelism_env({"parallelism_config_dp_shard_size": 2, "parallelism_config_tp_size": 2})
{'ACCELERATE_USE_PARALLELISM_CONFIG': 'true', 'PARALLELISM_CONFIG_DP_SHARD_SIZE': '2', 'PARALLELISM_CONFIG_TP_SIZE': '2'}
>>> describe({"dp_shard": 2, "tp": 2})
'dp_shard 2 × tp 2'
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from typing import Any

# The mesh's dimensions in Accelerate's order (outermost first): ranks next to each other
# share the inner dimensions, so a tensor-parallel group is made of neighbouring ranks.
MESH_ORDER = ("dp_replicate", "dp_shard", "cp", "sp", "tp")
DATA_PARALLEL = ("dp_replicate", "dp_shard")

# LaunchConfig field -> the variable a rank's ParallelismConfig() reads (Accelerate's names)
# (sequence parallelism, DeepSpeed's, does not run in nbaccel: no sp_size here)
ENV = {
    f"parallelism_config_{dim}_size": f"PARALLELISM_CONFIG_{dim.upper()}_SIZE"
    for dim in ("dp_replicate", "dp_shard", "tp", "cp")
}
USE_ENV = "ACCELERATE_USE_PARALLELISM_CONFIG"


def parallelism_env(fields: Mapping[str, Any]) -> dict[str, str]:
    """The variables for a launch's sizes (none when every size is 1)."""
    sizes = {ENV[k]: int(v) for k, v in fields.items() if k in ENV and v not in (None, 1)}
    return {USE_ENV: "true", **{k: str(v) for k, v in sizes.items()}} if sizes else {}


def sizes_of(fields: Mapping[str, Any]) -> dict[str, int]:
    """``{"dp_shard": 2, "tp": 2}`` from a launch's ``parallelism_config_*_size`` fields."""
    return {
        k[len("parallelism_config_") : -len("_size")]: int(v) for k, v in fields.items() if k in ENV
    }


def launch_description(fields: Mapping[str, Any]) -> str:
    """The banner's words for a launch's sizes ("" when it asks for no N-D parallelism).

    >>> launch_description({"parallelism_config_dp_shard_size": 2, "parallelism_config_tp_size": 2})
    'dp_shard 2 × tp 2'
    """
    sizes = sizes_of(fields)
    return describe(sizes) if any(v > 1 for v in sizes.values()) else ""


def describe(sizes: Mapping[str, int]) -> str:
    """``"dp_shard 2 × tp 2"``: the dimensions larger than 1, in mesh order."""
    parts = [f"{dim} {sizes[dim]}" for dim in MESH_ORDER if sizes.get(dim, 1) > 1]
    return " × ".join(parts) if parts else "dp 1"


def world_mismatch(sizes: Mapping[str, int], num_processes: int) -> str | None:
    """Why ``sizes`` do not fit ``num_processes`` ranks, with sizes that would; else None.

    >>> print(world_mismatch({"dp_shard": 3, "tp": 2}, 4))
    the parallelism sizes dp_shard 3 × tp 2 make 6 ranks, but the launch has 4 processes; with tp_size=2 use dp_shard_size=2 (or dp_replicate_size × dp_shard_size = 2), or launch 6 processes
    """
    total = math.prod(sizes.get(dim, 1) for dim in MESH_ORDER)
    if total == num_processes or total == 1:
        return None
    fixed = {d: s for d, s in sizes.items() if d not in DATA_PARALLEL and s > 1}
    inner = math.prod(fixed.values())
    given = " and ".join(f"{d}_size={s}" for d, s in fixed.items())
    if fixed and num_processes % inner == 0:
        fit = (
            f"with {given} use dp_shard_size={num_processes // inner} (or dp_replicate_size × "
            f"dp_shard_size = {num_processes // inner})"
        )
    elif fixed:
        fit = f"{given} must divide the number of processes ({num_processes})"
    else:
        fit = f"make dp_replicate_size × dp_shard_size = {num_processes}"
    return (
        f"the parallelism sizes {describe(sizes)} make {total} ranks, but the launch has "
        f"{num_processes} processes; {fit}, or launch {total} processes"
    )


def divisors(n: int) -> list[int]:
    """The sizes that split ``n`` evenly (what a ``tp_size`` could be for ``n`` heads)."""
    return [d for d in range(1, n + 1) if n % d == 0]


def coordinates(sizes: Mapping[str, int], rank: int) -> dict[str, int]:
    """Where ``rank`` sits in the mesh: its index along each dimension larger than 1.

    >>> coordinates({"dp_shard": 2, "tp": 2}, 3)
    {'dp_shard': 1, 'tp': 1}
    """
    dims = [(d, sizes.get(d, 1)) for d in MESH_ORDER if sizes.get(d, 1) > 1]
    grid = itertools.product(*(range(s) for _, s in dims))
    for index, point in enumerate(grid):
        if index == rank:
            return {d: p for (d, _), p in zip(dims, point)}
    return {}


def context_parallel_problem(cp_size: int, device_type: str) -> str | None:
    """Why ``cp_size`` cannot run on ``device_type`` devices (torch's context parallelism is
    ring attention on GPUs), else None.

    >>> context_parallel_problem(1, "cpu") is None
    True
    """
    if cp_size <= 1 or device_type == "cuda":
        return None
    return (
        f"cp_size={cp_size}: context parallelism splits each sequence over GPUs with torch's "
        "ring attention (scaled_dot_product_attention's flash and efficient kernels), which "
        f"does not run on {device_type!r} devices; use cp_size=1 here (or run it on GPUs)"
    )


def check_launch(fields: Mapping[str, Any], world_size: int, on_gpus: bool) -> None:
    """Refuse, before any rank starts, sizes that do not make ``world_size`` ranks and context
    parallelism without GPUs (a ValueError naming the values and what would fit).

    >>> check_launch({"parallelism_config_cp_size": 2}, 2, on_gpus=False)
    Traceback (most recent call last):
    ...
    ValueError: cp_size=2: context parallelism ... use cp_size=1 here (or run it on GPUs).
    """
    sizes = sizes_of(fields)
    problem = world_mismatch(sizes, world_size) or context_parallel_problem(
        sizes.get("cp", 1), "cuda" if on_gpus else "cpu"
    )
    if problem:
        raise ValueError(f"{problem}.")
