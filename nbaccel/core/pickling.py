"""cloudpickle, keeping the file names of functions sent by value so tracebacks show source, and
a notebook's globals the rank's ``__main__``.

cloudpickle replaces the file name of every code object it pickles by value with
"<dynamic-code>" (to make payloads deterministic). A rank's traceback then cannot show the user's
lines. Here code objects keep their real file name, and the kernel ships the source of notebook
cells (which exist only in the kernel's ``linecache``) along with the job.

cloudpickle also gives the functions of a cell a fresh globals dict where they are loaded. In
the kernel their globals are ``__main__``'s; sent :func:`to_ranks`, they are the rank's
``__main__`` too (:func:`loads`), as in a fork of the kernel. So code in a rank that pickles a
cell's function again finds it in ``__main__``: ``datasets``' ``map(num_proc=2)`` (dill) pickles
the function's globals by reference instead of by value, with every module the notebook
imported (all of an editable-installed package, sockets and stores included).

Example::

    data = to_ranks(train)      # in the kernel
    train = loads(data)         # in a rank: train.__globals__ is vars(sys.modules["__main__"])
"""

from __future__ import annotations

import io
import linecache
import os
import pickle
import sys
import types
import weakref
from typing import Any

import cloudpickle

_code_reduce = getattr(cloudpickle.Pickler, "_dispatch_table", {}).get(types.CodeType)
_MAX_SOURCE_BYTES = 4 << 20
_MAIN_GLOBALS = "nbaccel:__main__.__dict__"  # the persistent id of __main__'s globals


# Hugging Face objects that hold the process state of where they were made. Made in the kernel,
# that state is "process 0 of 1": unpickled as it is, every rank would train alone on all the
# data, silently.
_TRAINING_ARGUMENTS = ("transformers.training_args", "TrainingArguments")
_PROCESS_STATES = {
    ("accelerate.state", "PartialState"): "PartialState()",
    ("accelerate.state", "AcceleratorState"): "AcceleratorState()",
    ("accelerate.accelerator", "Accelerator"): "Accelerator()",
}
# A class that says why its objects cannot go to another process (an nbaccel Accelerator):
# ``__nbaccel_not_sendable__()`` gives the error to raise.
_NOT_SENDABLE = ("nbaccel", "__nbaccel_not_sendable__")
# What TrainingArguments caches about its process (transformers 4.x-5.x): without these, the
# copy sets its devices up again, in the rank, the first time it is asked.
_TRAINING_ARGUMENTS_CACHE = ("_setup_devices", "distributed_state", "_n_gpu")


# Every pickled object asks: cached per class (weakly: a notebook redefines its classes).
_KIND_OF_TYPE: weakref.WeakKeyDictionary[type, tuple[str, str] | None] = weakref.WeakKeyDictionary()


def _defined_as(obj: Any) -> tuple[str, str] | None:
    cls = type(obj)
    if cls not in _KIND_OF_TYPE:
        keys = ((k.__module__, k.__qualname__) for k in cls.__mro__)
        kind = next(
            (key for key in keys if key == _TRAINING_ARGUMENTS or key in _PROCESS_STATES), None
        )
        # The classes' own dicts, not hasattr: a metaclass's __getattr__ may answer anything.
        refuses = any(_NOT_SENDABLE[1] in vars(k) for k in cls.__mro__)
        _KIND_OF_TYPE[cls] = _NOT_SENDABLE if refuses else kind
    return _KIND_OF_TYPE[cls]


def _with_state(cls: type[Any], state: dict[str, Any]) -> Any:
    """Unpickle ``cls`` with ``state`` and without running ``__init__`` (pickle's default)."""
    new: Any = cls.__new__  # whatever the class's own __new__ takes, pickle calls it so
    obj = new(cls)
    obj.__dict__.update(state)
    return obj


def _training_arguments_here(cls: type, state: dict[str, Any]) -> Any:
    """The TrainingArguments, set up for this process as its ``__post_init__`` sets them up
    where they are made (it asks for ``.device``): in a rank, that is the rank's world."""
    obj = _with_state(cls, state)
    obj.device  # noqa: B018 - the property sets up the process state
    return obj


