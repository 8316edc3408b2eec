"""Sharding a DataLoader over the ranks: disjoint per-rank batches, reshuffled every epoch,
even last batches, batches on the right device, and a position that checkpoints can resume.

Every rank computes the same epoch order (a shuffle seeded by a seed shared at ``prepare`` plus
the epoch number), cuts it into global steps and keeps its own slice. So rank r's batch k is
exactly the r-th part of what one process with a batch ``world`` times larger would see at step
k, which is what makes N-rank and 1-process training give the same weights.

>>> import torch
>>> from torch.utils.data import DataLoader
>>> plan = _plan_epoch(list(range(11)), per_rank=2, world=2, rank=1, drop_last=False,
...                    even=True)
>>> plan.batches, plan.remainder        # sample 0 is borrowed to even out the last step
([[2, 3], [6, 7], [10, 0]], 3)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset, RandomSampler, SequentialSampler

from nbaccel.training import ops
from nbaccel.training.random import synchronize_rng_states
from nbaccel.training.state import GradientState, ProcessState


@dataclasses.dataclass
class _EpochPlan:
    batches: list[list[int]]
    remainder: int | None  # real samples in the last global step when it was padded


def _plan_epoch(
    order: list[int],
    per_rank: int,
    world: int,
    rank: int,
    drop_last: bool,
    even: bool,
) -> _EpochPlan:
    """This rank's batches of indices for one epoch, given the epoch's order.

    With ``split_batches`` the caller passes ``per_rank = batch_size // world``; the global step
    is ``per_rank * world`` samples either way.
    """
    step = per_rank * world
    full = len(order) // step
    batches = [
        order[s * step + rank * per_rank : s * step + (rank + 1) * per_rank] for s in range(full)
    ]
    rest = order[full * step :]
    remainder = None
    if rest and not drop_last:
        if even:
            size = math.ceil(len(rest) / world)
            missing = size * world - len(rest)
            if missing:
                # Borrow samples from the start of the epoch so every rank gets the same batch
                # size; gather_for_metrics drops them again using `remainder`.
                rest = rest + [order[i % len(order)] for i in range(missing)]
                remainder = len(rest) - missing
            batches.append(rest[rank * size : (rank + 1) * size])
        else:
            mine = rest[rank * per_rank : (rank + 1) * per_rank]
            if mine:
                batches.append(mine)
    return _EpochPlan(batches, remainder)


class _ShardedBatchSampler:
    """Yields this rank's index batches for ``epoch``, starting after ``skip`` batches."""

    def __init__(self, loader: DataLoader, state: ProcessState, split: bool, even: bool, seed: int):
        self.sampler = loader.sampler
        self.user_batch_sampler = loader.batch_sampler if loader.batch_size is None else None
        self.drop_last = loader.drop_last
        self.world, self.rank, self.even, self.split = (
            state.num_processes,
            state.process_index,
            even,
            split,
        )
        bs = loader.batch_size
        if bs is not None and split and bs % self.world:
            raise ValueError(
                f"split_batches=True needs the DataLoader's batch_size ({bs}) to be a multiple "
                f"of the number of processes ({self.world}); change batch_size or use "
                "split_batches=False (each rank then loads batches of that size)."
            )
        self.per_rank = None if bs is None else (bs // self.world if split else bs)
        self.seed, self.epoch, self.skip = seed, 0, 0
        self.remainder: int | None = None

    def _order(self) -> list[int]:
        sampler = self.sampler
        if isinstance(sampler, RandomSampler):
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            sampler = RandomSampler(
                sampler.data_source,
                replacement=sampler.replacement,
                num_samples=sampler._num_samples,
                generator=generator,
            )
        elif not isinstance(sampler, SequentialSampler) and hasattr(sampler, "set_epoch"):
            sampler.set_epoch(self.epoch)
        return list(sampler)

    def plan(self) -> _EpochPlan:
        if self.user_batch_sampler is not None:
            if hasattr(self.user_batch_sampler, "set_epoch"):
                self.user_batch_sampler.set_epoch(self.epoch)
            every = [list(b) for b in self.user_batch_sampler]
            if self.even and every and len(every) % self.world:
                every += every[: self.world - len(every) % self.world]
            return _EpochPlan(every[self.rank :: self.world], None)
        return _plan_epoch(
            self._order(),
            self.per_rank,
            self.world,
            self.rank,
            self.drop_last,
            self.even,
        )

    def __iter__(self) -> Iterator[list[int]]:
        plan = self.plan()
        self.remainder = plan.remainder
        yield from plan.batches[self.skip :]

    def __len__(self) -> int:
        return len(self.plan().batches)


class PreparedDataLoader:
    """A DataLoader that yields this rank's share of every epoch, on the right device.

    ``len()`` is the number of batches this rank gets per epoch. Iterating it again starts the
    next epoch with a fresh shuffle, so ``set_epoch`` is never needed (it still works). Every
    other attribute (``dataset``, ``collate_fn``, ...) is the original loader's.

    Example::

        train_dl = accelerator.prepare(DataLoader(ds, batch_size=8, shuffle=True))
        for epoch in range(3):
            for x, y in train_dl:        # x, y already on accelerator.device
                ...
    """

    def __init__(
        self,
        loader: DataLoader,
        state: ProcessState,
        gradient_state: GradientState,
        *,
        split_batches: bool,
        even_batches: bool,
        device_placement: bool,
        seed: int,
        sync_rng: tuple[str, ...] = (),
    ) -> None:
        self.original = loader
        self._sync_rng = sync_rng
        self._state, self._gs, self._place = state, gradient_state, device_placement
        self._iterable = isinstance(loader.dataset, IterableDataset)
        self.epoch, self.position, self._skip = 0, 0, 0
        if self._iterable:
            self._sampler = None
            self._loader = loader
        else:
            self._sampler = _ShardedBatchSampler(loader, state, split_batches, even_batches, seed)
            # The loader's iterator draws a base seed (for worker seeds) when it starts; drawing
            # it from torch's global RNG would make a resumed run's dropout differ by one draw.
            self._generator = torch.Generator()
            self._loader = _rebuild(loader, self._sampler, self._generator)
        self.batch_size = self._sampler.per_rank if self._sampler else loader.batch_size

    def __getattr__(self, name: str) -> Any:
        if name in ("original", "_loader"):
            raise AttributeError(name)
        return getattr(self.original, name)

    def __len__(self) -> int:
        if self._sampler is None:
            return len(self.original) // self._state.num_processes
        return len(self._sampler)

    def set_epoch(self, epoch: int) -> None:
        """Start the next iteration at ``epoch`` (only for loops that count epochs themselves)."""
        self.epoch = epoch

    def state_dict(self) -> dict[str, int]:
        """Where this loader is: epoch, batches already yielded in it, and the shuffle seed."""
        seed = self._sampler.seed if self._sampler else 0
        return {"epoch": self.epoch, "position": self.position, "seed": seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume: the next iteration continues ``state['epoch']`` after ``state['position']``."""
        self.epoch, self._skip = int(state["epoch"]), int(state["position"])
        if self._sampler is not None:
            self._sampler.seed = int(state["seed"])

    def __iter__(self) -> Iterator[Any]:
        if self._sync_rng and self._skip == 0:
            synchronize_rng_states(self._sync_rng)
        if self._sampler is not None:
            self._sampler.epoch, self._sampler.skip = self.epoch, self._skip
            mix = (self._sampler.seed * 1_000_003 + self.epoch) * 1009 + self._state.process_index
            self._generator.manual_seed(mix % 2**63)
        source = self._loader if self._sampler else self._round_robin()
        self.position, self._skip = self._skip, 0
        total = len(self) if self._sampler is not None else None
        for batch in source:
            self.position += 1
            last = self.position == total
            self._gs.at_loader_end = last
            self._gs.remainder = self._sampler.remainder if last and self._sampler else None
            yield ops.send_to_device(batch, self._state.device) if self._place else batch
        self._gs.at_loader_end, self._gs.remainder = False, None
        self.epoch, self.position = self.epoch + 1, 0

    def _round_robin(self) -> Iterator[Any]:
        """Iterable datasets: every rank reads the stream and keeps every world-th batch; a last
        round that would not reach every rank is dropped so all ranks take the same steps."""
        world, rank = self._state.num_processes, self._state.process_index
        round_: list[Any] = []
        for batch in self._loader:
            round_.append(batch)
            if len(round_) == world:
                yield round_[rank]
                round_ = []


def _rebuild(
    loader: DataLoader, batch_sampler: _ShardedBatchSampler, generator: torch.Generator
) -> DataLoader:
    """The same loader (workers, collate, pinning) reading this rank's batches."""
    kwargs: dict[str, Any] = {
        "num_workers": loader.num_workers,
        "collate_fn": loader.collate_fn,
        "pin_memory": loader.pin_memory,
        "timeout": loader.timeout,
        "worker_init_fn": loader.worker_init_fn,
        "multiprocessing_context": loader.multiprocessing_context,
        "generator": generator,
        "persistent_workers": loader.persistent_workers,
    }
    if loader.num_workers > 0:
        kwargs["prefetch_factor"] = loader.prefetch_factor
    if getattr(loader, "pin_memory_device", ""):
        kwargs["pin_memory_device"] = loader.pin_memory_device
    return DataLoader(loader.dataset, batch_sampler=batch_sampler, **kwargs)


def shared_seed(loader: DataLoader) -> int:
    """A shuffle seed drawn from the loader's generator (else torch's), the same on every rank."""
    seed = torch.randint(0, 2**31 - 1, (1,), generator=loader.generator)
    return int(ops.broadcast(seed).item())
