"""Model weight files in Hugging Face's layout: ``model.safetensors`` (or
``pytorch_model.bin``), split into shards with a JSON index when larger than ``max_shard_size``,
and loading them back into a model.

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
from nbaccel.training.checkpoint import atomic_save

SAFE_WEIGHTS_NAME, WEIGHTS_NAME = "model.safetensors", "pytorch_model.bin"
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS |= {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


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


def save_safetensors(state: dict[str, torch.Tensor], path: str | os.PathLike[str]) -> None:
    """Write a state dict as one safetensors file, atomically (shared tensors are copied)."""
    from safetensors.torch import save

    seen: set[int] = set()
    clean = {}
    for key, tensor in state.items():
        tensor = tensor.detach().cpu()
        ptr = tensor.untyped_storage().data_ptr() if tensor.numel() else -id(tensor)
        # safetensors refuses tensors that share memory (tied weights): store copies.
        clean[key] = tensor.clone().contiguous() if ptr in seen else tensor.contiguous()
        seen.add(ptr)
    blob = save(clean, metadata={"format": "pt"})
    with atomic_write(path, "wb") as f:
        f.write(blob)


def save_model_files(
    state: dict[str, Any],
    save_directory: str | os.PathLike[str],
    max_shard_size: int | str = "10GB",
    safe_serialization: bool = True,
) -> None:
    """Write ``state`` into ``save_directory`` as one file or size-limited shards + index.

    Example::

        save_model_files(model.state_dict(), "out/", max_shard_size="1GB")
    """
    folder = Path(save_directory)
    if folder.is_file():
        raise ValueError(f"save_model: {folder} is a file; pass a folder to write into.")
    folder.mkdir(parents=True, exist_ok=True)
    limit = parse_size(max_shard_size)
    shards: list[dict[str, Any]] = [{}]
    size = 0
    for key, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > limit:
            shards.append({})
            size = 0
        shards[-1][key] = tensor
        size += nbytes
    name = SAFE_WEIGHTS_NAME if safe_serialization else WEIGHTS_NAME
    stem, ext = name.rsplit(".", 1)
    prefix = stem + "-"
    for old in folder.glob(f"{stem}*.{ext}"):  # shards of an earlier, differently split save
        if old.name == name or old.name.startswith(prefix):
            old.unlink()
    names = (
        [name]
        if len(shards) == 1
        else [f"{stem}-{i + 1:05d}-of-{len(shards):05d}.{ext}" for i in range(len(shards))]
    )
    for shard, filename in zip(shards, names):
        if safe_serialization:
            save_safetensors(shard, folder / filename)
        else:
            atomic_save({k: v.detach().cpu() for k, v in shard.items()}, folder / filename)
    if len(shards) > 1:
        total = sum(t.numel() * t.element_size() for t in state.values())
        index = {
            "metadata": {"total_size": total},
            "weight_map": {k: f for shard, f in zip(shards, names) for k in shard},
        }
        with atomic_write(folder / f"{name}.index.json", "w") as f:
            json.dump(index, f, indent=2)


def load_state_dict_files(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """The state dict in a file or a ``save_model`` folder (single file or sharded).

    Example::

        state = load_state_dict_files("out/")
    """
    path = Path(path)
    files = [path]
    if path.is_dir():
        for name in (SAFE_WEIGHTS_NAME, WEIGHTS_NAME):
            index = path / f"{name}.index.json"
            if index.exists():
                weight_map = json.loads(index.read_text())["weight_map"]
                files = [path / f for f in dict.fromkeys(weight_map.values())]
                break
            if (path / name).exists():
                files = [path / name]
                break
        else:
            raise FileNotFoundError(
                f"{path} holds no {SAFE_WEIGHTS_NAME} or {WEIGHTS_NAME} (or their index); "
                "pass the folder given to accelerator.save_model()."
            )
    state: dict[str, torch.Tensor] = {}
    for file in files:
        if file.suffix == ".safetensors":
            from safetensors.torch import load_file

            state.update(load_file(str(file)))
        else:
            state.update(torch.load(file, map_location="cpu", weights_only=True))
    return state


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
    """Load a file or ``save_model`` folder into ``model`` (Accelerate's name and parameters),
    its floating-point weights cast to ``dtype`` when given. Big-model loading (``device_map``,
    offloading, 8-bit, sharded state dicts) is refused with the reason.

    Example::

        load_checkpoint_in_model(model, "out/")
        load_checkpoint_in_model(model, "out/model.safetensors", dtype=torch.bfloat16)
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
    if dtype is not None:
        target = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        state = {k: v.to(target) if v.is_floating_point() else v for k, v in state.items()}
    model.load_state_dict(state, strict=strict)
