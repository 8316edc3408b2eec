"""Collectives over tensors and nested structures: gather, reduce, pad, broadcast, to-device.

Every function works unchanged in one process (it returns its input, or a copy) so code written
for N ranks runs in the kernel too. Nested lists, tuples and dicts of tensors are handled by
walking them and applying the collective to each tensor in the same order on every rank.
Also Accelerate's free ``wait_for_everyone`` and ``concatenate`` (joining gathered structures).

>>> import torch
>>> gather(torch.tensor([1, 2]))            # one process: nothing to gather
tensor([1, 2])
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from nbaccel.training import xla

ENV_DEBUG = "ACCELERATE_DEBUG_MODE"  # Accelerate's switch, read by nbaccel too
_debug: list[bool] = []  # set by PartialState.debug = ...; empty: the environment decides


class DistributedOperationException(Exception):
    """A collective was called with tensors whose shapes cannot go together on every rank
    (raised before the collective in debug mode, instead of a hang or a gloo error)."""


def debug_mode() -> bool:
    """Whether collectives first check that every rank passes matching shapes
    (``ACCELERATE_DEBUG_MODE=1``, or ``PartialState().debug = True``)."""
    if _debug:
        return _debug[-1]
    return os.environ.get(ENV_DEBUG, "").strip().lower() in ("1", "true", "yes", "on")


def set_debug_mode(on: bool) -> None:
    """Turn the shape checks on or off for this process (``PartialState().debug = on``)."""
    _debug[:] = [bool(on)]


def _shapes(data: Any) -> list[tuple[int, ...]]:
    found: list[tuple[int, ...]] = []
    recursively_apply(lambda t: found.append(tuple(t.shape)), data)
    return found


def _check_shapes(operation: str, data: Any, free_dim: int | None = None) -> None:
    """In debug mode, compare every rank's tensor shapes before ``operation`` runs: equal, or
    (``free_dim``) equal but for that dimension. One small object collective."""
    if _world() == 1 or not debug_mode():
        return
    shapes = _shapes(data)
    key = shapes
    if free_dim is not None:  # pad_across_processes: the padded dimension may differ
        key = [_without(s, free_dim % len(s)) if s else s for s in shapes]
    every: list[Any] = [None] * _world()
    _comm().all_gather_object(every, (key, shapes))
    if all(k == every[0][0] for k, _ in every):
        return
    listed = "\n".join(f"  rank {r}: {s}" for r, (_, s) in enumerate(every))
    rule = " (only the padded dimension may differ)" if free_dim is not None else ""
    raise DistributedOperationException(
        f"{operation}: the tensors' shapes differ between ranks, so the collective cannot "
        f"run:\n{listed}\nPass tensors of the same shape on every rank{rule}."
    )


def _without(shape: tuple[int, ...], dim: int) -> tuple[int, ...]:
    """``shape``'s rank and its sizes but for dimension ``dim``."""
    return (len(shape), *shape[:dim], *shape[dim + 1 :])


def _world() -> int:
    if xla.in_use():
        return xla.Collectives.get_world_size()
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _comm() -> Any:
    """Who runs the collectives: torch.distributed, or XLA's on XLA devices (training.xla)."""
    return xla.Collectives if xla.in_use() else dist


def is_torch_tensor(value: Any) -> bool:
    """Whether ``value`` is a tensor (``recursively_apply``'s default ``test_type``)."""
    return isinstance(value, torch.Tensor)


def recursively_apply(
    func: Callable[..., Any],
    data: Any,
    *args: Any,
    test_type: Callable[[Any], bool] = is_torch_tensor,
    error_on_other_type: bool = False,
    **kwargs: Any,
) -> Any:
    """Apply ``func(value, *args, **kwargs)`` to every value in nested lists/tuples/dicts that
    passes ``test_type`` (tensors by default), keeping the structure; other values are kept as
    they are, or refused with ``error_on_other_type=True``.

    Example::

        recursively_apply(lambda t: t * 2, {"x": torch.ones(2), "n": [torch.zeros(1)]})
    """

    def walk(value: Any) -> Any:
        if test_type(value):
            return func(value, *args, **kwargs)
        if isinstance(value, tuple) and hasattr(value, "_fields"):  # namedtuple
            return type(value)(*(walk(v) for v in value))
        if isinstance(value, (list, tuple)):
            return type(value)(walk(v) for v in value)
        if isinstance(value, Mapping):
            return _same_kind(value, {k: walk(v) for k, v in value.items()})
        if error_on_other_type:
            raise TypeError(
                f"cannot apply {getattr(func, '__name__', func)} to a {type(value).__name__}: "
                "only nested lists, tuples and dicts of tensors are supported."
            )
        return value

    return walk(data)


