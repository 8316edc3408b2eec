"""Out-of-memory helpers: retry a training function with a smaller batch, and free memory.

``find_executable_batch_size`` calls the function with ``starting_batch_size`` and, when it
dies of an out-of-memory error (CUDA or CPU allocator), frees memory and tries again with 90% of
the batch (Accelerate 1.x's rule), down to 1.

>>> @find_executable_batch_size(starting_batch_size=10)
... def train(batch_size):
...     if batch_size > 8:
...         raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
...     return batch_size
>>> train()
8
"""

from __future__ import annotations

import functools
import gc
import inspect
from collections.abc import Callable
from typing import Any

import torch

_OOM_MESSAGES = (
    " out of memory.",  # CUDA, HIP
    "CUDA out of memory",
    "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED.",
    "DefaultCPUAllocator: can't allocate memory",
)


def clear_device_cache(garbage_collection: bool = False) -> None:
    """Collect garbage (optionally) and return cached GPU memory to the driver."""
    if garbage_collection:
        gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def release_memory(*objects: Any) -> list[None]:
    """Drop references and free memory; use as ``a, b = release_memory(a, b)``.

    Example::

        model, optimizer = release_memory(model, optimizer)
    """
    clear_device_cache(garbage_collection=True)
    return [None] * len(objects)


def should_reduce_batch_size(exception: BaseException) -> bool:
    """Whether ``exception`` is an out-of-memory error that a smaller batch could avoid.

    Example::

        should_reduce_batch_size(torch.cuda.OutOfMemoryError("CUDA out of memory."))  # True
    """
    if isinstance(exception, torch.cuda.OutOfMemoryError):
        return True
    if isinstance(exception, RuntimeError) and len(exception.args) == 1:
        return any(text in str(exception.args[0]) for text in _OOM_MESSAGES)
    return False


def find_executable_batch_size(
    function: Callable[..., Any] | None = None,
    starting_batch_size: int = 128,
    reduce_batch_size_fn: Callable[[], int] | None = None,
) -> Any:
    """Decorator: call ``function(batch_size, ...)``, retrying with a smaller batch on OOM.

    In a notebook the function frees what the failed try held (``accelerator.free_memory()``)
    and builds its loader with ``batch_size``. Here, a pretend device that fits 40 samples:

    >>> tried = []
    >>> @find_executable_batch_size(starting_batch_size=64)
    ... def train(batch_size):
    ...     tried.append(batch_size)
    ...     if batch_size > 40:
    ...         raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
    ...     return batch_size
    >>> train(), tried
    (40, [64, 57, 51, 45, 40])
    """
    if function is None:
        return functools.partial(
            find_executable_batch_size,
            starting_batch_size=starting_batch_size,
            reduce_batch_size_fn=reduce_batch_size_fn,
        )
    batch_size = starting_batch_size

    def reduce() -> int:
        nonlocal batch_size
        batch_size = reduce_batch_size_fn() if reduce_batch_size_fn else int(batch_size * 0.9)
        return batch_size

    @functools.wraps(function)
    def decorator(*args: Any, **kwargs: Any) -> Any:
        clear_device_cache(garbage_collection=True)
        params = list(inspect.signature(function).parameters)
        if len(params) < len(args) + 1:
            raise TypeError(
                f"{function.__name__}() got the batch size as an argument; leave it out, the "
                "decorator passes it: call it with the other arguments only."
            )
        while True:
            if batch_size == 0:
                raise RuntimeError(
                    "No executable batch size found, reached zero. (find_executable_batch_size: "
                    "even a batch of 1 ran out of memory; use a smaller model, mixed precision, "
                    "or more/larger devices.)"
                )
            try:
                return function(batch_size, *args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - only OOM errors are retried
                if not should_reduce_batch_size(exc):
                    raise
                clear_device_cache(garbage_collection=True)
                reduce()

    return decorator
