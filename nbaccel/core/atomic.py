"""Write a file so that readers see the old content or the new, never a half-written file."""

from __future__ import annotations

import contextlib
import glob
import os
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from nbaccel.core.disk_space import OutOfSpaceError, is_out_of_space

_HOST = socket.gethostname().replace(".", "_").replace("~", "_")


@contextlib.contextmanager
def atomic_write(
    path: str | os.PathLike[str],
    mode: str = "wb",
    encoding: str | None = None,
    size_hint: int | None = None,
) -> Iterator[IO]:
    """Yield a temporary file beside ``path``; on success it is synced and renamed over ``path``.

    If the block raises (or the process dies), ``path`` keeps its previous content and the
    temporary file is removed (after a kill it is left as a hidden ``.name.<host>~<pid>.*.tmp``,
    which the next write of ``path`` removes once that process is gone). A symlink
    is written through (the file it points to is replaced, the link stays), and the file keeps
    its permissions; a new one gets the usual ones (0666 less the umask), as ``open`` gives.
    A full disk raises :class:`~nbaccel.core.disk_space.OutOfSpaceError` naming ``path`` and
    ``size_hint`` (about how many bytes the content takes), whatever the writer raised.

    Example::

        with atomic_write("config.yaml", "w", encoding="utf-8") as f:
            f.write(text)
    """
    target = Path(os.path.realpath(path))  # through symlinks: a dotfiles link stays a link
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        permissions = target.stat().st_mode & 0o7777
    except FileNotFoundError:
        permissions = 0o666 & ~_umask()
    _remove_stale_temporaries(target)
    prefix = f".{target.name}.{_HOST}~{os.getpid()}."  # whose it is, for the sweep
    fd, tmp = tempfile.mkstemp(prefix=prefix, suffix=".tmp", dir=target.parent)
    try:
        os.chmod(tmp, permissions)  # mkstemp makes it 0600
        with os.fdopen(fd, mode, encoding=encoding) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException as exc:
        Path(tmp).unlink(missing_ok=True)
        if is_out_of_space(exc) and not isinstance(exc, OutOfSpaceError):
            raise OutOfSpaceError(
                "saving",
                target,
                size_hint,
                f"Nothing was replaced: {target.name} is as it "
                "was. Free space on that disk, or write somewhere else.",
            ) from exc
        raise


def _remove_stale_temporaries(target: Path) -> None:
    """Remove the temporary files of ``target`` whose writer, on this machine, is gone (killed
    mid-write); those of live writers and of other machines (a shared folder) stay."""
    host = f".{target.name}.{_HOST}~"
    for path in target.parent.glob(f".{glob.escape(target.name)}.*~*.*.tmp"):
        pid = path.name[len(host) :].split(".", 1)[0]
        if not path.name.startswith(host) or not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            path.unlink(missing_ok=True)
        except OSError:  # alive, another user's
            pass


def _umask() -> int:
    """This process's umask, read without changing it (``os.umask`` can only set it, which
    would briefly change it for every thread)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    return 0o022  # the usual default where /proc is not there
