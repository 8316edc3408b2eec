"""A full disk (or a full ``/dev/shm``) as an error a person can act on: which path, about how
many bytes were needed, how many are free, and what to do.

Libraries bury ENOSPC: ``torch.save`` headlines ``unexpected pos 1024 vs 918`` and keeps the
``OSError`` only as the context of that error. :func:`is_out_of_space` finds it anywhere in the
chain, and :class:`OutOfSpaceError` says it in one line.

>>> import errno
>>> try:
...     try:
...         raise OSError(errno.ENOSPC, "No space left on device")
...     except OSError:
...         raise RuntimeError("unexpected pos 1024 vs 918")
... except RuntimeError as exc:
...     is_out_of_space(exc)
True
>>> format_size(1_500_000)
'1.5 MB'
"""

from __future__ import annotations

import errno
import os
import re
import shutil

_FULL = {errno.ENOSPC, errno.EDQUOT}


def is_out_of_space(exc: BaseException | None) -> bool:
    """Whether ``exc``, or an error it was raised from or while handling, is ENOSPC/EDQUOT."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in _FULL:
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def free_bytes(path: str | os.PathLike[str]) -> int | None:
    """Bytes free for this user on the file system holding ``path`` (its nearest existing
    folder); ``None`` where that cannot be read."""
    folder = os.path.abspath(path)
    while not os.path.isdir(folder):
        parent = os.path.dirname(folder)
        if parent == folder:
            return None
        folder = parent
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return None


def format_size(n: int | None) -> str:
    """``918 bytes``, ``12.3 MB``, ``1.5 GB`` (decimal units, as ``df -H`` and file managers)."""
    if n is None:
        return "an unknown amount"
    for unit, scale in (("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS |= {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(size: int | str, what: str = "max_shard_size") -> int:
    """Bytes in ``size`` ("10GB", "200MiB" or an int); ``what`` names it in the error.

    Example::

        parse_size("200MB")   # 200_000_000
    """
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*([\d.]+)\s*([KMGT]?I?B)\s*", size.upper())
    if not match:
        raise ValueError(f"{what}={size!r} is not a size; write e.g. '500MB' or '2GB'.")
    return int(float(match.group(1)) * _UNITS[match.group(2)])


class OutOfSpaceError(OSError):
    """No room to write ``path``: names it, about how much was ``needed``, what is free, and
    ``advice`` (what to do). An ``OSError`` with ``errno.ENOSPC``, so handlers of the original
    keep working.

    Example::

        raise OutOfSpaceError("save_model", "out/model.safetensors", 10**9, "Free space.")
    """

    def __init__(
        self, what: str, path: str | os.PathLike[str], needed: int | None, advice: str
    ) -> None:
        self.path, self.needed, self.free = str(path), needed, free_bytes(path)
        super().__init__(
            f"{what}: no space left to write {self.path}: it needs about "
            f"{format_size(needed)}, with {format_size(self.free)} free there. {advice}"
        )
        self.errno = errno.ENOSPC

    def __reduce__(self) -> tuple:
        # Sent from a rank to the kernel as it reads, not rebuilt (the free space was the rank's).
        return (_rebuilt, (str(self), self.path, self.needed, self.free))


def _rebuilt(message: str, path: str, needed: int | None, free: int | None) -> OutOfSpaceError:
    exc = OSError.__new__(OutOfSpaceError)
    OSError.__init__(exc, message)
    exc.path, exc.needed, exc.free, exc.errno = path, needed, free, errno.ENOSPC
    return exc


def swap_failed(what: str, target: str | os.PathLike[str], needed: int | None) -> OutOfSpaceError:
    """The error for a full disk while a save was written beside the previous one it replaces
    (``what``: the call, e.g. ``"save_state"``).

    Example::

        raise swap_failed("save_model", "out/", 10**9) from exc
    """
    return OutOfSpaceError(
        what,
        target,
        needed,
        f"What was there is kept and the partial files were removed: {what} writes the new "
        "files beside the previous ones before replacing them, so both must fit. Free space "
        f"on that disk, or pass another folder to {what}().",
    )
