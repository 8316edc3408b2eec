"""Imported by the fork server: a rank does not run the script that launched it again.

multiprocessing's children import their parent's ``__main__`` file (as ``__mp_main__``) before
they run anything, so that what it defines can be found by reference. A rank needs none of it:
its function and the globals that function uses come pickled by value, as from a notebook cell.
Run again, the script's top level would run once more in every rank: without an
``if __name__ == "__main__":`` guard it launched again there (multiprocessing's bootstrapping
error, twice per rank), and with one it still loaded its data and printed its banners once per
rank. So the fork server prepares nbaccel's ranks without the main module, as a fork (what
Accelerate's launcher does) leaves it: a script needs no guard around ``notebook_launcher``.
Other processes the server forks (a script's own forkserver children share it) prepare as usual.

Example (in the fork server only; a no-op anywhere else)::

    import nbaccel.forkserver.launching_script  # a rank named "nbaccel-rank0" skips __main__
"""

from __future__ import annotations

import multiprocessing.spawn
from collections.abc import Mapping
from typing import Any

from nbaccel.core.process_table import RANK_PROCESS_PREFIX
from nbaccel.forkserver.guard import in_fork_server

_MAIN_KEYS = ("init_main_from_path", "init_main_from_name")
_prepare = multiprocessing.spawn.prepare


def _prepare_child(data: Mapping[str, Any]) -> None:
    if str(data.get("name", "")).startswith(RANK_PROCESS_PREFIX):
        data = {k: v for k, v in data.items() if k not in _MAIN_KEYS}
    _prepare(data)


if in_fork_server():
    multiprocessing.spawn.prepare = _prepare_child
