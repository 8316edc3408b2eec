"""Keep torch from hanging a rank at the end of training.

A gloo process group's C++ destructor joins its worker thread while the caller holds the GIL;
if that thread is still freeing the tensors of the last collective, it needs the GIL too, and
both wait forever. In practice: the user calls ``dist.destroy_process_group()``, returns, and
the DDP model freed with the function's locals drops the last reference to the group — the rank
hangs in ``~ProcessGroupGloo`` (seen here in about 1 of 6 runs on torch 2.13).

Ranks never need those destructors: they exit without interpreter teardown right after
reporting. So, inside ranks only, ``destroy_process_group`` keeps a reference to the groups it
destroys; their C++ objects then die with the process instead of in the user's frame.
"""

from __future__ import annotations

import functools
from typing import Any

_kept_alive: list[Any] = []


def keep_destroyed_process_groups_alive() -> None:
    """Patch ``torch.distributed.destroy_process_group`` in this process (idempotent)."""
    try:
        import torch.distributed as dist
    except ImportError:
        return
    if not dist.is_available():
        return
    c10d = dist.distributed_c10d
    original = c10d.destroy_process_group
    if getattr(original, "__nbaccel_keeps_groups__", False):
        return

    @functools.wraps(original)
    def destroy_process_group(group: Any = None) -> None:
        try:
            world = c10d._world
            _kept_alive.extend(list(world.pg_map) if group is None else [group])
        except AttributeError:  # another torch layout: the workaround is best effort
            pass
        original(group)

    destroy_process_group.__nbaccel_keeps_groups__ = True
    c10d.destroy_process_group = destroy_process_group
    dist.destroy_process_group = destroy_process_group
