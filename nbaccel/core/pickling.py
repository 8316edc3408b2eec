"""cloudpickle, keeping the file names of functions sent by value so tracebacks show source.

cloudpickle replaces the file name of every code object it pickles by value with
"<dynamic-code>" (to make payloads deterministic). A rank's traceback then cannot show the user's
lines. Here code objects keep their real file name, and the kernel ships the source of notebook
cells (which exist only in the kernel's ``linecache``) along with the job.
"""

from __future__ import annotations

import io
import linecache
import os
import types
from typing import Any

import cloudpickle

_code_reduce = getattr(cloudpickle.Pickler, "_dispatch_table", {}).get(types.CodeType)
_MAX_SOURCE_BYTES = 4 << 20


class _Pickler(cloudpickle.Pickler):
    def reducer_override(self, obj: Any) -> Any:
        if _code_reduce is not None and isinstance(obj, types.CodeType):
            func, args = _code_reduce(obj)[:2]
            return func, tuple(obj.co_filename if a == "<dynamic-code>" else a for a in args)
        return super().reducer_override(obj)


def dumps(value: Any) -> bytes:
    buffer = io.BytesIO()
    _Pickler(buffer, protocol=cloudpickle.DEFAULT_PROTOCOL).dump(value)
    return buffer.getvalue()


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
