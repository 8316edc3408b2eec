"""Collectives over tensors and nested structures: gather, reduce, pad, broadcast, to-device.

Every function works unchanged in one process (it returns its input, or a copy) so code written
for N ranks runs in the kernel too. Nested lists, tuples and dicts of tensors are handled by
walking them and applying the collective to each tensor in the same order on every rank.

>>> import torch
>>> gather(torch.tensor([1, 2]))            # one process: nothing to gather
tensor([1, 2])
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from nbaccel.training import xla


def _world() -> int:
    if xla.in_use():
        return xla.Collectives.get_world_size()
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _comm() -> Any:
    """Who runs the collectives: torch.distributed, or XLA's on XLA devices (training.xla)."""
    return xla.Collectives if xla.in_use() else dist


def recursively_apply(fn: Callable[[torch.Tensor], Any], data: Any) -> Any:
    """Apply ``fn`` to every tensor in nested lists/tuples/dicts, keeping the structure.

    Example::

        recursively_apply(lambda t: t * 2, {"x": torch.ones(2), "n": [torch.zeros(1)]})
    """
    if isinstance(data, torch.Tensor):
        return fn(data)
    if isinstance(data, tuple) and hasattr(data, "_fields"):  # namedtuple
        return type(data)(*(recursively_apply(fn, v) for v in data))
    if isinstance(data, (list, tuple)):
        return type(data)(recursively_apply(fn, v) for v in data)
    if isinstance(data, Mapping):
        try:
            return type(data)({k: recursively_apply(fn, v) for k, v in data.items()})
        except TypeError:  # mappings whose constructor wants more than a dict
            return {k: recursively_apply(fn, v) for k, v in data.items()}
    return data


def send_to_device(data: Any, device: torch.device, non_blocking: bool = False) -> Any:
    """Move every tensor in ``data`` to ``device``; objects with ``.to`` (e.g. HF batches) too.

    Example::

        batch = send_to_device({"x": x, "y": y}, torch.device("cuda", 0))
    """
    if hasattr(data, "to") and not isinstance(data, torch.Tensor) and hasattr(data, "keys"):
        try:
            return data.to(device)
        except TypeError:
            pass
    return recursively_apply(lambda t: t.to(device, non_blocking=non_blocking), data)


def _gather_one(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.ndim == 0:
        tensor = tensor[None]
    if _world() == 1:
        return tensor.clone()
    tensor = tensor.contiguous()
    parts = [torch.empty_like(tensor) for _ in range(_world())]
    try:
        _comm().all_gather(parts, tensor)
    except RuntimeError as exc:
        raise RuntimeError(
            f"gather failed for a tensor of shape {tuple(tensor.shape)} on rank "
            f"{_comm().get_rank()}: {exc}. Every rank must pass tensors of the same shape; call "
            "accelerator.pad_across_processes(tensor) first when the sizes differ."
        ) from exc
    return torch.cat(parts, dim=0)


def gather(data: Any) -> Any:
    """Concatenate every rank's tensors along the first dimension (scalars become length 1).

    Example::

        preds = accelerator.gather(logits.argmax(-1))    # shape [world * batch]
    """
    return recursively_apply(_gather_one, data)


def gather_object(obj: Any) -> list[Any]:
    """Every rank's picklable object; a list is flattened, anything else becomes one entry.

    Example::

        names = gather_object([f"rank{rank}"])        # ["rank0", "rank1"]
    """
    items = obj if isinstance(obj, list) else [obj]
    if _world() == 1:
        return list(items)
    out: list[Any] = [None] * _world()
    _comm().all_gather_object(out, items)
    return [x for part in out for x in part]


def reduce(data: Any, reduction: str = "mean", scale: float = 1.0) -> Any:
    """Average ("mean"), sum ("sum", and "none" as in Accelerate) or take the largest value
    ("max") of every tensor over the ranks; the result is on every rank.

    Example::

        mean_loss = reduce(loss.detach(), "mean")
        worst = reduce(loss.detach(), "max")
    """
    if reduction not in ("sum", "mean", "max", "none"):
        raise ValueError(
            f"reduction={reduction!r} is not supported; choose 'mean', 'sum', 'max' or 'none'."
        )
    op = _comm().ReduceOp.MAX if reduction == "max" else _comm().ReduceOp.SUM

    def one(tensor: torch.Tensor) -> torch.Tensor:
        out = tensor.clone()
        if _world() > 1:
            _comm().all_reduce(out, op=op)
            if reduction == "mean":
                out = out / _world()
        return out * scale if scale != 1.0 else out

    return recursively_apply(one, data)


def pad_across_processes(
    data: Any, dim: int = 0, pad_index: int | float = 0, pad_first: bool = False
) -> Any:
    """Pad every tensor along ``dim`` to the largest size over the ranks, so it can be gathered.

    Example::

        tokens = pad_across_processes(tokens, dim=1, pad_index=tokenizer.pad_token_id)
    """

    def one(tensor: torch.Tensor) -> torch.Tensor:
        if _world() == 1 or tensor.ndim == 0:
            return tensor
        d = dim % tensor.ndim
        sizes = _gather_one(torch.tensor([tensor.shape[d]], device=tensor.device))
        largest = int(sizes.max())
        if largest == tensor.shape[d]:
            return tensor
        shape = list(tensor.shape)
        shape[d] = largest
        out = tensor.new_full(shape, pad_index)
        start = largest - tensor.shape[d] if pad_first else 0
        index = [slice(None)] * tensor.ndim
        index[d] = slice(start, start + tensor.shape[d])
        out[tuple(index)] = tensor
        return out

    return recursively_apply(one, data)


def broadcast(data: Any, from_process: int = 0) -> Any:
    """Every rank gets ``from_process``'s tensors (same shapes on every rank).

    Example::

        seed = broadcast(torch.randint(0, 2**31, (1,)))
    """

    def one(tensor: torch.Tensor) -> torch.Tensor:
        if _world() > 1:
            tensor = tensor.contiguous()
            _comm().broadcast(tensor, src=from_process)
        return tensor

    return recursively_apply(one, data)


def broadcast_object_list(objects: list[Any], from_process: int = 0) -> list[Any]:
    """Fill ``objects`` in place with ``from_process``'s picklable objects; return it."""
    if _world() > 1:
        _comm().broadcast_object_list(objects, src=from_process)
    return objects


def barrier() -> None:
    """Wait until every rank gets here (nothing to wait for in one process)."""
    if _world() > 1:
        _comm().barrier()
