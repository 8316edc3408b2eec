"""The DeepSpeed settings that travel from a launch config to the ranks: names, checks, variables.

``LaunchConfig`` keeps ``deepspeed_*`` fields; this module validates them and turns them into
``NBACCEL_DEEPSPEED_*`` variables, which ``DeepSpeedPlugin()`` reads in each rank for a field
left unset (as Accelerate's plugin reads ``ACCELERATE_DEEPSPEED_*``). Kept in core so the
config, the command line and the plugin share one list.

>>> deepspeed_env({"deepspeed_zero_stage": 3, "deepspeed_offload_optimizer_device": "cpu"})
{'NBACCEL_DEEPSPEED_ZERO_STAGE': '3', 'NBACCEL_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE': 'cpu'}
"""

from __future__ import annotations

from typing import Any

from nbaccel.core.fsdp_settings import normalise  # one spelling of true/false

ZERO_STAGES = (0, 1, 2, 3)
OFFLOAD_DEVICES = ("none", "cpu", "nvme")

# field in LaunchConfig -> environment variable a rank reads
ENV = {
    "deepspeed_zero_stage": "NBACCEL_DEEPSPEED_ZERO_STAGE",
    "deepspeed_gradient_clipping": "NBACCEL_DEEPSPEED_GRADIENT_CLIPPING",
    "deepspeed_offload_optimizer_device": "NBACCEL_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE",
    "deepspeed_offload_param_device": "NBACCEL_DEEPSPEED_OFFLOAD_PARAM_DEVICE",
    "deepspeed_zero3_init_flag": "NBACCEL_DEEPSPEED_ZERO3_INIT",
    "deepspeed_zero3_save_16bit_model": "NBACCEL_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL",
    "deepspeed_config_file": "NBACCEL_DEEPSPEED_CONFIG_FILE",
}
DEFAULTS: dict[str, Any] = {
    "deepspeed_zero_stage": 2,
    "deepspeed_gradient_clipping": None,
    "deepspeed_offload_optimizer_device": "none",
    "deepspeed_offload_param_device": "none",
    "deepspeed_zero3_init_flag": False,
    "deepspeed_zero3_save_16bit_model": False,
    "deepspeed_config_file": None,
}


def zero_stage(value: Any) -> int:
    """A ZeRO stage 0-3 (strings of digits accepted, as from the environment)."""
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or value not in ZERO_STAGES:
        raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {value!r}.")
    return value


def offload_device(value: Any) -> str:
    """ "none", "cpu" or "nvme" (``None`` means "none")."""
    value = "none" if value is None else value
    if isinstance(value, str) and value.strip().lower() in OFFLOAD_DEVICES:
        return value.strip().lower()
    raise ValueError(f"offload device must be 'none', 'cpu' or 'nvme', got {value!r}.")


def clipping(value: Any) -> float | None:
    """A positive max gradient norm, or ``None`` (no clipping)."""
    if value is None or value == "" or value == "none":
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = -1.0
    if isinstance(value, bool) or number <= 0:
        raise ValueError(f"gradient_clipping must be a number > 0 (or None), got {value!r}.")
    return number


def check_fields(values: dict[str, Any]) -> dict[str, Any]:
    """The ``deepspeed_*`` fields of a config, normalised; raises ValueError naming the first
    bad one.

    Example::

        check_fields({"deepspeed_zero_stage": "3"})["deepspeed_zero_stage"]   # 3
    """
    checks = {
        "deepspeed_zero_stage": zero_stage,
        "deepspeed_gradient_clipping": clipping,
        "deepspeed_offload_optimizer_device": offload_device,
        "deepspeed_offload_param_device": offload_device,
    }
    flags = ("deepspeed_zero3_init_flag", "deepspeed_zero3_save_16bit_model")
    out = normalise(values, checks, flags)
    if out.get("deepspeed_config_file") == "":
        out["deepspeed_config_file"] = None
    return out


def deepspeed_env(values: dict[str, Any]) -> dict[str, str]:
    """``NBACCEL_DEEPSPEED_*`` variables for the fields that differ from the defaults.

    Example::

        deepspeed_env(cfg.to_dict())   # {} when every DeepSpeed field is at its default
    """
    env = {}
    for key, var in ENV.items():
        value = values.get(key, DEFAULTS[key])
        if value == DEFAULTS[key] or value is None:
            continue
        env[var] = str(value).lower() if isinstance(value, bool) else str(value)
    return env
