"""Putting a model's tensors where a device map says: one tensor at a time
(``set_module_tensor_to_device``), a checkpoint's files loaded by device map with the disk's
share written to an offload folder (``load_checkpoint_in_model(..., device_map=...)``), tied
parameters made one again after, and the check that a map's devices are on this machine.
Everything a load needs is checked before its first file is read or written.

>>> import torch
>>> layer = torch.nn.Linear(2, 2)
>>> set_module_tensor_to_device(layer, "weight", "meta")
>>> layer.weight.is_meta
True
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from nbaccel.training.device_map import (
    Device,
    _entry,
    check_device_map,
    find_tied_parameters,
    named_tensors,
)
from nbaccel.training.offload import check_offload_folder, offload_weight, save_offload_index


def set_module_tensor_to_device(
    module: nn.Module,
    tensor_name: str,
    device: Device,
    value: torch.Tensor | None = None,
    dtype: str | torch.dtype | None = None,
    fp16_statistics: torch.Tensor | None = None,
    tied_params_map: dict[int, dict[Any, torch.Tensor]] | None = None,
    non_blocking: bool = False,
    clear_cache: bool = True,
) -> None:
    """Put the parameter or buffer ``tensor_name`` of ``module`` on ``device``, with ``value``
    if given (cast to ``dtype``, floating point only; without ``dtype`` to the dtype the model
    has); parameters stay parameters of their class with their ``requires_grad``.
    ``tied_params_map`` and ``clear_cache`` are accepted for Accelerate's signature;
    ``fp16_statistics`` (bitsandbytes' 8-bit weights) is refused.

    >>> layer = torch.nn.Linear(2, 1)
    >>> set_module_tensor_to_device(layer, "bias", "cpu", value=torch.zeros(1))
    >>> layer.bias
    Parameter containing:
    tensor([0.], requires_grad=True)
    """
    if fp16_statistics is not None:
        raise ValueError(
            f"{tensor_name}: fp16_statistics are bitsandbytes' 8-bit weights, which nbaccel "
            "does not load; load the model in float16 or bfloat16 instead."
        )
    owner_name, _, name = tensor_name.rpartition(".")
    owner = module.get_submodule(owner_name)
    is_param = name in owner._parameters
    old = owner._parameters.get(name) if is_param else owner._buffers.get(name)
    if old is None and value is None:
        raise ValueError(f"{tensor_name} is not a parameter or buffer of {type(module).__name__}.")
    if old is not None and value is not None and old.shape != value.shape:
        raise ValueError(
            f"{tensor_name}: the checkpoint's tensor has shape {tuple(value.shape)}, the "
            f"model's {tuple(old.shape)}; load a checkpoint of this model."
        )
    new = value if value is not None else old
    assert new is not None
    dtype = getattr(torch, dtype.replace("torch.", "")) if isinstance(dtype, str) else dtype
    if dtype is None and old is not None and old.is_floating_point():
        dtype = old.dtype  # a value loads in the model's dtype, as a plain load_state_dict
    if dtype is not None and new.is_floating_point():
        new = new.to(dtype)
    if str(device) == "meta":
        new = torch.empty_like(new, device="meta")
    else:
        new = new.to(device, non_blocking=non_blocking)
    if is_param:
        kind = type(old) if isinstance(old, nn.Parameter) else nn.Parameter
        requires_grad = old.requires_grad if old is not None else new.is_floating_point()
        owner._parameters[name] = kind(new, requires_grad=requires_grad)
    else:
        owner._buffers[name] = new


def available(device: Any) -> bool:
    """Whether this machine has ``device`` (an index is an accelerator's, as in a device map)."""
    if device in ("cpu", "disk", "meta"):
        return True
    try:
        device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    except (RuntimeError, TypeError):
        return False
    if device.type == "cpu":
        return True
    if device.type == "cuda":
        return torch.cuda.is_available() and (device.index or 0) < torch.cuda.device_count()
    if device.type == "mps":
        return torch.backends.mps.is_available()
    return False


def refuse_missing_devices(device_map: Mapping[str, Any], what: str) -> None:
    missing = sorted({str(d) for d in device_map.values() if not available(d)})
    if missing:
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        here = f"accelerators 0-{count - 1}, 'cpu'" if count else "'cpu'"
        raise ValueError(
            f"{what}: the device map sends modules to {', '.join(missing)}, which this machine "
            f"does not have (it has {here} and 'disk'). Make the map here, e.g. "
            "infer_auto_device_map(model, max_memory={'cpu': '2GB'}), or name those devices."
        )


def load_into_device_map(
    model: nn.Module,
    states: Iterable[dict[str, torch.Tensor]],
    device_map: dict[str, Device],
    offload_folder: str | os.PathLike[str] | None,
    dtype: str | torch.dtype | None,
    offload_buffers: bool,
    keep_in_fp32_modules: list[str] | None,
    strict: bool,
) -> None:
    """Load ``states`` (a checkpoint's files, read one at a time) into ``model`` as
    ``device_map`` places it: tensors for ``"disk"`` are written to ``offload_folder`` (the
    model keeps a meta tensor), the others loaded onto their device, cast to ``dtype``.
    Everything is checked (the map, its devices, the folder's room for the model's disk
    tensors) before the first file is read. ``load_checkpoint_in_model(..., device_map=...)``
    calls it."""
    check_device_map(model, device_map)
    refuse_missing_devices(device_map, "load_checkpoint_in_model")
    dtype = getattr(torch, dtype.replace("torch.", "")) if isinstance(dtype, str) else dtype
    buffers = {n for n, _ in model.named_buffers()}
    model_tensors = dict(named_tensors(model, remove_duplicate=False))
    placement = {n: device_map[_entry(n, device_map) or ""] for n in model_tensors}
    to_disk = {
        n for n, d in placement.items() if d == "disk" and (offload_buffers or n not in buffers)
    }
    if to_disk:
        check_offload_folder(
            offload_folder,
            sum(_loaded_size(model_tensors[n], dtype) for n in to_disk),
            "load_checkpoint_in_model",
        )
    tied = find_tied_parameters(model)  # before loading replaces the parameters one by one
    index: dict[str, Any] = {}
    unexpected: list[str] = []
    for state in states:
        extra = sorted(set(state) - set(model_tensors))
        if extra and strict:
            raise RuntimeError(
                f"load_checkpoint_in_model(strict=True): the checkpoint has {extra}, which "
                f"{type(model).__name__} does not; load a checkpoint of this model, or pass "
                "strict=False."
            )
        unexpected += extra
        for name, value in state.items():
            if name not in placement:
                continue
            wanted = dtype
            if dtype == torch.float16 and any(
                name == k or f"{k}." in name for k in keep_in_fp32_modules or []
            ):
                wanted = torch.float32
            if name in to_disk:
                if wanted is not None and value.is_floating_point():
                    value = value.to(wanted)
                set_module_tensor_to_device(model, name, "meta", dtype=value.dtype)
                offload_weight(value, name, offload_folder, index=index)  # type: ignore[arg-type]
            else:
                device = placement[name]
                set_module_tensor_to_device(
                    model, name, "cpu" if device == "disk" else device, value=value, dtype=wanted
                )
    save_offload_index(index, offload_folder)  # type: ignore[arg-type]
    retie_parameters(model, tied)
    if unexpected:
        warnings.warn(
            f"The checkpoint holds weights {unexpected} that {type(model).__name__} does not "
            "have; they were not loaded.",
            stacklevel=3,
        )


def _loaded_size(tensor: torch.Tensor, dtype: torch.dtype | None) -> int:
    if dtype is not None and tensor.is_floating_point():
        return tensor.numel() * dtype.itemsize
    return tensor.numel() * tensor.element_size()


def retie_parameters(model: nn.Module, tied_params: list[list[str]]) -> None:
    """Make each group of names in ``tied_params`` one parameter again (the first that is not
    on the meta device), after loading replaced them one by one.

    >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    >>> retie_parameters(model, [["0.weight", "1.weight"]])
    >>> model[0].weight is model[1].weight
    True
    """
    for group in tied_params:
        params = [model.get_parameter(name) for name in group]
        kept = next((p for p in params if not p.is_meta), None)
        if kept is None:
            continue
        for name in group:
            owner, _, attr = name.rpartition(".")
            setattr(model.get_submodule(owner), attr, kept)
