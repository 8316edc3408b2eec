"""The launch configuration: one dataclass, validated, read from and written to one YAML file.

The notebook config panel, ``notebook_launcher(config=...)`` and the ``nbaccel`` command line all
use this file, so a setting chosen once is the same everywhere.

>>> import tempfile
>>> folder = tempfile.TemporaryDirectory()
>>> cfg = LaunchConfig(num_processes=2, mixed_precision="bf16")
>>> cfg.save(f"{folder.name}/nbaccel.yaml")             # doctest: +ELLIPSIS
PosixPath(...)
>>> LaunchConfig.load(f"{folder.name}/nbaccel.yaml").mixed_precision
'bf16'
>>> folder.cleanup()
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import yaml

from nbaccel.core import (
    config_hints,
    deepspeed_settings,
    fsdp_settings,
    parallelism_settings,
    strategy_registry,
)
from nbaccel.core.atomic import atomic_write

MIXED_PRECISION_CHOICES = ("no", "fp16", "bf16", "fp8")
START_METHOD_CHOICES = ("auto", "forkserver", "spawn", "fork")
RDZV_BACKEND_CHOICES = ("static", "c10d")

# Environment variables through which the launchers hand settings to `Accelerator()` in the ranks.
ENV_MIXED_PRECISION = "NBACCEL_MIXED_PRECISION"
ENV_STRATEGY = "NBACCEL_STRATEGY"
ENV_GRADIENT_ACCUMULATION_STEPS = "NBACCEL_GRADIENT_ACCUMULATION_STEPS"
ENV_CONFIG_FILE = "NBACCEL_CONFIG_FILE"
# Set in every rank to the launcher that started it: "notebook" or "cli".
ENV_LAUNCHER = "NBACCEL_LAUNCHER"


# Accelerate (and transformers' Trainer, through it) runs distributed on CPU ranks only when told
# (`cpu=True` or this variable); otherwise each CPU rank is "process 0 of 1" and trains alone.
ENV_ACCELERATE_USE_CPU = "ACCELERATE_USE_CPU"
# Accelerate's Accelerator() and transformers' TrainingArguments take their default precision
# from this, as Accelerate's own launchers set it; without it they train in fp32 silently.
ENV_ACCELERATE_MIXED_PRECISION = "ACCELERATE_MIXED_PRECISION"


def third_party_env(device: str, mixed_precision: str = "no") -> dict[str, str]:
    """What other libraries in the ranks read to see the launch as nbaccel runs it: on CPU
    ranks, Accelerate's ``ACCELERATE_USE_CPU``; a launch's precision other than "no", as
    Accelerate's ``ACCELERATE_MIXED_PRECISION``.

    >>> third_party_env("cpu"), third_party_env("cuda", "bf16")
    ({'ACCELERATE_USE_CPU': 'true'}, {'ACCELERATE_MIXED_PRECISION': 'bf16'})
    """
    env = {ENV_ACCELERATE_USE_CPU: "true"} if device == "cpu" else {}
    if mixed_precision != "no":
        env[ENV_ACCELERATE_MIXED_PRECISION] = mixed_precision
    return env


class ConfigError(ValueError):
    """A configuration value or file is wrong; the message says where and what to do.

    >>> try:
    ...     LaunchConfig(mixed_precision="fp32")
    ... except ConfigError as error:
    ...     print(error)
    mixed_precision='fp32' is not supported; choose one of 'no', 'fp16', 'bf16', 'fp8'.
    """


class ConfigTypeError(ConfigError, TypeError):
    """A setting has the wrong type (a string where a number belongs, say)."""


def default_config_path() -> Path:
    """Where the shared config file lives: ``$NBACCEL_CONFIG_FILE``, else the user config dir."""
    explicit = os.environ.get(ENV_CONFIG_FILE)
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config"
    return Path(base) / "nbaccel" / "default_config.yaml"


def check_choice(name: str, value: Any, choices: tuple[str, ...]) -> str:
    """Return ``value`` if it is one of ``choices``, else raise an error that lists them."""
    if value not in choices:
        listed = ", ".join(repr(c) for c in choices)
        raise ConfigError(f"{name}={value!r} is not supported; choose one of {listed}.")
    return value


def normalize_mixed_precision(value: str | None) -> str:
    """``None`` and ``"no"`` mean full precision; anything else must be a known choice."""
    if value is None:
        return "no"
    if value is False:  # YAML reads an unquoted `no` as false
        raise ConfigError(
            "mixed_precision must be a string, got false: YAML reads an unquoted no as false; "
            "write mixed_precision: 'no' (quoted)."
        )
    if not isinstance(value, str):
        raise ConfigError(
            f"mixed_precision must be a string, got {type(value).__name__}; "
            f"choose one of {', '.join(map(repr, MIXED_PRECISION_CHOICES))}."
        )
    return check_choice("mixed_precision", value.lower(), MIXED_PRECISION_CHOICES)


def check_int(name: str, value: Any, minimum: int) -> int:
    """Return ``value`` if it is an integer of at least ``minimum``, else raise an error that
    names the setting (a TypeError for a non-integer, a ValueError below the minimum)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigTypeError(f"{name} must be an integer, got {value!r}.")
    if value < minimum:
        raise ConfigError(f"{name} must be at least {minimum}, got {value}.")
    return value


