"""What a launch sends its ranks: the function and each argument, pickled one by one.

``serialize`` cloudpickles the function and every argument on its own, so a value that cannot
be sent is named (``args[1] (Queue) cannot be sent to the ranks: ...``) with what to pass
instead; large tensors and arrays go into one shared-memory block for every rank
(``core.shared_tensors``) instead of one pickle per rank.

Example:

>>> function_bytes, arg_bytes, kwarg_bytes, transfer = serialize(print, ("hi",), {})
>>> len(arg_bytes), kwarg_bytes, transfer.size
(1, {}, 0)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from nbaccel.core import shared_tensors


def serialize(
    function: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]
) -> tuple[bytes, list[bytes], dict[str, bytes], shared_tensors.Transfer]:
    """Cloudpickle the function and each argument on its own, so an error names the culprit;
    large tensors and arrays go into one shared-memory block for all ranks (shared_tensors)."""
    if isinstance(args, (str, bytes)) or not isinstance(args, Sequence):
        raise TypeError(f"args must be a tuple or list of arguments, got {type(args).__name__}.")
    if not isinstance(kwargs, Mapping) or not all(isinstance(k, str) for k in kwargs):
        raise TypeError(
            "kwargs must be a dict of keyword arguments by name, e.g. kwargs={'lr': 0.1}, "
            f"got {type(kwargs).__name__}"
            + (" with keys that are not strings." if isinstance(kwargs, Mapping) else ".")
        )
    name = getattr(function, "__qualname__", repr(function))
    shared_tensors.sweep_stale()
    # The function goes through the same packer as the arguments: a large tensor it uses as a
    # global (pickled with a notebook's function) is shared memory too, not pickled per rank.
    packer = shared_tensors.Packer()
    try:
        function_bytes = packer.dumps(function)
    except Exception as exc:
        if getattr(exc, "nbaccel_hint", False):  # the error already says what to do
            raise TypeError(f"{name} cannot start: {exc}") from None
        # `from None`: the message holds the cause's text; the pickler's own chained traceback
        # (dozens of cloudpickle frames) would bury it in a notebook.
        raise TypeError(
            f"the function {name} cannot be sent to the ranks: {type(exc).__name__}: {exc}. "
            + (
                _inherited_only(exc)
                or "Something it refers to (a global, a closure variable) cannot be pickled; "
                "create that object inside the function instead."
            )
        ) from None

    def dump(value: Any, label: str) -> bytes:
        try:
            return packer.dumps(value)
        except Exception as exc:
            if getattr(exc, "nbaccel_hint", False):
                raise TypeError(f"{label} ({type(value).__name__}): {exc}") from None
            raise TypeError(
                f"{label} ({type(value).__name__}) cannot be sent to the ranks: "
                f"{type(exc).__name__}: {exc}. "
                + (
                    _inherited_only(exc)
                    or "Pass something picklable (e.g. a path or the parameters to build it) "
                    "and create the object inside the function."
                )
            ) from None

    arg_bytes = [dump(a, f"args[{i}]") for i, a in enumerate(args)]
    kwarg_bytes = {k: dump(v, f"kwargs[{k!r}]") for k, v in kwargs.items()}
    return function_bytes, arg_bytes, kwarg_bytes, packer.seal()


def _inherited_only(exc: Exception) -> str:
    """What to use instead of a multiprocessing Queue, Event, Lock, Value or Array, which only
    reach processes forked from this one ("" for other pickling errors): Accelerate's
    notebook_launcher forks the ranks from the kernel, nbaccel's come from a fork server."""
    if "should only be shared between processes through inheritance" not in str(exc):
        return ""
    return (
        "nbaccel's ranks are started by a fork server, not forked from this process, so they "
        "cannot inherit it. Make it with a manager, which every rank (and every restart) "
        "reaches: `manager = multiprocessing.Manager()`, then `manager.Queue()` (or "
        "`.Event()`, `.Lock()`, `.Value('i', 0)`, `.dict()`)."
    )


def refuse_shared_memory(transfer: shared_tensors.Transfer) -> None:
    """A cluster's ranks do not share this machine's memory: large tensors must be pickled."""
    if transfer.size:
        shared_tensors.release(transfer)
        raise ValueError(
            f"the arguments hold {transfer.size / 2**20:.0f} MiB of tensors or arrays, which "
            "reach local ranks through shared memory but cannot reach a cluster's nodes that "
            "way. Load or build them inside the function (e.g. from a path every node can "
            "read) and pass the path instead."
        )