def _same_kind(mapping: Mapping, items: dict[Any, Any]) -> Any:
    """``items`` as ``mapping``'s own type where its constructor takes a dict, else a dict.
    The values are computed once, before: they may come from collectives."""
    try:
        return type(mapping)(items)
    except TypeError:  # mappings whose constructor wants more than a dict
        return items


def send_to_device(
    tensor: Any,
    device: torch.device | str | int,
    non_blocking: bool = False,
    skip_keys: str | list[str] | None = None,
) -> Any:
    """Move every tensor in ``tensor`` (nested lists/tuples/dicts) to ``device``; objects with
    ``.to`` (e.g. HF batches) too. Values under ``skip_keys`` of a dict stay where they are.

    Example::

        batch = send_to_device({"x": x, "y": y}, torch.device("cuda", 0))
        batch = send_to_device(batch, "cuda", skip_keys="meta")   # batch["meta"] untouched
    """
    skip = [skip_keys] if isinstance(skip_keys, str) else list(skip_keys or ())
    if isinstance(tensor, Mapping) and skip:
        moved = {
            k: v if k in skip else send_to_device(v, device, non_blocking)
            for k, v in tensor.items()
        }
        return _same_kind(tensor, moved)
    if hasattr(tensor, "to") and not isinstance(tensor, torch.Tensor) and hasattr(tensor, "keys"):
        try:
            return tensor.to(device)
        except TypeError:
            pass
    return recursively_apply(lambda t: t.to(device, non_blocking=non_blocking), tensor)


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


def gather(tensor: Any) -> Any:
    """Concatenate every rank's tensors along the first dimension (scalars become length 1).

    Example::

        preds = accelerator.gather(logits.argmax(-1))    # shape [world * batch]
    """
    _check_shapes("gather", tensor)
    return recursively_apply(_gather_one, tensor)


def gather_object(object: Any) -> Any:  # Accelerate's parameter name
    """Every rank's picklable object, each rank's items one after the other, as Accelerate
    gives them: each rank's object is iterated (a list or tuple gives its items, a string its
    characters, a dict its keys); an object that cannot be iterated, where Accelerate raises,
    is one item. On one process the object comes back as it is.

    Example::

        names = gather_object([f"rank{rank}"])        # ["rank0", "rank1"]
    """
    if _world() == 1:
        return object
    out: list[Any] = [None] * _world()
    _comm().all_gather_object(out, object)
    return [x for part in out for x in (part if isinstance(part, Iterable) else [part])]


def reduce(tensor: Any, reduction: str = "mean", scale: float = 1.0) -> Any:
    """Average ("mean"), sum ("sum", and "none" as in Accelerate) or take the largest value
    ("max") of every tensor over the ranks; the result is on every rank. ``scale`` multiplies
    the result on XLA devices only, as Accelerate's ``reduce`` documents and does; elsewhere it
    is ignored with a warning, so ported code computes Accelerate's numbers.

    Example::

        mean_loss = reduce(loss.detach(), "mean")
        worst = reduce(loss.detach(), "max")
    """
    if reduction not in ("sum", "mean", "max", "none"):
        raise ValueError(
            f"reduction={reduction!r} is not supported; choose 'mean', 'sum', 'max' or 'none'."
        )
    _check_shapes("reduce", tensor)
    op = _comm().ReduceOp.MAX if reduction == "max" else _comm().ReduceOp.SUM
    scaled = scale != 1.0 and xla.in_use()
    if scale != 1.0 and not scaled:
        warnings.warn(
            f"reduce(scale={scale}) is ignored: Accelerate applies scale on XLA devices only, "
            "and nbaccel gives Accelerate's result; multiply the result yourself instead.",
            stacklevel=3,
        )

    def one(tensor: torch.Tensor) -> torch.Tensor:
        out = tensor.clone()
        if _world() > 1:
            _comm().all_reduce(out, op=op)
            if reduction == "mean":
                out = out / _world()
        return out * scale if scaled else out

    return recursively_apply(one, tensor)


