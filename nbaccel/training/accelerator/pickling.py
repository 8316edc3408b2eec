"""What pickling an Accelerator means: a reference to it, valid only in the process that made it.

An Accelerator is its process's rank, device and process group. Pickled and loaded in the same
process (Accelerate's own ``test_pickle_accelerator``, ``torch.save`` of an object that holds
one, a library that round-trips its arguments through pickle) it comes back as the same
Accelerator, as ``copy.deepcopy`` shares it: there is one per process, as Accelerate's state is
one per process. Loaded in another process it is refused with the reason (a copy there would
run as "rank 0 of 1": no gradient sync, every rank the main one). nbaccel's own transport
(``core.pickling``: a launch's function and arguments, a rank's result) refuses it already
when pickling, with :func:`sending_error`, before anything is sent.

>>> import pickle
>>> from nbaccel import Accelerator
>>> acc = Accelerator()
>>> pickle.loads(pickle.dumps(acc)) is acc
True
"""

from __future__ import annotations

import itertools
import os
import uuid
import weakref
from typing import Any

# With the pid, this process as a pickle can tell it from another one: a fork keeps the
# module's token but not its pid, and a later process that gets the same pid has another token.
_TOKEN = uuid.uuid4().hex
_LIVE: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
_KEYS = itertools.count()

NOT_SENDABLE = (
    "an Accelerator created in the kernel cannot be sent to the ranks: create `Accelerator()` "
    "inside the training function (it then runs as its rank, with gradient sync)."
)


def reduce_to_reference(accelerator: Any) -> tuple[Any, tuple[Any, ...]]:
    """``__reduce_ex__`` of an Accelerator: rebuilt by :func:`_restore` in this process only."""
    key = vars(accelerator).get("_nbaccel_pickle_key")
    if key is None:
        key = next(_KEYS)
        vars(accelerator)["_nbaccel_pickle_key"] = key
    _LIVE[key] = accelerator
    where = (accelerator.process_index, accelerator.num_processes)
    return _restore, (_this_process(), key, where)


def _restore(process: tuple[int, str], key: int, where: tuple[int, int]) -> Any:
    here = process == _this_process()
    accelerator = _LIVE.get(key) if here else None
    if accelerator is not None:
        return accelerator
    rank, world = where
    if here:
        problem = "it no longer exists in this process"
    else:
        problem = (
            f"it was pickled in another process (pid {process[0]}, rank {rank} of {world}) and "
            "holds that process's rank, device and process group"
        )
    raise TypeError(
        f"an Accelerator can only be unpickled in the process that pickled it: {problem}. "
        "Create `Accelerator()` in this process (in each rank, inside the training function) "
        "instead of sending one."
    )


def _this_process() -> tuple[int, str]:
    return os.getpid(), _TOKEN


def sending_error(accelerator: Any) -> TypeError:
    """Why ``accelerator`` cannot be sent to another process: made in a rank, or in the kernel
    (the launch shows the message as it is, ``nbaccel_hint``)."""
    if accelerator.num_processes > 1:  # inside a rank: a returned value
        return TypeError(
            "an Accelerator cannot be sent to another process: it holds this rank's process "
            "group. Return or gather plain values (tensors, numbers) instead."
        )
    error = TypeError(NOT_SENDABLE)
    error.nbaccel_hint = True  # type: ignore[attr-defined]  # launch: message is complete
    return error
