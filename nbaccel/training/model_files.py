"""Model weight files in Hugging Face's layout: ``model.safetensors`` (or
``pytorch_model.bin``), split into shards with a JSON index when larger than ``max_shard_size``,
tied tensors stored once, and loading them back into a model; ``save`` writes any object on
the main process only (Accelerate's ``accelerate.utils.save``).

>>> import torch, tempfile
>>> folder = tempfile.mkdtemp()
>>> save_model_files({"w": torch.ones(2)}, folder)
>>> m = torch.nn.Module(); m.w = torch.nn.Parameter(torch.zeros(2))
>>> load_checkpoint_in_model(m, folder); m.w.data
tensor([1., 1.])
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import torch

from nbaccel.core.atomic import atomic_write
from nbaccel.core.disk_space import OutOfSpaceError, swap_failed
from nbaccel.training import model_folder
from nbaccel.training.distributed import env_int
from nbaccel.training.file_reading import safetensors_load, torch_load
from nbaccel.training.torch_files import atomic_save

SAFE_WEIGHTS_NAME, WEIGHTS_NAME = "model.safetensors", "pytorch_model.bin"
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS |= {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_ALIASES = "nbaccel_tied"  # safetensors metadata: {name: the stored name it is the same as}


def parse_size(size: int | str) -> int:
    """Bytes in ``size`` ("10GB", "200MiB" or an int).

    Example::

        parse_size("200MB")   # 200_000_000
    """
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*([\d.]+)\s*([KMGT]?I?B)\s*", size.upper())
    if not match:
        raise ValueError(f"max_shard_size={size!r} is not a size; write e.g. '500MB' or '2GB'.")
    return int(float(match.group(1)) * _UNITS[match.group(2)])


def save_safetensors(
    state: dict[str, torch.Tensor],
    path: str | os.PathLike[str],
    aliases: dict[str, str] | None = None,
) -> None:
    """Write a state dict as one safetensors file, atomically. Tensors that share memory are
    stored as copies (safetensors refuses them); ``aliases`` (name -> the stored name it is the
    same tensor as) go into the file's metadata instead, for :func:`load_state_dict_files`."""
    from safetensors.torch import save

    seen: set[int] = set()
    clean = {}
    for key, tensor in state.items():
        tensor = tensor.detach().cpu()
        ptr = tensor.untyped_storage().data_ptr() if tensor.numel() else -id(tensor)
        clean[key] = tensor.clone().contiguous() if ptr in seen else tensor.contiguous()
        seen.add(ptr)
    metadata = {"format": "pt"}
    if aliases:
        metadata[_ALIASES] = json.dumps(aliases)
    blob = save(clean, metadata=metadata)
    with atomic_write(path, "wb", size_hint=len(blob)) as f:
        f.write(blob)


