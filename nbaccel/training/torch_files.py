"""Writing one torch file atomically: ``torch.save`` to a temporary file beside the target,
fsync, rename over it, with the room it needs checked first (``tensor_bytes``).

>>> import torch, tempfile, os
>>> path = os.path.join(tempfile.mkdtemp(), "w.pt")
>>> atomic_save({"w": torch.ones(2)}, path)
>>> torch.load(path, weights_only=True)["w"]
tensor([1., 1.])
"""

from __future__ import annotations

import os
from typing import Any

import torch

from nbaccel.core.atomic import atomic_write

__all__ = ["atomic_save", "tensor_bytes"]


def atomic_save(obj: Any, path: str | os.PathLike[str]) -> None:
    """``torch.save`` to a temporary file in the same folder, fsync, then rename over ``path``.

    Example::

        atomic_save(model.state_dict(), "ckpt/model.pt")
    """
    with atomic_write(path, "wb", size_hint=tensor_bytes(obj)) as f:
        torch.save(obj, f)


def tensor_bytes(obj: Any) -> int:
    """Bytes of the tensor storages in ``obj`` (nested dicts, lists, tuples), each counted once:
    about what ``torch.save`` writes."""
    storages: dict[Any, int] = {}
    stack = [obj]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            try:
                storage = item.untyped_storage()
            except (RuntimeError, NotImplementedError):  # sparse, nested: not one storage
                continue
            key = (item.device, storage.data_ptr()) if storage.data_ptr() else id(storage)
            storages[key] = storage.nbytes()
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return sum(storages.values())