@dataclasses.dataclass
class LaunchConfig:
    """How to launch: processes, machines, precision, strategy.

    ``num_processes`` is per machine; ``None`` means "every visible GPU, else 1".
    ``main_process_port=None`` picks a free port on single-machine launches.

    ``nbaccel.notebook_launcher(train, config=cfg)`` launches with it; saved (``cfg.save()``,
    the shared default file unless a path is given), ``nbaccel launch`` reads it too.

    >>> import tempfile, pathlib
    >>> cfg = LaunchConfig(num_processes=2, mixed_precision="bf16", strategy="fsdp")
    >>> with tempfile.TemporaryDirectory() as folder:
    ...     path = cfg.save(pathlib.Path(folder) / "nbaccel.yaml")
    ...     LaunchConfig.load(path) == cfg
    True
    >>> cfg.replace(num_processes=4).num_processes
    4
    """

    num_processes: int | None = None
    mixed_precision: str = "no"
    strategy: str = strategy_registry.DEFAULT
    gradient_accumulation_steps: int = 1
    num_machines: int = 1
    machine_rank: int = 0
    main_process_ip: str = "127.0.0.1"
    main_process_port: int | None = None
    rdzv_backend: str = "static"
    max_restarts: int = 0
    start_method: str = "auto"
    # FSDP (strategy="fsdp"): FullyShardedDataParallelPlugin's fields, see core/fsdp_settings.py
    fsdp_auto_wrap_policy: str = "no_wrap"
    fsdp_transformer_cls_names_to_wrap: list[str] | None = None
    fsdp_min_num_params: int = 0
    fsdp_cpu_offload: bool = False
    fsdp_reshard_after_forward: bool = True
    fsdp_state_dict_type: str = "FULL_STATE_DICT"
    fsdp_activation_checkpointing: bool = False
    # DeepSpeed (strategy="deepspeed"): DeepSpeedPlugin's fields, see core/deepspeed_settings.py
    deepspeed_zero_stage: int = 2
    deepspeed_gradient_clipping: float | None = None
    deepspeed_offload_optimizer_device: str = "none"
    deepspeed_offload_param_device: str = "none"
    deepspeed_zero3_init_flag: bool = False
    deepspeed_zero3_save_16bit_model: bool = False
    deepspeed_config_file: str | None = None
    # N-D parallelism: ParallelismConfig's sizes, see core/parallelism_settings.py
    parallelism_config_dp_replicate_size: int = 1
    parallelism_config_dp_shard_size: int = 1
    parallelism_config_tp_size: int = 1
    parallelism_config_cp_size: int = 1

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> LaunchConfig:
        """Raise :class:`ConfigError` naming the first bad field; return self otherwise."""
        if self.num_processes is not None:
            check_int("num_processes", self.num_processes, 1)
        self.mixed_precision = normalize_mixed_precision(self.mixed_precision)
        check_choice("strategy", self.strategy, strategy_registry.names())
        check_choice("rdzv_backend", self.rdzv_backend, RDZV_BACKEND_CHOICES)
        check_choice("start_method", self.start_method, START_METHOD_CHOICES)
        check_int("gradient_accumulation_steps", self.gradient_accumulation_steps, 1)
        check_int("num_machines", self.num_machines, 1)
        check_int("machine_rank", self.machine_rank, 0)
        check_int("max_restarts", self.max_restarts, 0)
        if self.machine_rank >= self.num_machines:
            raise ConfigError(
                f"machine_rank={self.machine_rank} must be below num_machines={self.num_machines}."
            )
        if self.main_process_port is not None:
            check_int("main_process_port", self.main_process_port, 1)
            if self.main_process_port > 65535:
                raise ConfigError(f"main_process_port={self.main_process_port} is not a port.")
        try:
            fsdp = fsdp_settings.check_fields({k: getattr(self, k) for k in fsdp_settings.ENV})
            fsdp.update(
                deepspeed_settings.check_fields(
                    {k: getattr(self, k) for k in deepspeed_settings.ENV}
                )
            )
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        self.__dict__.update(fsdp)
        for name in parallelism_settings.ENV:
            check_int(name, getattr(self, name), 1)
        sizes = parallelism_settings.sizes_of(self.to_dict())
        world = (self.num_processes or 0) * self.num_machines
        problem = world and parallelism_settings.world_mismatch(sizes, world)
        if problem:
            raise ConfigError(f"{problem}.")
        if not isinstance(self.main_process_ip, str) or not self.main_process_ip:
            raise ConfigError(
                f"main_process_ip must be a host name or address, got {self.main_process_ip!r}."
            )
        return self

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self, **changes: Any) -> LaunchConfig:
        """A copy with ``changes`` applied (``None`` values are ignored), validated."""
        return dataclasses.replace(self, **{k: v for k, v in changes.items() if v is not None})

    def worker_env(self) -> dict[str, str]:
        """The variables through which ranks' ``Accelerator()`` learns these settings."""
        return {
            ENV_MIXED_PRECISION: self.mixed_precision,
            ENV_STRATEGY: self.strategy,
            ENV_GRADIENT_ACCUMULATION_STEPS: str(self.gradient_accumulation_steps),
            **fsdp_settings.fsdp_env(self.to_dict()),
            **deepspeed_settings.deepspeed_env(self.to_dict()),
            **parallelism_settings.parallelism_env(self.to_dict()),
        }

    # -- YAML -------------------------------------------------------------------------------

    def to_yaml(self) -> str:
        header = "# nbaccel launch configuration (read by notebook_launcher and `nbaccel launch`)\n"
        return header + yaml.safe_dump(self.to_dict(), sort_keys=False)

    def save(self, path: str | os.PathLike[str] | None = None) -> Path:
        """Write the config as YAML, atomically: a crash never leaves a half-written file."""
        target = Path(path) if path is not None else default_config_path()
        with atomic_write(target, "w", encoding="utf-8") as f:
            f.write(self.to_yaml())
        return target

    @classmethod
    def from_yaml(cls, text: str, source: str = "<string>") -> LaunchConfig:
        """Parse YAML text; errors name ``source``, the line and the key."""
        try:
            root = yaml.compose(text, Loader=yaml.SafeLoader)
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f"{source}, line {mark.line + 1}" if mark else source
            problem = getattr(exc, "problem", None) or str(exc)
            raise ConfigError(f"{where}: not valid YAML ({problem}).") from None
        if root is None:
            return cls()
        if not isinstance(root, yaml.MappingNode):
            raise ConfigError(
                f"{source}, line {root.start_mark.line + 1}: expected 'key: value' lines."
            )
        known = {f.name for f in dataclasses.fields(cls)}
        if config_hints.looks_like_accelerate(k.value for k, _ in root.value):
            raise ConfigError(config_hints.accelerate_message(source, yaml.safe_load(text)))
        values: dict[str, Any] = {}
        lines: dict[str, int] = {}
        for key_node, value_node in root.value:
            key = key_node.value
            line = key_node.start_mark.line + 1
            if not isinstance(key_node, yaml.ScalarNode):
                raise ConfigError(f"{source}, line {line}: a key must be a name, like 'strategy'.")
            if key in values:
                raise ConfigError(
                    f"{source}, line {line}: {key!r} is given twice (also on line "
                    f"{lines[key]}); keep one."
                )
            if key not in known:
                raise ConfigError(
                    f"{source}, line {line}: unknown key {key!r}; "
                    + config_hints.unknown_key_hint(str(key), known)
                )
            values[key] = yaml.safe_load(yaml.serialize(value_node))
            lines[key] = line
        try:
            return cls(**values)
        except ConfigError as exc:
            bad = next((k for k in values if str(exc).startswith(k)), None)
            where = f"{source}, line {lines[bad]}, key {bad!r}" if bad else source
            raise ConfigError(f"{where}: {exc}") from None

    @classmethod
    def load(cls, path: str | os.PathLike[str] | None = None) -> LaunchConfig:
        """Read a config file (default: :func:`default_config_path`)."""
        target = Path(path) if path is not None else default_config_path()
        try:
            text = target.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise ConfigError(
                f"no config file at {target}; create one with `nbaccel config` or "
                "`nbaccel.configure()`."
            ) from None
        except IsADirectoryError:
            raise ConfigError(f"{target} is a folder, not a config file.") from None
        except UnicodeDecodeError:
            raise ConfigError(
                f"{target} is not a text (UTF-8) file, so not a config file."
            ) from None
        except OSError as exc:
            raise ConfigError(f"cannot read the config file {target}: {exc.strerror}.") from None
        return cls.from_yaml(text, source=str(target))

    @classmethod
    def load_default(cls) -> LaunchConfig | None:
        """The saved default config, or ``None`` when there is none."""
        path = default_config_path()
        return cls.load(path) if path.is_file() else None
