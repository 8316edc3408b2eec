"""Write a file so that readers see the old content or the new, never a half-written file."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO


@contextlib.contextmanager
def atomic_write(
    path: str | os.PathLike[str], mode: str = "wb", encoding: str | None = None
) -> Iterator[IO]:
    """Yield a temporary file beside ``path``; on success it is synced and renamed over ``path``.

    If the block raises (or the process dies), ``path`` keeps its previous content and the
    temporary file is removed (or, after a crash, left as a hidden ``.name.*.tmp``).

    Example::

        with atomic_write("config.yaml", "w", encoding="utf-8") as f:
            f.write(text)
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, mode, encoding=encoding) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