def pad_across_processes(
    tensor: Any, dim: int = 0, pad_index: int | float = 0, pad_first: bool = False
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

    _check_shapes("pad_across_processes", tensor, free_dim=dim)
    return recursively_apply(one, tensor)


def broadcast(tensor: Any, from_process: int = 0) -> Any:
    """Every rank gets ``from_process``'s tensors (same shapes on every rank).

    Example::

        seed = broadcast(torch.randint(0, 2**31, (1,)))
    """

    def one(tensor: torch.Tensor) -> torch.Tensor:
        if _world() > 1:
            tensor = tensor.contiguous()
            _comm().broadcast(tensor, src=from_process)
        return tensor

    _check_shapes("broadcast", tensor)
    return recursively_apply(one, tensor)


def _this_device() -> torch.device:
    """This rank's device, as the process group sees it (a rank's CUDA device is current)."""
    if xla.in_use():
        return xla.detect()[4]
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def copy_tensor_to_devices(tensor: torch.Tensor | None = None) -> torch.Tensor:
    """The main process's ``tensor`` on every rank's device; the other ranks pass ``None``
    (they need not know its shape or dtype).

    Example::

        table = copy_tensor_to_devices(load_table() if acc.is_main_process else None)
    """
    if _world() == 1:
        if tensor is None:
            raise ValueError("copy_tensor_to_devices: the main process passed None.")
        return tensor
    device = _this_device()
    meta = [(tuple(tensor.shape), tensor.dtype) if tensor is not None else None]
    _comm().broadcast_object_list(meta, src=0)
    if meta[0] is None:
        raise ValueError("copy_tensor_to_devices: the main process passed None.")
    shape, dtype = meta[0]
    out = (
        tensor.to(device) if tensor is not None else torch.empty(shape, dtype=dtype, device=device)
    )
    return broadcast(out.contiguous(), 0)


def broadcast_object_list(object_list: list[Any], from_process: int = 0) -> list[Any]:
    """Fill ``object_list`` in place with ``from_process``'s picklable objects; return it."""
    if _world() > 1:
        _comm().broadcast_object_list(object_list, src=from_process)
    return object_list


def barrier() -> None:
    """Wait until every rank gets here (nothing to wait for in one process)."""
    if _world() > 1:
        _comm().barrier()


def wait_for_everyone() -> None:
    """Block until every rank reaches this line (nothing to wait for in one process).

    Example::

        wait_for_everyone()
    """
    barrier()


def concatenate(data: list[Any], dim: int = 0) -> Any:
    """Concatenate a list of same-shaped nested structures (lists, tuples, dicts) of tensors
    tensor by tensor along ``dim``.

    Example::

        concatenate([{"logits": a}, {"logits": b}])   # {"logits": torch.cat([a, b])}
    """
    if not isinstance(data, (list, tuple)) or not data:
        raise TypeError(f"concatenate needs a non-empty list, got {type(data).__name__}.")
    first = data[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(list(data), dim=dim)
    if isinstance(first, tuple) and hasattr(first, "_fields"):  # namedtuple
        return type(first)(*(concatenate([d[i] for d in data], dim) for i in range(len(first))))
    if isinstance(first, (list, tuple)):
        return type(first)(concatenate([d[i] for d in data], dim) for i in range(len(first)))
    if isinstance(first, Mapping):
        return type(first)({k: concatenate([d[k] for d in data], dim) for k in first})
    raise TypeError(
        f"concatenate can only join tensors (in nested lists, tuples, dicts), got "
        f"{type(first).__name__}."
    )
