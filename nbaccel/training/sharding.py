"""Which indices each rank loads in an epoch: the plan behind a prepared DataLoader.

Every rank computes the same epoch order and keeps its own slice, so rank r's batch k is the
r-th part of what one process with a ``world`` times larger batch sees at step k (that is what
makes N-rank and 1-process training match). The order comes from the loader's own ``generator``
when it has one (kept in step on every rank, and drawn exactly as a plain DataLoader draws it, so
a seeded generator gives the same global order as without nbaccel). A RandomSampler without one
draws from torch's global RNG where Accelerate's does, so ``set_seed`` gives the same run with
either library: on N > 1 processes one draw at ``prepare`` seeds a generator that then runs on
over the epochs (kept in step like a user's); on one process the sampler draws each epoch, as
plain torch does. With ``DataLoaderConfiguration(data_seed=s)`` epoch ``e`` shuffles with
``s + e`` instead. Loaders built with a ``batch_sampler`` (or a BatchSampler as
``sampler``) are dealt out batch by batch like Accelerate's ``BatchSamplerShard``: with
``even_batches`` every rank gets as many batches of the same size, padded from the start of the
epoch, and ``remainder`` tells ``gather_for_metrics`` how many gathered samples are real.

>>> plan = plan_batches([[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]], 4, world=2, rank=0, even=True)
>>> plan.batches, plan.remainder
([[0, 1, 2, 3], [8, 9, 0, 1]], 2)
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, SequentialSampler


@dataclasses.dataclass
class EpochPlan:
    batches: list[Any]
    remainder: int | None  # real samples in the last global step when it was padded


def plan_epoch(
    order: list[int], per_rank: int, world: int, rank: int, drop_last: bool, even: bool
) -> EpochPlan:
    """This rank's batches of indices for one epoch of ``order`` cut into global steps of
    ``per_rank * world`` samples (``split_batches`` passes ``batch_size // world``)."""
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
    return EpochPlan(batches, remainder)


def plan_batches(
    batches: list[list[int]], batch_size: int | None, world: int, rank: int, even: bool
) -> EpochPlan:
    """Deal whole batches round-robin (batch i to rank i % world). With ``even``, a short last
    batch is completed and extra batches are added, from the epoch's first samples, until every
    rank has as many batches of ``batch_size`` (Accelerate's BatchSamplerShard rule)."""
    real = sum(len(b) for b in batches)
    dealt = [list(b) for b in batches]
    padded = False
    if even and dealt:
        first = [i for b in dealt[:world] for i in b] if batch_size else list(dealt[:world])
        short = dealt.pop() if batch_size and len(dealt[-1]) < batch_size else None
        pool = first * (math.ceil(world * (batch_size or 1) / max(len(first), 1)) + 1)
        cursor = 0
        while short is not None or len(dealt) % world:
            padded = True
            if batch_size is None:
                dealt.append(pool[cursor % len(pool)])
                cursor += 1
                continue
            batch = short or []
            need = batch_size - len(batch)
            dealt.append(batch + pool[cursor : cursor + need])
            cursor += need
            short = None
    remainder = None
    if padded:
        steps = len(dealt) // world
        remainder = real - sum(len(b) for b in dealt[: (steps - 1) * world])
    return EpochPlan(dealt[rank::world], remainder)


def _sync_generator(generator: torch.Generator) -> None:
    """Give every rank the main process's generator state (Accelerate's synchronized
    generator), so all ranks draw the same epoch order."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        payload = [generator.get_state()]
        dist.broadcast_object_list(payload, src=0)
        generator.set_state(payload[0])


class SeedableRandomSampler(RandomSampler):
    """A RandomSampler whose order depends only on a seed and the epoch: epoch ``e`` shuffles
    with ``initial_seed + e``, where ``initial_seed`` is ``data_seed``, else torch's initial
    seed (what ``set_seed`` set). Every epoch that ends moves it to the next one.

    Example::

        sampler = SeedableRandomSampler(data_source=ds, data_seed=7)
        loader = DataLoader(ds, batch_size=8, sampler=sampler)   # same order on every rank
    """

    def __init__(self, *args: Any, data_seed: int | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.initial_seed = data_seed if data_seed is not None else torch.random.initial_seed()
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        if self.generator is None:
            self.generator = torch.Generator()
        self.generator.manual_seed(self.initial_seed + self.epoch)
        yield from super().__iter__()
        self.set_epoch(self.epoch + 1)


def _draw() -> int:
    """One 64-bit seed from torch's global RNG, drawn as torch's RandomSampler draws it."""
    return int(torch.empty((), dtype=torch.int64).random_().item())


def _unseeded_random(sampler: Any) -> bool:
    """A RandomSampler that would draw its order from each rank's global RNG (a
    SeedableRandomSampler orders itself from its seed and epoch)."""
    return (
        isinstance(sampler, RandomSampler)
        and not isinstance(sampler, SeedableRandomSampler)
        and sampler.generator is None
    )


class ShardedBatchSampler:
    """Yields this rank's index batches for ``epoch``, starting after ``skip`` batches."""

    def __init__(
        self, loader: DataLoader, state: Any, split: bool, even: bool, data_seed: int | None
    ):
        self.world, self.rank, self.even, self.split = (
            state.num_processes,
            state.process_index,
            even,
            split,
        )
        # A BatchSampler passed as `sampler` with batch_size=None yields whole batches too.
        self.items_are_batches = loader.batch_size is None and isinstance(
            loader.sampler, BatchSampler
        )
        if loader.batch_size is None:
            self.user_batch_sampler = (
                loader.sampler if self.items_are_batches else loader.batch_sampler
            )
        else:
            self.user_batch_sampler = None
        self.sampler = loader.sampler
        # What Accelerate's BatchSamplerShard calls `batch_sampler`: the batches it deals out
        # (a user's, or the loader's own BatchSampler over its sampler).
        self.batch_sampler = self.user_batch_sampler or loader.batch_sampler
        self.drop_last = loader.drop_last
        inner = getattr(self.user_batch_sampler, "sampler", self.sampler)
        self.generator = getattr(inner, "generator", None)
        self.data_seed = data_seed
        self.epoch_seed: int | None = None  # one process: what this epoch's shuffle drew
        self.resume_seed: int | None = None  # set by load_state_dict
        self.shuffles_alone = _unseeded_random(inner)
        if self.shuffles_alone and data_seed is None and self.world > 1:
            # Accelerate's draw at prepare: a generator for the shuffle, then in step on
            # every rank at each epoch's start and checkpointed, like a user's own.
            self.generator = torch.Generator()
            self.generator.manual_seed(_draw())
        self.loader_generator = loader.generator
        bs = loader.batch_size
        if bs is None and self.user_batch_sampler is None:
            raise ValueError(
                "this DataLoader has batch_size=None and no batch sampler, so it yields single "
                "samples; nbaccel shards batches: give it a batch_size or a batch_sampler."
            )
        if bs is not None and split and bs % self.world:
            raise ValueError(
                f"split_batches=True needs the DataLoader's batch_size ({bs}) to be a multiple "
                f"of the number of processes ({self.world}); change batch_size or use "
                "split_batches=False (each rank then loads batches of that size)."
            )
        self.per_rank = None if bs is None else (bs // self.world if split else bs)
        self.seed, self.epoch, self.skip = data_seed or 0, 0, 0
        self.remainder: int | None = None
        self.epoch_state: torch.Tensor | None = None  # the generator where this epoch started
        self.resume_state: torch.Tensor | None = None  # set by load_state_dict

    @property
    def even_batches(self) -> bool:
        """Accelerate's name for ``even``."""
        return self.even

    @even_batches.setter
    def even_batches(self, value: bool) -> None:
        self.even = value

    @property
    def batch_size(self) -> int | None:
        return self.per_rank

    def _shuffle_generator(self) -> torch.Generator:
        """The generator an unseeded RandomSampler shuffles this epoch with (module docstring)."""
        if self.data_seed is not None:
            return torch.Generator().manual_seed(self.seed + self.epoch)
        if self.world > 1:
            return self.generator
        if self.resume_seed is not None:  # resuming this epoch: its draw was made already
            self.epoch_seed, self.resume_seed = self.resume_seed, None
        else:
            self.epoch_seed = _draw()
        return torch.Generator().manual_seed(self.epoch_seed)

    def _order(self) -> list[int]:
        sampler = self.sampler
        if self.shuffles_alone and self.user_batch_sampler is None:
            generator = self._shuffle_generator()
            sampler = RandomSampler(
                sampler.data_source,
                replacement=sampler.replacement,
                num_samples=sampler._num_samples,
                generator=generator,
            )
        elif not isinstance(sampler, SequentialSampler) and hasattr(sampler, "set_epoch"):
            sampler.set_epoch(self.epoch)
        return list(sampler)

    def _start_generator(self) -> None:
        """Put the shuffle's generator where this epoch starts: in step on every rank, then the
        draw a plain DataLoader makes for worker seeds, so the order matches one without nbaccel."""
        if self.generator is None:
            return
        if self.resume_state is not None:
            self.generator.set_state(self.resume_state)  # resuming this epoch
            self.resume_state = None
        else:
            _sync_generator(self.generator)
        self.epoch_state = self.generator.get_state()
        if self.loader_generator is not None:
            torch.empty((), dtype=torch.int64).random_(generator=self.loader_generator)

    @contextlib.contextmanager
    def _shared_shuffle(self, sampler: Any) -> Iterator[None]:
        """A user's batch sampler over a RandomSampler without a generator would draw from each
        rank's own global RNG, so ranks would deal different orders (samples twice or never):
        for this epoch it draws from the seed shared at ``prepare`` instead, as ``_order`` does."""
        if not self.shuffles_alone:
            yield
            return
        sampler.generator = self._shuffle_generator()
        try:
            yield
        finally:
            sampler.generator = None

    def plan(self) -> EpochPlan:
        if self.user_batch_sampler is not None:
            if hasattr(self.user_batch_sampler, "set_epoch"):
                self.user_batch_sampler.set_epoch(self.epoch)
            with self._shared_shuffle(getattr(self.user_batch_sampler, "sampler", None)):
                every = [list(b) for b in self.user_batch_sampler]
            size = getattr(self.user_batch_sampler, "batch_size", None)
            if self.split:
                return self._split_batches(every, size)
            return plan_batches(every, size, self.world, self.rank, self.even)
        order = self._order()
        return plan_epoch(order, self.per_rank, self.world, self.rank, self.drop_last, self.even)

    def _split_batches(self, every: list[list[int]], size: int | None) -> EpochPlan:
        """split_batches with a batch sampler: every batch is cut into one slice per rank."""
        if not size or size % self.world:
            raise ValueError(
                f"split_batches=True needs the batch sampler's batch_size ({size}) to be a "
                f"multiple of the number of processes ({self.world})."
            )
        per = size // self.world
        order = [i for b in every for i in b]
        return plan_epoch(order, per, self.world, self.rank, False, self.even)

    def __iter__(self) -> Iterator[list[int]]:
        self._start_generator()
        plan = self.plan()
        self.remainder = plan.remainder
        yield from plan.batches[self.skip :]

    def __len__(self) -> int:
        """Batches this rank gets per epoch, computed without drawing from any generator."""
        if self.user_batch_sampler is not None:
            m = len(self.user_batch_sampler)
            if self.split:
                return m
            if self.even:
                return math.ceil(m / self.world)
            return m // self.world + (1 if self.rank < m % self.world else 0)
        n = len(self.sampler)
        return len(
            plan_epoch(
                list(range(n)), self.per_rank, self.world, self.rank, self.drop_last, self.even
            ).batches
        )
