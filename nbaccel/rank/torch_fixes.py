"""Keep torch from hanging a rank at the end of training.

A gloo process group's C++ destructor joins its worker thread while the caller holds the GIL;
if that thread is still freeing the tensors of the last collective, it needs the GIL too, and
both wait forever. In practice: the user calls ``dist.destroy_process_group()``, returns, and
the DDP model freed with the function's locals drops the last reference to the group — the rank
hangs in ``~ProcessGroupGloo`` (seen here in about 1 of 6 runs on torch 2.13).

Ranks never need those destructors: they exit without interpreter teardown right after
reporting. So, inside ranks only, ``destroy_process_group`` keeps a reference to the groups it
destroys; their C++ objects then die with the process instead of in the user's frame. It also
keeps torch's group numbering going, so a group built after it takes fresh keys in the store.

And keep a rank that is done from failing the others. ``init_process_group`` returns on one
rank while another may still be connecting its gloo mesh to it (torch's barrier at the end of
it is off by default); a function that returns at once then exits under the other, which fails
("Connection closed by peer": 8 launches of 40 with 4 CPU ranks). So each rank counts its
built group in the group's store (:func:`count_built_process_groups`) and, as it leaves, waits
until every rank has built it, rank 0 (whose store the others use) until they have left
(:func:`leave_together`): never for a rank still training.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable
from typing import Any

_kept_alive: list[Any] = []
# Each default group this rank built, in order (ranks build them in step): store, rank, size
_built_in: list[tuple[Any, int, int]] = []


def keep_destroyed_process_groups_alive() -> None:
    """Patch ``torch.distributed.destroy_process_group`` in this process (idempotent)."""

    def wrap(original: Any, c10d: Any, dist: Any) -> Any:
        def destroy_process_group(group: Any = None) -> None:
            count = None
            try:
                world = c10d._world
                _kept_alive.extend(list(world.pg_map) if group is None else [group])
                count = world.group_count
            except AttributeError:  # another torch layout: the workaround is best effort
                pass
            original(group)
            if count is not None and c10d._world.group_count == 0:
                # torch numbers groups from 0 again, so a group built next would take the same
                # keys in the store, which rank 0 still serves: it met the old group's
                # addresses and hung. Every rank destroys and builds in step, so they agree.
                c10d._world.group_count = count

        return destroy_process_group

    _wrap_distributed("destroy_process_group", wrap)


def count_built_process_groups() -> None:
    """Patch ``torch.distributed.init_process_group`` in this process (idempotent): once the
    default group is built, count this rank in its store, for :func:`leave_together`."""

    def wrap(original: Any, c10d: Any, dist: Any) -> Any:
        def init_process_group(*args: Any, **kwargs: Any) -> None:
            original(*args, **kwargs)
            try:
                store = c10d._get_default_store()
                _built_in.append((store, dist.get_rank(), dist.get_world_size()))
                store.add(_key("built", len(_built_in)), 1)
            except Exception:  # noqa: BLE001 - no store (MPI), or a peer gone: nothing to count
                pass

        return init_process_group

    _wrap_distributed("init_process_group", wrap)


def _wrap_distributed(name: str, wrap: Callable[[Any, Any, Any], Any]) -> None:
    """Replace ``torch.distributed.<name>`` (and its ``distributed_c10d`` original) with
    ``wrap(original, c10d, dist)``, once per process; nothing where torch.distributed is not."""
    try:
        import torch.distributed as dist
    except ImportError:
        return
    if not dist.is_available():
        return
    c10d = dist.distributed_c10d
    original = getattr(c10d, name)
    if getattr(original, "__nbaccel_wrapped__", False):
        return
    wrapped: Any = functools.wraps(original)(wrap(original, c10d, dist))
    wrapped.__nbaccel_wrapped__ = True
    setattr(c10d, name, wrapped)
    setattr(dist, name, wrapped)


def leave_together(poll: float = 0.001) -> None:
    """As this rank leaves: wait until every rank has built the last default group this one
    built, so none is still connecting to it; then count out, and rank 0, which serves the
    store in a notebook launch, leaves only once the others have (their last use of it).

    It never waits for a rank that is still training, only for one still inside
    ``init_process_group``; ranks that fail there are stopped by the launcher, and an error of
    the store ends the wait. It looks every ``poll`` s (a round trip to rank 0's store, ~0.1
    ms): rank 0 leaves last, and the launch waits for it (5 ms looks cost 2.5 ms of it).
    """
    if not _built_in:
        return
    store, rank, world_size = _built_in[-1]
    ordinal = len(_built_in)
    try:
        _poll_until(store, _key("built", ordinal), world_size, poll)
        if rank == 0:
            _poll_until(store, _key("left", ordinal), world_size - 1, poll)
        else:
            store.add(_key("left", ordinal), 1)
    except Exception:  # noqa: BLE001 - a store gone (its host ended): nothing left to wait for
        return


def _poll_until(store: Any, key: str, count: int, poll: float) -> None:
    while store.add(key, 0) < count:
        time.sleep(poll)


def _key(counter: str, ordinal: int) -> str:
    """The store key counting the ranks that ``counter`` ("built", "left") their
    ``ordinal``-th default group (per attempt: torch elastic's store outlives a restart)."""
    return f"nbaccel/{counter}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{ordinal}"
