"""A failed rank's frames and locals, copied for a post-mortem in the kernel (``%debug``).

When a rank's function raises, the rank records each frame of the traceback that is not
nbaccel's own (the frames the clean traceback shows): file, line, function, and every local
value pickled on its own. Tensors travel detached and on the CPU; a value that is too big
(:data:`VALUE_LIMIT`, or past :data:`TOTAL_LIMIT` for the whole record) or that cannot be
pickled travels as an :class:`Unsent`: its type, shape/dtype/device where it has them, and the
start of its ``repr``. The kernel loads the record (``launch.post_mortem``) and debugs it.

Set ``NBACCEL_POST_MORTEM=0`` to send no record (the failure itself is reported as always).

>>> u = Unsent("torch.Tensor", "shape (4096, 4096) float32 cuda:0", "64.0 MiB, over 8 MiB", "tensor(..)")
>>> repr(u)
'<not sent from the rank: torch.Tensor shape (4096, 4096) float32 cuda:0 (64.0 MiB, over 8 MiB): tensor(..)>'
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import pickle
import sys
import threading
import time
import types
from types import TracebackType
from typing import Any

import cloudpickle

from nbaccel.core import pickling
from nbaccel.core.local_traceback import is_nbaccel_file

VALUE_LIMIT = 8 << 20  # bytes one local may take, pickled
TOTAL_LIMIT = 64 << 20  # bytes all the locals of one failure may take
REPR_LIMIT = 300  # characters of an unsent value's repr
# Seconds one local may take to be copied, and all of a failure's: a __repr__ or __reduce__
# that blocks is given up on (described by its type) and the failure still goes. Both under
# the grace a stopping rank gets before SIGKILL (``launch.group.STOP_GRACE``, 3 s).
VALUE_SECONDS = 1.0
TOTAL_SECONDS = 2.0
ENV_SWITCH = "NBACCEL_POST_MORTEM"


@dataclasses.dataclass
class Unsent:
    """A local the rank could not copy to the kernel, described instead."""

    type_name: str
    detail: str  # shape, dtype, device, or its size
    why: str
    text: str  # the start of its repr

    def __repr__(self) -> str:
        detail = f" {self.detail}" if self.detail else ""
        text = f": {self.text}" if self.text else ""
        return f"<not sent from the rank: {self.type_name}{detail} ({self.why}){text}>"


@dataclasses.dataclass
class FrameRecord:
    """One frame of a failed rank: where, and its locals (pickled one by one, or described)."""

    file: str
    line: int
    function: str
    first_line: int  # where the function starts (``ll`` lists from here)
    module: str  # the frame's ``__name__`` (its globals are that module's where it is loaded)
    values: dict[str, bytes | Unsent]


class _TooBig(Exception):
    pass


class _Capped(io.BytesIO):
    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit

    def write(self, data: Any) -> int:
        if self.tell() + len(data) > self.limit:
            raise _TooBig
        return super().write(data)


def _same(value: Any) -> Any:
    return value


class _Pickler(pickling._Pickler):  # noqa: SLF001 - the rank's cloudpickle, file names kept
    """Tensors go detached and on the CPU (the kernel has no GPU context to load them into); a
    tensor or array bigger than what is left of the limit stops the pickling before it is
    copied (a model's GPU weights are never copied to the CPU only to be dropped)."""

    def __init__(self, file: _Capped) -> None:
        super().__init__(file, cloudpickle.DEFAULT_PROTOCOL)
        self._capped = file

    def reducer_override(self, obj: Any) -> Any:
        handle = describe_handle(obj)
        if handle is not None:  # inside a container: described in its place, never read
            return Unsent, dataclasses.astuple(handle)
        nbytes = _array_bytes(obj)
        if nbytes is not None and nbytes > self._capped.limit - self._capped.tell():
            raise _TooBig
        torch = sys.modules.get("torch")
        if (
            torch is not None
            and isinstance(obj, torch.Tensor)
            and (obj.device.type != "cpu" or obj.requires_grad or type(obj) is not torch.Tensor)
        ):
            return _same, (obj.detach().to("cpu").as_subclass(torch.Tensor),)
        return super().reducer_override(obj)


def _array_bytes(value: Any) -> int | None:
    """The bytes of a tensor's or numpy array's data, else ``None``."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        return int(value.element_size() * value.nelement())
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(value, numpy.ndarray):
        return int(value.nbytes)
    return None


def _is_handle(value: Any) -> bool:
    """Whether ``value`` stands for something outside the process's memory (an open file, a
    socket) or a paused computation (a generator): copying it would read the file (cloudpickle
    reads an open file whole), or cannot be done."""
    if isinstance(value, io.IOBase):
        return not isinstance(value, (io.StringIO, io.BytesIO))  # in memory: copied as is
    if isinstance(value, (types.GeneratorType, types.CoroutineType, types.AsyncGeneratorType)):
        return True
    return any(isinstance(value, kind) for kind in _handle_types())


def _handle_types() -> tuple[type, ...]:
    kinds: list[type] = []
    for module, name in (("socket", "socket"), ("mmap", "mmap"), ("subprocess", "Popen")):
        loaded = sys.modules.get(module)  # not loaded: no value of it can exist
        kind = getattr(loaded, name, None) if loaded is not None else None
        if isinstance(kind, type):
            kinds.append(kind)
    return tuple(kinds)


def describe_handle(value: Any) -> Unsent | None:
    """An open file, socket, generator or other handle described (type, name, position)
    without reading it; ``None`` for any other value.

    >>> import tempfile
    >>> with tempfile.TemporaryFile("w+") as f:
    ...     _ = f.write("abc")
    ...     describe_handle(f).why
    'a handle: described, not read'
    >>> describe_handle(x for x in [1]).detail
    'generator <genexpr> not started'
    """
    if not _is_handle(value):
        return None
    return Unsent(_type_name(value), _handle_detail(value), "a handle: described, not read", "")


def _handle_detail(value: Any) -> str:
    parts = []
    frame = getattr(value, "gi_frame", None) or getattr(value, "cr_frame", None)
    code = getattr(value, "gi_code", None) or getattr(value, "cr_code", None)
    if code is not None:
        where = "finished" if frame is None else "not started"
        if getattr(value, "gi_suspended", False) or getattr(value, "cr_suspended", False):
            where = f"at line {frame.f_lineno}" if frame is not None else where
        kind = "generator" if hasattr(value, "gi_code") else "coroutine"
        return f"{kind} {code.co_name} {where}"
    with contextlib.suppress(Exception):
        name = getattr(value, "name", None)
        if name is not None:
            parts.append(f"name {name!r}")
        mode = getattr(value, "mode", None)
        if isinstance(mode, str):
            parts.append(f"mode {mode!r}")
    closed = getattr(value, "closed", False)
    if closed is True or (hasattr(value, "fileno") and _fileno(value) == -1):
        parts.append("closed")
        return " ".join(parts)
    if isinstance(value, io.IOBase):
        with contextlib.suppress(Exception):
            if value.seekable():
                parts.append(f"position {value.tell():,}")
    for what, read in (("local", "getsockname"), ("peer", "getpeername")):
        with contextlib.suppress(Exception):
            if hasattr(value, read) and hasattr(value, "family"):
                parts.append(f"{what} {getattr(value, read)()!r}")
    return " ".join(parts)


def _fileno(value: Any) -> int | None:
    try:
        return int(value.fileno())
    except Exception:  # noqa: BLE001 - a handle without a descriptor says so its own way
        return None


def _type_name(value: Any) -> str:
    kind = type(value)
    return (
        kind.__qualname__
        if kind.__module__ == "builtins"
        else f"{kind.__module__}.{kind.__qualname__}"
    )


def _detail(value: Any) -> str:
    shape = getattr(value, "shape", None)
    if shape is None:
        return ""
    parts = [f"shape {tuple(shape)}"]
    for name in ("dtype", "device"):
        if getattr(value, name, None) is not None:
            parts.append(str(getattr(value, name)).removeprefix("torch."))
    return " ".join(parts)


def _short_repr(value: Any) -> str:
    try:
        text = repr(value)
    except Exception as exc:  # noqa: BLE001 - a broken __repr__ is described, not raised
        return f"(repr failed: {type(exc).__name__})"
    return text if len(text) <= REPR_LIMIT else text[:REPR_LIMIT] + "…"


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB" if n >= 1 << 20 else f"{n:,} bytes"


def dump_value(value: Any, limit: int = VALUE_LIMIT) -> bytes | Unsent:
    """``value`` pickled for the kernel, or described where it cannot go (too big, unpicklable).

    >>> isinstance(dump_value(list(range(3))), bytes)
    True
    >>> dump_value(b"x" * 100, limit=10).why
    'over 10 bytes'
    >>> import threading; dump_value(threading.Lock()).why
    'cannot be pickled: TypeError'
    """
    handle = describe_handle(value)
    if handle is not None:
        return handle
    size = _array_bytes(value)
    if size is not None and size > limit:
        return Unsent(_type_name(value), _detail(value), f"{_mib(size)}, over {_mib(limit)}", "")
    buffer = _Capped(limit)
    try:
        _Pickler(buffer).dump(value)
    except _TooBig:
        return Unsent(_type_name(value), _detail(value), f"over {_mib(limit)}", _short_repr(value))
    except Exception as exc:  # noqa: BLE001 - anything unpicklable is described instead
        why = f"cannot be pickled: {type(exc).__name__}"
        return Unsent(_type_name(value), _detail(value), why, _short_repr(value))
    return buffer.getvalue()


# Values that are copied in place: their pickling and repr cannot block or run user code.
_PLAIN = (int, float, complex, bool, str, bytes, type(None))


class _TimeBudget:
    """Each value copied in a thread of its own, waited for at most ``per_value`` seconds and
    no longer than what is left of ``total``; a value given up on is described by its type only
    (its thread is left to finish or to die with the rank: a daemon, it holds nothing of the
    failure's report)."""

    def __init__(self, per_value: float, total: float) -> None:
        self.per_value = per_value
        self.deadline = time.monotonic() + total

    def dump(self, value: Any, limit: int) -> bytes | Unsent:
        if type(value) in _PLAIN:
            return dump_value(value, limit)
        wait = min(self.per_value, self.deadline - time.monotonic())
        if wait <= 0:
            return Unsent(
                _type_name(value), "", "not copied: the failure's copy ran out of time", ""
            )
        done: list[bytes | Unsent] = []
        worker = threading.Thread(
            target=lambda: done.append(dump_value(value, limit)),
            name="nbaccel-snapshot",
            daemon=True,
        )
        worker.start()
        worker.join(wait)
        if done:
            return done[0]
        why = f"not copied: its pickling or repr took over {wait:.1f} s"
        return Unsent(_type_name(value), "", why, "")


def enabled() -> bool:
    """Whether a failure sends its copy (``NBACCEL_POST_MORTEM`` is not ``0``)."""
    return os.environ.get(ENV_SWITCH, "1") != "0"


def take(exc: BaseException) -> bytes | None:
    """The frames of ``exc``'s traceback that are not nbaccel's, with their locals, pickled;
    ``None`` where ``NBACCEL_POST_MORTEM=0`` or nothing of the user's is in it."""
    if not enabled():
        return None
    records, left = [], TOTAL_LIMIT
    budget = _TimeBudget(VALUE_SECONDS, TOTAL_SECONDS)
    tb: TracebackType | None = exc.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        code = frame.f_code
        if not is_nbaccel_file(code.co_filename):
            values: dict[str, bytes | Unsent] = {}
            for name, value in list(frame.f_locals.items()):
                dumped = budget.dump(value, min(VALUE_LIMIT, max(left, 0)))
                if isinstance(dumped, bytes):
                    left -= len(dumped)
                values[name] = dumped
            records.append(
                FrameRecord(
                    code.co_filename,
                    tb.tb_lineno,
                    code.co_name,
                    code.co_firstlineno,
                    str(frame.f_globals.get("__name__", "")),
                    values,
                )
            )
        tb = tb.tb_next
    if not records:
        return None
    return pickle.dumps(records, protocol=pickle.HIGHEST_PROTOCOL)


def load(data: bytes) -> list[FrameRecord]:
    """The records :func:`take` made (the values stay pickled until asked for)."""
    return list(pickle.loads(data))