def _kernel_state_reduce(obj: Any, key: tuple[str, str]) -> Any:
    if key == _NOT_SENDABLE:
        raise obj.__nbaccel_not_sendable__()
    if key == _TRAINING_ARGUMENTS:
        state = {k: v for k, v in vars(obj).items() if k not in _TRAINING_ARGUMENTS_CACHE}
        state["distributed_state"] = None
        return _training_arguments_here, (type(obj), state)
    if getattr(obj, "num_processes", 1) > 1:  # made in a rank (a returned value): as it is
        return NotImplemented
    made = _PROCESS_STATES[key]
    error = TypeError(
        f"an Accelerate {made} made in the kernel cannot be sent to the ranks: it holds the "
        "kernel's process state (process 0 of 1), so every rank would train alone on all the "
        f"data. Create {made} inside the training function, where each rank makes its own."
    )
    error.nbaccel_hint = True  # type: ignore[attr-defined]  # the launch: message is complete
    raise error


class _Pickler(cloudpickle.Pickler):
    """``main_by_reference``: pickle ``__main__``'s globals as a reference to the globals of
    ``__main__`` where the value is loaded (kernel to ranks only: the other way, a value a rank
    returns would overwrite the notebook's own variables with the rank's copies)."""

    def __init__(self, file: Any, protocol: int, main_by_reference: bool = False) -> None:
        super().__init__(file, protocol=protocol)
        self._main_id = id(vars(sys.modules["__main__"])) if main_by_reference else None

    def persistent_id(self, obj: Any) -> Any:
        # cloudpickle stands one fresh dict in for each globals dict it meets (``globals_ref``).
        is_main = type(obj) is dict and self._main_id is not None
        return _MAIN_GLOBALS if is_main and obj is self.globals_ref.get(self._main_id) else None

    def reducer_override(self, obj: Any) -> Any:
        if _code_reduce is not None and isinstance(obj, types.CodeType):
            func, args = _code_reduce(obj)[:2]
            return func, tuple(obj.co_filename if a == "<dynamic-code>" else a for a in args)
        key = _defined_as(obj) if not isinstance(obj, type) else None
        if key is not None:
            reduced = _kernel_state_reduce(obj, key)
            if reduced is not NotImplemented:
                return reduced
        return super().reducer_override(obj)


def dumps(value: Any) -> bytes:
    """Pickle ``value`` for any process (a rank's result or exception for the kernel)."""
    return _dump(value, main_by_reference=False)


def to_ranks(value: Any) -> bytes:
    """Pickle ``value`` in the kernel for the ranks, which load it with :func:`loads`."""
    return _dump(value, main_by_reference=True)


def _dump(value: Any, main_by_reference: bool) -> bytes:
    buffer = io.BytesIO()
    _Pickler(buffer, cloudpickle.DEFAULT_PROTOCOL, main_by_reference).dump(value)
    return buffer.getvalue()


class _Unpickler(pickle.Unpickler):
    def persistent_load(self, pid: Any) -> Any:
        if pid == _MAIN_GLOBALS:
            return vars(sys.modules["__main__"])
        raise pickle.UnpicklingError(f"unknown persistent id {pid!r}")


def loads(data: bytes) -> Any:
    """Unpickle what :func:`dumps` or :func:`to_ranks` made; ``__main__``'s globals are this
    process's ``__main__``."""
    return _Unpickler(io.BytesIO(data)).load()


def notebook_sources() -> dict[str, tuple]:
    """``linecache`` entries for code that exists only in this process (notebook cells)."""
    sources, size = {}, 0
    for filename, entry in list(linecache.cache.items()):
        if len(entry) != 4 or os.path.exists(filename):
            continue
        size += sum(len(line) for line in entry[2])
        if size > _MAX_SOURCE_BYTES:
            break
        sources[filename] = (entry[0], None, list(entry[2]), filename)
    return sources


def install_sources(sources: dict[str, tuple]) -> None:
    linecache.cache.update(sources)
