"""The FSDP settings that travel from a launch config to the ranks: names, choices, checks.

``LaunchConfig`` keeps seven ``fsdp_*`` fields; this module validates them and turns them into
``NBACCEL_FSDP_*`` variables, which ``FullyShardedDataParallelPlugin()`` reads in each rank when
a field is left unset (as Accelerate's plugin reads ``FSDP_*``). Kept in core so the config, the
command line and the plugin share one list.

>>> fsdp_env({"fsdp_auto_wrap_policy": "size_based_wrap", "fsdp_min_num_params": 1000})
{'NBACCEL_FSDP_AUTO_WRAP_POLICY': 'size_based_wrap', 'NBACCEL_FSDP_MIN_NUM_PARAMS': '1000'}
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

AUTO_WRAP_CHOICES = ("no_wrap", "transformer_based_wrap", "size_based_wrap")
STATE_DICT_CHOICES = ("FULL_STATE_DICT", "SHARDED_STATE_DICT")

# field in LaunchConfig -> environment variable a rank reads
ENV = {
    "fsdp_auto_wrap_policy": "NBACCEL_FSDP_AUTO_WRAP_POLICY",
    "fsdp_transformer_cls_names_to_wrap": "NBACCEL_FSDP_TRANSFORMER_CLS_TO_WRAP",
    "fsdp_min_num_params": "NBACCEL_FSDP_MIN_NUM_PARAMS",
    "fsdp_cpu_offload": "NBACCEL_FSDP_CPU_OFFLOAD",
    "fsdp_reshard_after_forward": "NBACCEL_FSDP_RESHARD_AFTER_FORWARD",
    "fsdp_state_dict_type": "NBACCEL_FSDP_STATE_DICT_TYPE",
    "fsdp_activation_checkpointing": "NBACCEL_FSDP_ACTIVATION_CHECKPOINTING",
}
DEFAULTS: dict[str, Any] = {
    "fsdp_auto_wrap_policy": "no_wrap",
    "fsdp_transformer_cls_names_to_wrap": None,
    "fsdp_min_num_params": 0,
    "fsdp_cpu_offload": False,
    "fsdp_reshard_after_forward": True,
    "fsdp_state_dict_type": "FULL_STATE_DICT",
    "fsdp_activation_checkpointing": False,
}
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")


def parse_bool(name: str, value: Any) -> bool:
    """``True``/``False``, or a string such as "true", "0", "yes" (environment, command line)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
        return value.strip().lower() in _TRUE
    raise ValueError(f"{name} must be true or false, got {value!r}.")


def auto_wrap_choice(value: Any) -> str:
    """The canonical spelling of a wrap policy name (Accelerate writes them in upper case)."""
    if isinstance(value, str) and value.strip().lower() in AUTO_WRAP_CHOICES:
        return value.strip().lower()
    raise ValueError(
        f"auto_wrap_policy={value!r} is not known; choose one of "
        f"{', '.join(map(repr, AUTO_WRAP_CHOICES))} (or pass a callable to the plugin)."
    )


def state_dict_choice(value: Any) -> str:
    """ "FULL_STATE_DICT" or "SHARDED_STATE_DICT" (also from torch's ``StateDictType``)."""
    name = getattr(value, "name", value)
    if isinstance(name, str) and name.strip().upper() in STATE_DICT_CHOICES:
        return name.strip().upper()
    raise ValueError(
        f"state_dict_type={value!r} is not supported with FSDP2; choose "
        f"{' or '.join(map(repr, STATE_DICT_CHOICES))}."
    )


def class_names(value: Any) -> list[str] | None:
    """A list of class names from a list or a comma-separated string; ``None`` stays ``None``."""
    if value is None:
        return None
    if isinstance(value, str):
        value = value.split(",")
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise ValueError(
            f"transformer_cls_names_to_wrap must be class names (a list or 'A,B'), got {value!r}."
        )
    names = [v.strip() for v in value if v.strip()]
    return names or None


def min_params(value: Any) -> int:
    """A non-negative parameter count (strings of digits accepted)."""
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"min_num_params must be an integer >= 0, got {value!r}.")
    return value


def check_fields(values: dict[str, Any]) -> dict[str, Any]:
    """The ``fsdp_*`` fields of a config, normalised; raises ValueError naming the first bad one.

    Example::

        check_fields({"fsdp_state_dict_type": "sharded_state_dict"})["fsdp_state_dict_type"]
        # 'SHARDED_STATE_DICT'
    """
    checks = {
        "fsdp_auto_wrap_policy": auto_wrap_choice,
        "fsdp_transformer_cls_names_to_wrap": class_names,
        "fsdp_min_num_params": min_params,
        "fsdp_state_dict_type": state_dict_choice,
    }
    flags = ("fsdp_cpu_offload", "fsdp_reshard_after_forward", "fsdp_activation_checkpointing")
    return normalise(values, checks, flags)


def normalise(
    values: dict[str, Any], checks: Mapping[str, Callable[[Any], Any]], flags: tuple[str, ...]
) -> dict[str, Any]:
    """``values`` with each present key passed through its check (a ValueError is prefixed with
    the key) and each present flag read as true/false. Shared by the FSDP and DeepSpeed fields."""
    out = dict(values)
    for key, check in checks.items():
        if key in out:
            try:
                out[key] = check(out[key])
            except ValueError as exc:
                raise ValueError(f"{key}: {exc}") from None
    for key in flags:
        if key in out:
            out[key] = parse_bool(key, out[key])
    return out


def fsdp_env(values: dict[str, Any]) -> dict[str, str]:
    """``NBACCEL_FSDP_*`` variables for the ``fsdp_*`` fields present in ``values``."""
    env = {}
    for key, var in ENV.items():
        if key not in values:
            continue
        value = values[key]
        if value is None:
            value = ""
        elif isinstance(value, bool):
            value = "true" if value else "false"
        elif isinstance(value, (list, tuple)):
            value = ",".join(value)
        env[var] = str(value)
    return env
