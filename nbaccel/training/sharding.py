"""Which indices each rank loads in an epoch: the plan behind a prepared DataLoader.

Every rank computes the same epoch of global batches (what the unprepared loader would yield
on one process) and keeps its own, by the rule of the Accelerate class the loader stands for:

- ``DataLoaderShard`` (the default for map-style datasets) deals the batches round-robin, batch
  ``i`` to rank ``i % world`` (:func:`deal`); with ``split_batches`` each batch is cut into one
  slice per rank instead (:func:`split`). With ``even_batches`` (the default) an incomplete last
  step is completed from the start of the epoch so every rank gets as many full batches:
  38 samples in batches of 64 on 2 ranks give 64 + 64, the first 26 and then 38 + 14 of them
  again. ``gather_for_metrics`` keeps the first ``len(dataset) % total_batch_size`` samples of
  the last step, as Accelerate's does.
- ``DataLoaderDispatcher`` (``dispatch_batches=True``) concatenates every ``world`` batches (or
  takes one, with ``split_batches``) and splits them evenly; an uneven last step is completed
  with the epoch's first samples, one per rank at most (:func:`dispatch`).
- On one process the loader's batches are kept as they are.

The order comes from the loader's own ``generator`` when it has one (kept in step on every rank,
and drawn exactly as a plain DataLoader draws it, so a seeded generator gives the same global
order as without nbaccel). A RandomSampler without one draws from torch's global RNG where
Accelerate's does, so ``set_seed`` gives the same run with either library: on N > 1 processes
one draw at ``prepare`` seeds a generator that then runs on over the epochs (kept in step like a
user's); on one process the sampler draws each epoch, as plain torch does, and so does the main
process alone when dispatching (only it iterates the sampler under Accelerate). With
``DataLoaderConfiguration(data_seed=s)`` epoch ``e`` shuffles with ``s + e`` instead.

>>> [deal([[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]], 4, world=2, even=True, drop_last=False)[r]
...  for r in range(2)]
[[[0, 1, 2, 3], [8, 9, 0, 1]], [[4, 5, 6, 7], [2, 3, 4, 5]]]
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, SequentialSampler

Batch = list[
    Any
]  # the indices of one batch (or, with batch_size=None, whatever the sampler yields)
PerRank = list[list[Batch]]  # rank -> its batches, in order


@dataclasses.dataclass
class EpochPlan:
    batches: list[Batch]  # this rank's, in order
    remainder: int | None  # dispatching: real samples in the last step (Accelerate's remainder)


def batches_of(order: Sequence[int], batch_size: int, drop_last: bool) -> list[Batch]:
    """``order`` cut into batches, as a DataLoader's BatchSampler cuts its sampler's indices.

    >>> batches_of(range(5), 2, drop_last=False), batches_of(range(5), 2, drop_last=True)
    ([[0, 1], [2, 3], [4]], [[0, 1], [2, 3]])
    """
    cuts = range(0, len(order), batch_size)
    every = [list(order[start : start + batch_size]) for start in cuts]
    if drop_last and every and len(every[-1]) < batch_size:
        every.pop()
    return every


def deal(
    batches: Sequence[Batch], batch_size: int | None, world: int, even: bool, drop_last: bool
) -> PerRank:
    """Each rank's batches under Accelerate's ``BatchSamplerShard`` (``split_batches=False``).

    A step is ``world`` consecutive batches; it is handed out (batch ``i`` to rank ``i % world``)
    when its last batch is full (``batch_size`` None: any size counts as full). What is left at
    the end: without ``even``, each rank keeps its batch of the unfinished step if it has one;
    with ``even``, full ones are kept, and the short last batch and the step's missing batches
    are filled from the samples of the first ``world`` batches, cycled. ``drop_last`` (the batch
    sampler's) drops what is left. ``batches`` are the unsharded loader's, in order.

    >>> deal([[0, 1], [2, 3], [4]], 2, world=2, even=False, drop_last=False)
    [[[0, 1], [4]], [[2, 3]]]
    """
    ranks: PerRank = [[] for _ in range(world)]

    def full(batch: Batch) -> bool:
        return batch_size is None or len(batch) == batch_size

    waiting: list[Batch | None] = [None] * world  # each rank's batch of the step under way
    for index, batch in enumerate(batches):
        waiting[index % world] = list(batch)
        if index % world == world - 1 and full(batch):
            for rank in range(world):
                ranks[rank].append(waiting[rank])  # type: ignore[arg-type]  # set this step
            waiting = [None] * world
    if batch_size is None:
        head: list[Any] = [list(b) for b in batches[:world]]
    else:
        head = [i for b in batches[:world] for i in b]
    if drop_last or not head:
        return ranks
    for rank, left in enumerate(waiting):
        if left and (not even or full(left)):
            ranks[rank].append(left)
    if not even:
        return ranks
    pool = head
    while len(pool) < world * (batch_size or 1):
        pool = pool + pool
    index, carry = len(batches) - 1, list(batches[-1])
    if full(carry):
        index, carry = index + 1, []
    cursor = 0
    while index % world or carry:
        if batch_size is None:
            filled, cursor = pool[cursor], cursor + 1
        else:
            end = cursor + batch_size - len(carry)
            filled, cursor = carry + pool[cursor:end], end
        ranks[index % world].append(filled)
        index, carry = index + 1, []
    return ranks


def split(
    batches: Sequence[Batch], batch_size: int, world: int, even: bool, drop_last: bool
) -> PerRank:
    """Each rank's batches under Accelerate's ``BatchSamplerShard`` with ``split_batches``:
    every full batch is cut into ``world`` slices of ``batch_size // world``. A short last batch
    is sliced as it is (ranks past its end get nothing) without ``even``; with ``even`` it is
    completed from the epoch's first batch (repeated if that is short too) before slicing.
    Short batches before the last are skipped; ``drop_last`` drops the short last one.

    >>> split([[0, 1, 2, 3], [4, 5, 6]], 4, world=2, even=True, drop_last=False)
    [[[0, 1], [4, 5]], [[2, 3], [6, 0]]]
    """
    per = batch_size // world
    ranks: PerRank = [[] for _ in range(world)]
    for batch in batches:
        if len(batch) == batch_size:
            for rank in range(world):
                ranks[rank].append(list(batch[rank * per : (rank + 1) * per]))
    if drop_last or not batches or not batches[0] or len(batches[-1]) >= batch_size:
        return ranks
    last = list(batches[-1])
    if even:
        pool = list(batches[0])
        while len(pool) < batch_size:
            pool = pool + pool
        last = last + pool
    for rank in range(world):
        if len(last) > rank * per:
            ranks[rank].append(last[rank * per : (rank + 1) * per])
    return ranks


def dispatch(
    batches: Sequence[Batch], world: int, split_batches: bool, drop_last: bool
) -> tuple[PerRank, int | None]:
    """Each rank's batches under Accelerate's ``DataLoaderDispatcher``, and the number of real
    samples in the last step. A step is ``world`` concatenated batches (one batch with
    ``split_batches``; without it, ``drop_last`` drops an incomplete last group), cut into
    ``world`` equal slices; a last step that does not divide is completed with the first
    step's first samples (unless ``drop_last``), so each rank gets one sample more.

    >>> dispatch([[0, 1], [2, 3], [4, 5], [6]], world=2, split_batches=False, drop_last=False)
    ([[[0, 1], [4, 5]], [[2, 3], [6, 0]]], 3)
    """
    if split_batches:
        steps = [list(b) for b in batches]
    else:
        steps = [
            [i for b in batches[s : s + world] for i in b] for s in range(0, len(batches), world)
        ]
        if drop_last and len(batches) % world:
            steps.pop()
    ranks: PerRank = [[] for _ in range(world)]
    for number, step in enumerate(steps):
        per = len(step) // world
        if number == len(steps) - 1 and len(step) % world and not drop_last:
            step, per = step + steps[0][:world], per + 1
        for rank in range(world):
            ranks[rank].append(step[rank * per : (rank + 1) * per])
    return ranks, (len(steps[-1]) if steps else None)


def shard_length(batches: int, world: int, rank: int, even: bool, drop_last: bool) -> int:
    """How many batches rank ``rank`` is dealt out of ``batches`` (``BatchSamplerShard``'s
    ``len``, which it computes without iterating)."""
    whole, left = divmod(batches, world)
    if not left or drop_last:
        return whole
    return whole + 1 if even or rank < left else whole


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


def _main_process_draw() -> int:
    """The main process's :func:`_draw`, on every rank; the others draw nothing, as under
    Accelerate's dispatcher, where only the main process iterates the sampler. (Without a
    process group, e.g. ``prepare_data_loader(num_processes=2, process_index=1)`` in one
    process, every rank draws for itself.)"""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return _draw()
    payload = [_draw() if dist.get_rank() == 0 else 0]
    dist.broadcast_object_list(payload, src=0)
    return int(payload[0])


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
        self,
        loader: DataLoader,
        state: Any,
        split: bool,
        even: bool,
        data_seed: int | None,
        dispatch: bool = False,
    ):
        self.world, self.rank, self.even, self.split = (
            state.num_processes,
            state.process_index,
            even,
            split,
        )
        self.dispatch = dispatch  # DataLoaderDispatcher's rule instead of BatchSamplerShard's
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
        # (`is None`, not truthiness: a BatchSampler of no batches, e.g. 1 sample with
        # drop_last, is falsy through its len.)
        self.batch_sampler: Any = (
            loader.batch_sampler if self.user_batch_sampler is None else self.user_batch_sampler
        )
        self.drop_last = loader.drop_last
        inner = getattr(self.user_batch_sampler, "sampler", self.sampler)
        self.generator = getattr(inner, "generator", None)
        self.data_seed = data_seed
        self.epoch_seed: int | None = None  # one process: what this epoch's shuffle drew
        self.resume_seed: int | None = None  # set by load_state_dict
        self.shuffles_alone = _unseeded_random(inner)
        if self.shuffles_alone and data_seed is None and self.world > 1 and not dispatch:
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
        self.loader_batch_size = bs
        self.per_rank = None if bs is None else (bs // self.world if split else bs)
        self.seed, self.epoch, self.skip = data_seed or 0, 0, 0
        self.remainder: int | None = None  # dispatching: real samples in the epoch's last step
        self.planned = 0  # batches this rank gets in the epoch under way
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
        if self.world > 1 and not self.dispatch:
            return self.generator
        if self.resume_seed is not None:  # resuming this epoch: its draw was made already
            self.epoch_seed, self.resume_seed = self.resume_seed, None
        elif self.dispatch and self.world > 1:
            self.epoch_seed = _main_process_draw()
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

    @property
    def batch_sampler_size(self) -> int | None:
        """The size of the batches that are dealt out: the loader's ``batch_size``, or its
        batch sampler's (None when that has none)."""
        if self.user_batch_sampler is not None:
            return getattr(self.user_batch_sampler, "batch_size", None)
        return self.loader_batch_size

    @property
    def batch_drop_last(self) -> bool:
        """Whether the batches dealt out end at the last full one (the batch sampler's)."""
        if self.user_batch_sampler is not None:
            return bool(getattr(self.user_batch_sampler, "drop_last", False))
        return self.drop_last

    def _global_batches(self) -> list[list[int]]:
        """This epoch's batches as the unprepared loader would yield them on one process."""
        if self.user_batch_sampler is not None:
            if hasattr(self.user_batch_sampler, "set_epoch"):
                self.user_batch_sampler.set_epoch(self.epoch)
            with self._shared_shuffle(getattr(self.user_batch_sampler, "sampler", None)):
                return [list(b) for b in self.user_batch_sampler]
        assert self.batch_sampler_size is not None  # __init__ refuses a loader without one
        return batches_of(self._order(), self.batch_sampler_size, self.drop_last)

    def plan(self) -> EpochPlan:
        every = self._global_batches()
        size, drop_last = self.batch_sampler_size, self.batch_drop_last
        if self.world == 1:  # Accelerate leaves a one-process loader as it is
            return EpochPlan(every, len(every[-1]) if self.dispatch and every else None)
        if self.dispatch:
            # The dispatcher ends with the loader's drop_last (a batch sampler's is its own).
            ranks, remainder = dispatch(every, self.world, self.split, self.drop_last)
            return EpochPlan(ranks[self.rank], remainder)
        if self.split:
            if not size or size % self.world:
                raise ValueError(
                    f"split_batches=True needs the batch sampler's batch_size ({size}) to be a "
                    f"multiple of the number of processes ({self.world})."
                )
            return EpochPlan(split(every, size, self.world, self.even, drop_last)[self.rank], None)
        return EpochPlan(deal(every, size, self.world, self.even, drop_last)[self.rank], None)

    def __iter__(self) -> Iterator[list[int]]:
        self._start_generator()
        plan = self.plan()
        self.remainder, self.planned = plan.remainder, len(plan.batches)
        yield from plan.batches[self.skip :]

    def __len__(self) -> int:
        """Batches this rank gets per epoch, computed without drawing from any generator
        (Accelerate's ``len`` of its ``BatchSamplerShard`` or ``DataLoaderDispatcher``)."""
        every = len(self.batch_sampler)
        if self.world == 1 or self.split:
            return every
        if self.dispatch:
            return every // self.world if self.drop_last else -(-every // self.world)
        return shard_length(every, self.world, self.rank, self.even, self.batch_drop_last)
