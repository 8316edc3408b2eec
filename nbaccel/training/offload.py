"""Offload folders in Accelerate's format, so a folder written by either library is read by the
other: one raw C-order file ``<name>.dat`` per tensor (bfloat16 stored as its int16 bits, float8
as int8 bits, a 0-d tensor as one element) and ``index.json`` mapping each name to its
``{"dtype": ..., "shape": [...]}``. nbaccel checks the folder is writable and large enough
before it writes anything, writes each file beside its place then renames it, and the index
last: a folder is never left with an index naming a half-written file.

>>> import tempfile, torch
>>> folder = tempfile.mkdtemp()
>>> offload_state_dict(folder, {"w": torch.arange(3.0)})
>>> OffloadedWeightsLoader(save_folder=folder)["w"]
tensor([0., 1., 2.])
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from nbaccel.core.atomic import atomic_write
from nbaccel.core.disk_space import OutOfSpaceError, format_size, free_bytes

INDEX_NAME = "index.json"
# dtypes numpy lacks, stored as the bits of a same-width integer (the index keeps the real name).
_BITS_AS = {torch.bfloat16: torch.int16}


def _stored(tensor: torch.Tensor) -> tuple[np.ndarray, str]:
    """The array written for ``tensor`` and the dtype name the index records."""
    tensor = tensor.detach().cpu().contiguous()
    name = str(tensor.dtype).removeprefix("torch.")
    if tensor.dtype in _BITS_AS:
        tensor = tensor.view(_BITS_AS[tensor.dtype])
    elif name.startswith("float8_"):
        tensor = tensor.view(torch.int8)
    array = tensor.numpy()
    return array, (
        name if name in ("bfloat16",) or name.startswith("float8_") else str(array.dtype)
    )


def offload_weight(
    weight: torch.Tensor,
    weight_name: str,
    offload_folder: str | os.PathLike[str],
    index: dict[str, Any] | None = None,
) -> dict[str, Any] | None:
    """Write ``weight`` as ``<offload_folder>/<weight_name>.dat`` and record it in ``index``
    (returned); the index file itself is written by :func:`save_offload_index`.

    >>> import tempfile
    >>> offload_weight(torch.ones(2, 3), "w", tempfile.mkdtemp(), index={})
    {'w': {'dtype': 'float32', 'shape': [2, 3]}}
    """
    array, dtype = _stored(weight)
    path = Path(offload_folder) / f"{weight_name}.dat"
    with atomic_write(path, "wb", size_hint=array.nbytes) as f:
        f.write(array.reshape(-1).tobytes() if array.ndim == 0 else array.tobytes())
    if index is not None:
        index[weight_name] = {"dtype": dtype, "shape": list(array.shape)}
    return index


def load_offloaded_weight(
    weight_file: str | os.PathLike[str], weight_info: dict[str, Any]
) -> torch.Tensor:
    """The tensor in ``weight_file`` described by its index entry ``weight_info``.

    Example::

        load_offloaded_weight("offload/w.dat", {"dtype": "float32", "shape": [2, 3]})
    """
    shape = tuple(weight_info["shape"])
    dtype = weight_info["dtype"]
    stored = "int16" if dtype == "bfloat16" else "int8" if dtype.startswith("float8_") else dtype
    array = np.memmap(weight_file, dtype=stored, mode="r", shape=shape or (1,))
    tensor = torch.tensor(np.array(array[0] if not shape else array))
    if stored != dtype:
        tensor = tensor.view(getattr(torch, dtype))
    return tensor


def save_offload_index(index: dict[str, Any], offload_folder: str | os.PathLike[str]) -> None:
    """Add ``index``'s entries to the folder's ``index.json`` (written whole, atomically).

    Example::

        save_offload_index({"w": {"dtype": "float32", "shape": [2]}}, "offload/")
    """
    if not index:
        return
    path = Path(offload_folder) / INDEX_NAME
    current = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    current.update(index)
    with atomic_write(path, "w", encoding="utf-8") as f:
        json.dump(current, f, indent=2)


def check_offload_folder(
    offload_folder: str | os.PathLike[str] | None, needed: int, what: str
) -> Path:
    """Refuse, before anything is written, an offload folder that is missing, not a folder,
    not writable, or on a disk without ``needed`` bytes free; the folder, made if need be.

    Example::

        folder = check_offload_folder("offload/", 10**9, "dispatch_model")
    """
    if offload_folder is None:
        raise ValueError(
            f"{what}: {format_size(needed)} of weights go to the disk, and no offload folder was "
            "given; pass offload_folder='some/folder' (offload_dir= for dispatch_model and "
            "disk_offload), or give those modules 'cpu' in the device map."
        )
    folder = Path(offload_folder)
    if folder.exists() and not folder.is_dir():
        raise NotADirectoryError(f"{what}: the offload folder {folder} is a file; pass a folder.")
    existing = folder
    while not existing.exists():
        existing = existing.parent
    if not os.access(existing, os.W_OK | os.X_OK):
        raise PermissionError(
            f"{what}: the offload folder {folder} cannot be written ({existing} is not writable "
            "by this user); pass a folder you can write to."
        )
    free = free_bytes(existing)
    if free is not None and free < needed:
        raise OutOfSpaceError(
            what,
            folder,
            needed,
            "Nothing was written. Pass an offload folder on a disk with more room, or give "
            "more memory (max_memory) so that fewer modules go to the disk.",
        )
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def offload_state_dict(
    save_dir: str | os.PathLike[str],
    state_dict: dict[str, torch.Tensor],
    what: str = "offload_state_dict",
) -> None:
    """Write every tensor of ``state_dict`` to the offload folder ``save_dir``, then its index;
    refused before any file is written where the folder cannot take them (the error names
    ``what``: the call that offloads).

    >>> import tempfile
    >>> folder = tempfile.mkdtemp()
    >>> offload_state_dict(folder, {"w": torch.zeros(2)})
    >>> sorted(os.listdir(folder))
    ['index.json', 'w.dat']
    """
    needed = sum(t.numel() * t.element_size() for t in state_dict.values())
    folder = check_offload_folder(save_dir, needed, what)
    index: dict[str, Any] = {}
    for name, tensor in state_dict.items():
        offload_weight(tensor, name, folder, index=index)
    save_offload_index(index, folder)


def has_offload_index(folder: str | os.PathLike[str] | None) -> bool:
    """Whether ``folder`` already holds offloaded weights (an ``index.json``)."""
    return folder is not None and (Path(folder) / INDEX_NAME).is_file()


class OffloadedWeightsLoader(Mapping[str, torch.Tensor]):
    """The weights of an offloaded model by name: those of ``state_dict`` (kept in memory),
    then those of the offload folder ``save_folder`` (read on each access, so they take no
    memory between uses). Index entries naming a safetensors file (``safetensors_file``,
    ``weight_name``) are read from that file. ``device``: where safetensors tensors are read to.

    >>> loader = OffloadedWeightsLoader(state_dict={"b": torch.ones(1)})
    >>> list(loader), loader["b"]
    (['b'], tensor([1.]))
    """

    def __init__(
        self,
        state_dict: dict[str, torch.Tensor] | None = None,
        save_folder: str | os.PathLike[str] | None = None,
        index: dict[str, Any] | None = None,
        device: Any = None,
    ) -> None:
        if state_dict is None and save_folder is None and index is None:
            raise ValueError(
                "OffloadedWeightsLoader needs a state_dict, a save_folder or an index."
            )
        self.state_dict = dict(state_dict or {})
        self.save_folder = save_folder
        if index is None and save_folder is not None:
            index = json.loads((Path(save_folder) / INDEX_NAME).read_text(encoding="utf-8"))
        self.index = dict(index or {})
        self.all_keys = list(self.state_dict) + [k for k in self.index if k not in self.state_dict]
        self.device = device

    def __getitem__(self, key: str) -> torch.Tensor:
        if key in self.state_dict:
            return self.state_dict[key]
        info = self.index[key]
        if "safetensors_file" in info:
            from safetensors import safe_open

            device = "cpu" if self.device is None else str(self.device)
            with safe_open(info["safetensors_file"], framework="pt", device=device) as f:
                tensor = f.get_tensor(info.get("weight_name", key))
            return tensor.to(getattr(torch, info["dtype"])) if "dtype" in info else tensor
        if self.save_folder is None:
            raise KeyError(f"{key} is in the index but no save_folder holds its file.")
        return load_offloaded_weight(Path(self.save_folder) / f"{key}.dat", info)

    def __iter__(self) -> Iterator[str]:
        return iter(self.all_keys)

    def __len__(self) -> int:
        return len(self.all_keys)


class PrefixedDataset(Mapping[str, torch.Tensor]):
    """The entries of ``dataset`` under ``prefix``, by their name after it.

    >>> PrefixedDataset({"a.w": torch.ones(1), "b.w": torch.zeros(1)}, "a.")["w"]
    tensor([1.])
    """

    def __init__(self, dataset: Mapping[str, torch.Tensor], prefix: str) -> None:
        self.dataset, self.prefix = dataset, prefix

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.dataset[f"{self.prefix}{key}"]

    def __iter__(self) -> Iterator[str]:
        return (k[len(self.prefix) :] for k in self.dataset if k.startswith(self.prefix))

    def __len__(self) -> int:
        return sum(1 for _ in self)


def extract_submodules_state_dict(
    state_dict: dict[str, torch.Tensor], submodule_names: list[str]
) -> dict[str, torch.Tensor]:
    """The entries of ``state_dict`` inside any of ``submodule_names`` (``""``: all).

    >>> extract_submodules_state_dict({"a.w": 1, "ab.w": 2}, ["a"])
    {'a.w': 1}
    """
    return {
        k: v
        for k, v in state_dict.items()
        if any(not m or k == m or k.startswith(m + ".") for m in submodule_names)
    }
