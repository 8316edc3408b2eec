"""``FullyShardedDataParallelPlugin``: how FSDP2 shards a model, with Accelerate's field names.

A field left as ``None`` takes the launch's setting (``NBACCEL_FSDP_*``, written by
``LaunchConfig``/``nbaccel config``), else the default below. Values are normalised on creation,
so a wrong one fails at ``FullyShardedDataParallelPlugin(...)``, not mid-training.

Example::

    from nbaccel import Accelerator, FullyShardedDataParallelPlugin
    plugin = FullyShardedDataParallelPlugin(
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["Block"],
        cpu_offload=True,
        state_dict_type="SHARDED_STATE_DICT",
        activation_checkpointing=True,
        mixed_precision_policy={"param_dtype": "bf16", "reduce_dtype": "fp32"},
    )
    acc = Accelerator(fsdp_plugin=plugin)
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
import re
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

from nbaccel.core import fsdp_settings as settings

_DTYPES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}


def _env(field: str) -> str | None:
    value = os.environ.get(settings.ENV[field])
    return value if value not in (None, "") else None


def _dtype(key: str, value: Any) -> torch.dtype | None:
    if value is None or isinstance(value, torch.dtype):
        return value
    if isinstance(value, str) and value.lower() in _DTYPES:
        return _DTYPES[value.lower()]
    raise ValueError(
        f"mixed_precision_policy[{key!r}]={value!r}: use a torch dtype or one of "
        f"{', '.join(map(repr, _DTYPES))}."
    )


@dataclasses.dataclass
class FullyShardedDataParallelPlugin:
    """FSDP2 settings (Accelerate's ``FullyShardedDataParallelPlugin`` with ``fsdp_version=2``).

    - ``auto_wrap_policy``: which submodules get their own ``fully_shard`` before the root:
      ``"transformer_based_wrap"`` (instances of ``transformer_cls_names_to_wrap``, else of the
      model's ``_no_split_modules``), ``"size_based_wrap"`` (modules with more than
      ``min_num_params`` parameters), ``"no_wrap"``/``None`` (the root only), a callable
      ``policy(module) -> bool``, or torch's FSDP1 ``transformer_auto_wrap_policy`` /
      ``size_based_auto_wrap_policy`` (bare or in a ``functools.partial``).
    - ``cpu_offload``: ``True`` or a ``CPUOffloadPolicy`` keeps sharded parameters, gradients
      and optimizer state in CPU memory between uses.
    - ``reshard_after_forward``: free gathered parameters after forward (``True``, less memory)
      or keep them for backward (``False``, fewer all-gathers).
    - ``state_dict_type``: what ``save_state`` writes: ``"FULL_STATE_DICT"`` (one file per
      model, gathered) or ``"SHARDED_STATE_DICT"`` (torch.distributed.checkpoint folders, each
      rank writes its shard). ``get_state_dict``/``save_model`` always give full weights.
    - ``activation_checkpointing``: recompute the wrapped blocks' activations in backward.
    - ``mixed_precision_policy``: a ``MixedPrecisionPolicy``, a dict of ``param_dtype``/
      ``reduce_dtype``/``output_dtype`` (dtypes or "bf16"/"fp16"/"fp32"), or one of those
      strings for all three.
    - ``cpu_ram_efficient_loading``: only rank 0 keeps real weights; the others' copies become
      empty (meta) before sharding and receive rank 0's values by broadcast.
    - ``sync_module_states``: broadcast rank 0's parameters and buffers before sharding.

    >>> plugin = FullyShardedDataParallelPlugin(
    ...     auto_wrap_policy="size_based_wrap", min_num_params=1_000_000, mixed_precision_policy="bf16"
    ... )
    >>> plugin.fsdp_version, plugin.mixed_precision_policy.param_dtype
    (2, torch.bfloat16)
    """

    auto_wrap_policy: str | Callable[..., bool] | None = None
    transformer_cls_names_to_wrap: list[str] | str | None = None
    min_num_params: int | None = None
    cpu_offload: bool | OffloadPolicy | None = None
    reshard_after_forward: bool | int | None = None
    state_dict_type: str | Any | None = None
    activation_checkpointing: bool | None = None
    mixed_precision_policy: dict[str, Any] | str | MixedPrecisionPolicy | None = None
    cpu_ram_efficient_loading: bool | None = None
    sync_module_states: bool | None = None
    ignored_modules: list[torch.nn.Module] | str | None = None
    fsdp_version: int | None = None
    # FSDP1 settings Accelerate still accepts: sharding_strategy maps onto reshard_after_forward,
    # the others have no FSDP2 meaning and are ignored with a warning (as Accelerate does).
    sharding_strategy: str | Any | None = None
    backward_prefetch: Any = None
    forward_prefetch: bool | None = None
    use_orig_params: bool | None = None
    limit_all_gathers: bool | None = None
    # FSDP1's state dict configs (FullStateDictConfig, FullOptimStateDictConfig, ...): their
    # offload_to_cpu/rank0_only choose how full state dicts are gathered (state_dict_options).
    state_dict_config: Any = None
    optim_state_dict_config: Any = None

    def __post_init__(self) -> None:
        try:
            self._normalise()
        except ValueError as exc:
            raise ValueError(f"FullyShardedDataParallelPlugin: {exc}") from None

    def _normalise(self) -> None:
        if self.fsdp_version not in (None, 2):
            raise ValueError(
                f"fsdp_version={self.fsdp_version!r}: nbaccel shards with FSDP2 (fully_shard) "
                "only; drop the argument or pass fsdp_version=2."
            )
        self.fsdp_version = 2
        policy = self.auto_wrap_policy
        if policy is None:
            policy = _env("fsdp_auto_wrap_policy") or "no_wrap"
        self.auto_wrap_policy = policy if callable(policy) else settings.auto_wrap_choice(policy)
        names = self.transformer_cls_names_to_wrap
        if names is None:
            names = _env("fsdp_transformer_cls_names_to_wrap")
        self.transformer_cls_names_to_wrap = settings.class_names(names)
        # Each field as given, or its NBACCEL_* variable's text, before it is normalised.
        count: int | str | None = self.min_num_params
        if count is None:
            count = _env("fsdp_min_num_params") or 0
        self.min_num_params = settings.min_params(count)

        offload: OffloadPolicy | bool | str | None = self.cpu_offload
        if offload is None:
            offload = _env("fsdp_cpu_offload") or False
        if not isinstance(offload, OffloadPolicy):
            on = settings.parse_bool("cpu_offload", offload)
            offload = CPUOffloadPolicy() if on else OffloadPolicy()
        self.cpu_offload = offload

        reshard: bool | int | str | None = self.reshard_after_forward
        if reshard is None and self.sharding_strategy is not None:
            reshard = _reshard_for(self.sharding_strategy)
        if reshard is None:
            reshard = _env("fsdp_reshard_after_forward") or True
        if isinstance(reshard, int) and not isinstance(reshard, bool) and reshard < 1:
            raise ValueError(f"reshard_after_forward must be a bool or an int >= 1, got {reshard}")
        if not isinstance(reshard, int):
            reshard = settings.parse_bool("reshard_after_forward", reshard)
        self.reshard_after_forward = reshard

        kind = self.state_dict_type
        if kind is None:
            kind = _env("fsdp_state_dict_type") or "FULL_STATE_DICT"
        self.state_dict_type = settings.state_dict_choice(kind)

        for name in ("activation_checkpointing", "cpu_ram_efficient_loading", "sync_module_states"):
            value = getattr(self, name)
            if value is None:
                value = _env(f"fsdp_{name}") if f"fsdp_{name}" in settings.ENV else None
            setattr(self, name, settings.parse_bool(name, value or False))
        if self.cpu_ram_efficient_loading:
            self.sync_module_states = True  # as Accelerate: the others receive rank 0's weights
        self.mixed_precision_policy = self._mixed_precision(self.mixed_precision_policy)
        if not (
            self.ignored_modules is None or isinstance(self.ignored_modules, (str, list, tuple))
        ):
            raise ValueError("ignored_modules must be a list of modules or a regex of their names.")
        obsolete = ("backward_prefetch", "forward_prefetch", "use_orig_params", "limit_all_gathers")
        unused = [name for name in obsolete if getattr(self, name) not in (None, False)]
        if unused:
            warnings.warn(
                f"FullyShardedDataParallelPlugin: {', '.join(unused)} have no effect with FSDP2 "
                "(fully_shard) and are ignored.",
                stacklevel=4,
            )

    @staticmethod
    def _mixed_precision(value: Any) -> MixedPrecisionPolicy:
        if value is None or isinstance(value, MixedPrecisionPolicy):
            return value or MixedPrecisionPolicy()
        if isinstance(value, (str, torch.dtype)):
            dtype = _dtype("param_dtype", value)
            return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype, output_dtype=dtype)
        if isinstance(value, dict):
            known = {"param_dtype", "reduce_dtype", "output_dtype", "cast_forward_inputs"}
            unknown = set(value) - known
            if unknown:
                raise ValueError(
                    f"mixed_precision_policy has unknown keys {sorted(unknown)}; FSDP2 knows "
                    f"{sorted(known)} (buffer_dtype was FSDP1's)."
                )
            kwargs: dict[str, Any] = {
                k: _dtype(k, v) for k, v in value.items() if k != "cast_forward_inputs"
            }
            if "cast_forward_inputs" in value:
                kwargs["cast_forward_inputs"] = bool(value["cast_forward_inputs"])
            return MixedPrecisionPolicy(**kwargs)
        raise ValueError(
            f"mixed_precision_policy={value!r}: pass a dict of dtypes, 'bf16'/'fp16'/'fp32', or "
            "torch.distributed.fsdp.MixedPrecisionPolicy."
        )

    def ignored_params(self, model: torch.nn.Module) -> set[torch.nn.Parameter] | None:
        """Parameters of ``ignored_modules`` (modules, or a regex matched against module names):
        FSDP leaves them whole on every rank and does not synchronise their gradients.

        Example::

            FullyShardedDataParallelPlugin(ignored_modules=r"head").ignored_params(model)
        """
        ignored = self.ignored_modules
        if ignored is None:
            return None
        if isinstance(ignored, str):
            pattern = re.compile(ignored)
            ignored = [m for name, m in model.named_modules() if pattern.fullmatch(name)]
        return {p for m in ignored for p in m.parameters()}

    def state_dict_options(self, optimizer: bool = False) -> StateDictOptions:
        """How ``get_state_dict``/``save_state`` gather full state dicts: on every rank, or
        (``offload_to_cpu``/``rank0_only`` in ``state_dict_config``, resp.
        ``optim_state_dict_config``) on rank 0 only, in CPU memory, as FSDP2 does both at once.

        >>> from torch.distributed.fsdp import FullStateDictConfig
        >>> cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
        >>> FullyShardedDataParallelPlugin(state_dict_config=cfg).state_dict_options().cpu_offload
        True
        """
        config = self.optim_state_dict_config if optimizer else self.state_dict_config
        to_rank0 = any(_setting(config, name) for name in ("offload_to_cpu", "rank0_only"))
        return StateDictOptions(full_state_dict=True, cpu_offload=to_rank0)

    @property
    def offloads_to_cpu(self) -> bool:
        """Whether sharded parameters live in CPU memory between uses."""
        return isinstance(self.cpu_offload, CPUOffloadPolicy)

    def set_auto_wrap_policy(self, model: torch.nn.Module) -> None:
        """Resolve ``auto_wrap_policy`` for ``model`` now (Accelerate's method): it becomes
        the ``policy(module) -> bool`` that :meth:`wrap_policy` gives, or ``"no_wrap"``.

        Example::

            plugin.set_auto_wrap_policy(model)   # blocks by class, from model._no_split_modules
        """
        resolved = self.wrap_policy(model)
        self.auto_wrap_policy = resolved if resolved is not None else "no_wrap"

    def wrap_policy(self, model: torch.nn.Module) -> Callable[[torch.nn.Module], bool] | None:
        """``policy(module) -> bool`` for ``model``'s submodules, or ``None`` (root only).

        Example::

            policy = plugin.wrap_policy(model)
            blocks = [m for m in model.modules() if policy and policy(m)]
        """
        policy = self.auto_wrap_policy
        if callable(policy):
            return _from_callable(policy)
        if policy == "size_based_wrap":
            threshold = self.min_num_params or 0
            return lambda m: sum(p.numel() for p in m.parameters()) > threshold
        if policy == "transformer_based_wrap":
            names = settings.class_names(self.transformer_cls_names_to_wrap) or list(
                getattr(model, "_no_split_modules", None) or []
            )
            if not names:
                raise ValueError(
                    "auto_wrap_policy='transformer_based_wrap' needs transformer_cls_names_to_wrap"
                    " (class names of the model's blocks, e.g. ['GPT2Block']); this model has no "
                    "_no_split_modules to take them from."
                )
            return _by_class(model, names)
        return None


def _setting(config: Any, name: str) -> bool:
    """``config.name`` of an FSDP1 state dict config (or a dict), False when absent."""
    value = config.get(name) if isinstance(config, dict) else getattr(config, name, False)
    return bool(value)


def _reshard_for(strategy: Any) -> bool:
    """FSDP1's ``sharding_strategy`` in FSDP2 terms (FULL_SHARD: reshard after forward)."""
    name = str(getattr(strategy, "name", strategy)).upper()
    if name in ("FULL_SHARD", "1"):
        return True
    if name in ("SHARD_GRAD_OP", "2"):
        return False
    raise ValueError(
        f"sharding_strategy={strategy!r} has no FSDP2 equivalent here; use FULL_SHARD or "
        "SHARD_GRAD_OP (or reshard_after_forward=True/False), or strategy='ddp' for NO_SHARD."
    )


def _by_class(model: torch.nn.Module, names: list[str]) -> Callable[[torch.nn.Module], bool]:
    found = {type(m).__name__: type(m) for m in model.modules()}
    missing = [n for n in names if n not in found]
    if missing:
        present = ", ".join(sorted(found))
        raise ValueError(
            f"transformer_cls_names_to_wrap names {missing}, which the model does not contain; "
            f"its module classes are: {present}."
        )
    classes = tuple(found[n] for n in names)
    return lambda m: isinstance(m, classes)


def _from_callable(fn: Callable[..., Any]) -> Callable[[torch.nn.Module], bool]:
    """FSDP2-style ``fn(module)``, or FSDP1-style ``fn(module, recurse, nonwrapped_numel)``."""
    from torch.distributed.fsdp.wrap import (
        size_based_auto_wrap_policy,
        transformer_auto_wrap_policy,
    )

    base = fn.func if isinstance(fn, functools.partial) else fn
    keywords = fn.keywords if isinstance(fn, functools.partial) else {}
    if base is transformer_auto_wrap_policy:
        classes = tuple(keywords.get("transformer_layer_cls") or ())
        return lambda m: bool(classes) and isinstance(m, classes)
    if base is size_based_auto_wrap_policy:
        threshold = keywords.get("min_num_params", int(1e8))
        return lambda m: sum(p.numel() for p in m.parameters()) >= threshold
    try:
        required = [
            p
            for p in inspect.signature(fn).parameters.values()
            if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
    except (TypeError, ValueError):
        required = []
    if len(required) >= 3:  # torch's FSDP1 policy signature
        return lambda m: bool(fn(m, False, sum(p.numel() for p in m.parameters())))
    return lambda m: bool(fn(m))
