"""What to tell someone whose config file has a key nbaccel does not know.

Two cases: a typo ("did you mean 'num_processes'?", by :mod:`difflib`), and a file written by
``accelerate config``, which nbaccel does not read: it is named as such, and the settings it
shares with nbaccel are offered as the equivalent ``nbaccel launch`` flags.

Example::

    >>> unknown_key_hint("num_proceses", ["num_processes", "strategy"])
    "did you mean 'num_processes'?"
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
from typing import Any

# Keys every file written by `accelerate config` has, and nbaccel's config never has.
ACCELERATE_ONLY_KEYS = frozenset(
    {
        "compute_environment",
        "distributed_type",
        "downcast_bf16",
        "main_training_function",
        "use_cpu",
        "gpu_ids",
        "same_network",
        "tpu_env",
        "tpu_use_cluster",
        "tpu_use_sudo",
        "enable_cpu_affinity",
        "fsdp_config",
        "deepspeed_config",
        "megatron_lm_config",
        "dynamo_config",
    }
)
# Accelerate settings with the same meaning in nbaccel (num_processes differs: see below).
SHARED_KEYS = (
    "num_processes",
    "mixed_precision",
    "num_machines",
    "machine_rank",
    "main_process_ip",
    "main_process_port",
    "rdzv_backend",
    "gradient_accumulation_steps",
)


def looks_like_accelerate(keys: Iterable[str]) -> bool:
    """Whether a config file with these top-level keys was written by ``accelerate config``."""
    return not ACCELERATE_ONLY_KEYS.isdisjoint(k for k in keys if isinstance(k, str))


def accelerate_flags(values: Mapping[str, Any]) -> list[str]:
    """The ``nbaccel launch`` flags that say what an Accelerate config's shared keys say.

    Accelerate's ``num_processes`` counts every machine's processes; nbaccel's is per machine.

    Example::

        >>> accelerate_flags({"num_processes": 4, "num_machines": 2, "mixed_precision": "bf16"})
        ['--num_processes', '2', '--mixed_precision', 'bf16', '--num_machines', '2']
    """
    flags: list[str] = []
    for key in SHARED_KEYS:
        value = values.get(key)
        if value is None or value == "":
            continue
        if key == "num_processes":
            machines = values.get("num_machines") or 1
            if isinstance(value, int) and isinstance(machines, int) and machines > 0:
                value = max(1, value // machines)
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            continue
        flags += [f"--{key}", str(value)]
    return flags


def accelerate_message(source: str, values: Mapping[str, Any]) -> str:
    """Why an Accelerate config file is refused, and the two ways on."""
    flags = " ".join(accelerate_flags(values))
    same = (
        f" Its settings that nbaccel shares, as flags: nbaccel launch {flags} SCRIPT."
        if flags
        else ""
    )
    return (
        f"{source} looks like a config file written by `accelerate config` "
        "(it has compute_environment/distributed_type keys); nbaccel does not read those. "
        "Write an nbaccel config with `nbaccel config` (or `nbaccel config --default`), "
        f"or pass the settings as flags.{same}"
    )


def unknown_key_hint(key: str, known: Iterable[str]) -> str:
    """One sentence after "unknown key 'x'": the closest known key, or the list of them."""
    names = sorted(known)
    close = difflib.get_close_matches(key, names, n=1, cutoff=0.6)
    if close:
        return f"did you mean {close[0]!r}?"
    return f"known keys are {', '.join(names)}."