def split_tied(state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """The state without the second and later names of one tensor (tied weights, e.g.
    ``lm_head.weight is embed.weight``), and those names mapped to the one kept.

    Example::

        tensors, aliases = split_tied(model.state_dict())   # {'lm_head.weight': 'embed.weight'}
    """
    kept: dict[tuple, str] = {}
    tensors, aliases = {}, {}
    for key, tensor in state.items():
        if not isinstance(tensor, torch.Tensor) or tensor.layout is not torch.strided:
            tensors[key] = tensor  # not one block of memory (sparse): never an alias
            continue
        same = (tensor.device, tensor.data_ptr(), tensor.dtype, tensor.shape, tensor.stride())
        if tensor.numel() and tensor.device.type != "meta" and same in kept:
            aliases[key] = kept[same]
            continue
        kept.setdefault(same, key)
        tensors[key] = tensor
    return tensors, aliases


def save_model_files(
    state: dict[str, Any],
    save_directory: str | os.PathLike[str],
    max_shard_size: int | str = "10GB",
    safe_serialization: bool = True,
) -> None:
    """Write ``state`` into ``save_directory`` as one file or size-limited shards + index,
    replacing an earlier save's weight files all at once (``model_folder``); tied tensors are
    stored once. Other files in the folder stay.

    Example::

        save_model_files(model.state_dict(), "out/", max_shard_size="1GB")
    """
    folder = Path(save_directory)
    if folder.is_file():
        raise ValueError(f"save_model: {folder} is a file; pass a folder to write into.")
    folder.mkdir(parents=True, exist_ok=True)
    tensors, aliases = split_tied(state)
    shards = _shards(tensors, parse_size(max_shard_size))
    name = SAFE_WEIGHTS_NAME if safe_serialization else WEIGHTS_NAME
    stem, ext = name.rsplit(".", 1)
    names = (
        [name]
        if len(shards) == 1
        else [f"{stem}-{i + 1:05d}-of-{len(shards):05d}.{ext}" for i in range(len(shards))]
    )
    total = sum(_stored_size(t) for t in tensors.values())
    staging = model_folder.stage(folder)
    try:
        for shard, filename in zip(shards, names):
            tied = {a: k for a, k in aliases.items() if k in shard}  # kept with their tensor
            if safe_serialization:
                save_safetensors(shard, staging / filename, tied)
            else:  # torch.save stores a tensor shared by two names once
                cpu = {k: v.detach().cpu() for k, v in shard.items()}
                atomic_save(cpu | {a: cpu[k] for a, k in tied.items()}, staging / filename)
        if len(shards) > 1:
            where = {k: f for shard, f in zip(shards, names) for k in shard}
            if not safe_serialization:  # a .bin shard holds the tied names too
                where |= {alias: where[key] for alias, key in aliases.items()}
            index = {"metadata": {"total_size": total}, "weight_map": where}
            names.append(f"{name}.index.json")
            with atomic_write(staging / names[-1], "w") as f:
                f.write(json.dumps(index, indent=2, sort_keys=True) + "\n")
    except BaseException as exc:
        model_folder.discard(folder)
        if isinstance(exc, OutOfSpaceError):
            raise swap_failed("save_model", folder, total) from exc
        raise
    model_folder.commit(folder, names)


def _stored_size(tensor: Any) -> int:
    """Bytes a tensor takes in a weight file, as Hugging Face's shard split counts them (its
    storage's size)."""
    try:
        return int(tensor.untyped_storage().nbytes())
    except (AttributeError, RuntimeError, NotImplementedError):
        return tensor.numel() * tensor.element_size()


def _shards(tensors: dict[str, Any], limit: int) -> list[dict[str, Any]]:
    """``tensors`` cut into shards of at most ``limit`` bytes, in order, as Hugging Face's
    ``split_torch_state_dict_into_shards`` (and so Accelerate's ``save_model``) cuts them: a
    tensor larger than the limit becomes a shard of its own at once, while the shard being
    filled goes on filling with the smaller tensors after it.

    >>> sizes = {"a": 4, "big": 20, "b": 4, "c": 4}
    >>> [list(s) for s in _shards({k: torch.zeros(n, dtype=torch.uint8) for k, n in sizes.items()}, 10)]
    [['big'], ['a', 'b'], ['c']]
    """
    done: list[dict[str, Any]] = []
    filling: dict[str, Any] = {}
    size = 0
    for key, tensor in tensors.items():
        nbytes = _stored_size(tensor)
        if nbytes > limit:
            done.append({key: tensor})
            continue
        if size + nbytes > limit:
            done.append(filling)
            filling, size = {}, 0
        filling[key] = tensor
        size += nbytes
    return [*done, filling] if filling or not done else done


def load_state_dict_files(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """The state dict in a file, a shard index, or a ``save_model`` folder (single file or
    sharded), tied names restored as the same tensor.

    Example::

        state = load_state_dict_files("out/")
    """
    path = Path(path)
    files = [path]
    if path.name.endswith(".index.json"):  # the index itself, as Accelerate also takes it
        files = [path.parent / f for f in _shard_names(path)]
    elif path.is_dir():
        current = model_folder.current_files(path)
        for name in (SAFE_WEIGHTS_NAME, WEIGHTS_NAME):
            if f"{name}.index.json" in current:
                shards = _shard_names(current[f"{name}.index.json"])
                files = [current.get(f, path / f) for f in shards]
                break
            if name in current:
                files = [current[name]]
                break
        else:
            raise FileNotFoundError(
                f"{path} holds no {SAFE_WEIGHTS_NAME} or {WEIGHTS_NAME} (or their index); "
                "pass the folder given to accelerator.save_model()."
            )
    state: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    for file in files:
        if file.suffix == ".safetensors":
            tensors, metadata = safetensors_load(file)
            state.update(tensors)
            aliases.update(json.loads(metadata.get(_ALIASES, "{}")))
        else:
            state.update(torch_load(file))
    state.update({alias: state[kept] for alias, kept in aliases.items() if kept in state})
    return state


def _shard_names(index: Path) -> list[str]:
    """The shard files a ``*.index.json`` names, each once, in order."""
    return list(dict.fromkeys(json.loads(index.read_text())["weight_map"].values()))


def _fill_tied(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Give each name of a tensor the model ties (one parameter under two names) the value
    saved under another of its names: files from Accelerate or safetensors store it once,
    without saying so."""
    names: dict[int, list[str]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        names.setdefault(id(tensor), []).append(name)
    for group in names.values():
        saved = next((n for n in group if n in state), None)
        if saved is not None:
            for name in group:
                state.setdefault(name, state[saved])


def load_checkpoint_in_model(
    model: torch.nn.Module,
    checkpoint: str | os.PathLike[str],
    device_map: Any = None,
    offload_folder: Any = None,
    dtype: str | torch.dtype | None = None,
    offload_state_dict: bool = False,
    offload_buffers: bool = False,
    keep_in_fp32_modules: list[str] | None = None,
    offload_8bit_bnb: bool = False,
    strict: bool = False,
    full_state_dict: bool = True,
    broadcast_from_rank0: bool = False,
) -> None:
    """Load a file or ``save_model`` folder into ``model`` (Accelerate's name and parameters).
    ``dtype`` is accepted and, as in Accelerate 1.15 without a ``device_map``, changes nothing:
    the weights are loaded exactly (cast the model yourself: ``model.to(torch.bfloat16)``).
    Big-model loading (``device_map``, offloading, 8-bit, sharded state dicts) is refused with
    the reason.

    >>> import tempfile, nbaccel
    >>> accelerator = nbaccel.Accelerator(cpu=True)
    >>> torch.manual_seed(0) and None
    >>> saved, fresh = torch.nn.Linear(4, 2), torch.nn.Linear(4, 2)
    >>> with tempfile.TemporaryDirectory() as folder:
    ...     accelerator.save_model(saved, folder)  # the folder holds model.safetensors
    ...     load_checkpoint_in_model(fresh, folder, dtype=torch.bfloat16)
    >>> fresh.weight.dtype, torch.equal(fresh.weight, saved.weight)  # as Accelerate's
    (torch.float32, True)
    """
    big_model = {
        "device_map": device_map is not None,
        "offload_folder": offload_folder is not None,
        "offload_state_dict": offload_state_dict,
        "offload_buffers": offload_buffers,
        "keep_in_fp32_modules": bool(keep_in_fp32_modules),
        "offload_8bit_bnb": offload_8bit_bnb,
        "full_state_dict": not full_state_dict,
        "broadcast_from_rank0": broadcast_from_rank0,
    }
    if used := [name for name, given in big_model.items() if given]:
        raise ValueError(
            f"load_checkpoint_in_model: {', '.join(used)} (big-model loading) is not supported "
            "by nbaccel; it loads the whole state dict into the model. Load on the CPU and move "
            "the model, or shard it with FSDP after loading."
        )
    state = load_state_dict_files(checkpoint)
    _fill_tied(model, state)
    model.load_state_dict(state, strict=strict)


def save(
    obj: Any,
    f: str | os.PathLike[str],
    save_on_each_node: bool = False,
    safe_serialization: bool = False,
) -> None:
    """``torch.save`` (or safetensors with ``safe_serialization``) on the main process only
    (the main process of each machine with ``save_on_each_node``), written atomically.

    Example::

        save(model.state_dict(), "out/model.pt")     # rank 0 writes; the others skip
    """
    if env_int("LOCAL_RANK" if save_on_each_node else "RANK", 0) == 0:
        write(obj, f, safe_serialization)


def write(obj: Any, f: str | os.PathLike[str], safe_serialization: bool) -> None:
    """Write ``obj`` atomically: safetensors (a dict of tensors) or ``torch.save``."""
    if safe_serialization:
        save_safetensors(obj, f)
    else:
        atomic_save(obj, f)
