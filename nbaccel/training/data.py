"""Sharding a DataLoader over the ranks: disjoint per-rank batches, reshuffled every epoch,
even last batches, batches on the right device, and a position that checkpoints can resume.

Which indices each rank gets is planned in ``sharding``; this module wraps the user's loader
around that plan, tracks the epoch and position, and says when the last batch comes
(``end_of_dataloader``, ``remainder``: the gradient state reads them from the loader being
iterated, for accumulation and ``gather_for_metrics``).

>>> from torch.utils.data import DataLoader
>>> from nbaccel.training.data_compat import prepare_data_loader
>>> loader = prepare_data_loader(DataLoader(range(5), batch_size=2), num_processes=2,
...                              process_index=1)
>>> [b.tolist() for b in loader]        # rank 1's last batch is filled from the start
[[2, 3], [1, 2]]
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import DataLoader, IterableDataset

from nbaccel.rank import reporting
from nbaccel.training import iterable, ops, xla
from nbaccel.training.accumulation import GradientState
from nbaccel.training.distributed import ProcessState

if TYPE_CHECKING:
    from nbaccel.training.partial_state import PartialState
from nbaccel.training.rng import synchronize_rng_states
from nbaccel.training.sharding import ShardedBatchSampler

__all__ = [
    "DataLoaderDispatcher",
    "DataLoaderShard",
    "PreparedDataLoader",
    "loader_class",
    "skip_first_batches",
]


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
        state: ProcessState | PartialState,  # the facts of this rank, either way
        gradient_state: GradientState,
        *,
        split_batches: bool,
        even_batches: bool,
        device_placement: bool,
        data_seed: int | None = None,
        sync_rng: tuple[str, ...] = (),
        non_blocking: bool = False,
    ) -> None:
        self.original = loader
        self._sync_rng, self._non_blocking = sync_rng, non_blocking
        self._state, self._gs, self._place = state, gradient_state, device_placement
        self._iterable = isinstance(loader.dataset, IterableDataset)
        self.epoch, self.position, self._skip = 0, 0, 0
        self._split = split_batches
        if self._iterable:
            self._sampler = None
            world, size = state.num_processes, loader.batch_size
            if split_batches and size is not None and size % world:
                raise ValueError(
                    f"split_batches=True needs the DataLoader's batch_size ({size}) to be a "
                    f"multiple of the number of processes ({world}); change batch_size or use "
                    "split_batches=False (each rank then loads batches of that size)."
                )
            if isinstance(self, DataLoaderDispatcher) or size is None:
                self._loader = loader
            else:  # dispatch_batches=False: Accelerate shards the samples, then batches them
                self._loader = _sample_shards(loader, world, state.process_index, split_batches)
        else:
            self._sampler = ShardedBatchSampler(
                loader,
                state,
                split_batches,
                even_batches,
                data_seed,
                dispatch=isinstance(self, DataLoaderDispatcher),
            )
            # The loader's iterator draws a base seed (for worker seeds) when it starts: from
            # the user's generator, else from torch's global RNG as torch and Accelerate do.
            # A resumed epoch made that draw before the checkpoint, so it draws from this one.
            self._generator = torch.Generator()
            self._loader = _rebuild(loader, self._sampler, self._generator)
        if self._sampler is not None:
            self.batch_size = self._sampler.per_rank
        elif split_batches and loader.batch_size is not None:
            self.batch_size = loader.batch_size // state.num_processes
        else:
            self.batch_size = loader.batch_size
        # Accelerate's DataLoaderShard state: whether the batch just yielded is the epoch's
        # last, and how many samples the last step has over all ranks (-1: unknown).
        self.end_of_dataloader, self.remainder = False, -1

    @property
    def total_batch_size(self) -> int | None:
        """Samples per step over all ranks (``batch_size`` times the number of processes; the
        batch sampler's size for a loader built with one)."""
        size = self.batch_size
        if self._sampler is not None and self._sampler.user_batch_sampler is not None:
            size = self._sampler.batch_sampler_size
            if size is not None and self._sampler.split:
                return size
        return None if size is None else size * self._state.num_processes

    @property
    def total_dataset_length(self) -> int | None:
        """The dataset's length, over all ranks (None for a stream without a length)."""
        try:
            return len(self.original.dataset)
        except TypeError:
            return None

    @property
    def device(self) -> torch.device | None:
        """Where batches are placed (None without device placement)."""
        return self._state.device if self._place else None

    def _last_step_size(self) -> int:
        """Samples in the epoch's last step over all ranks, 0 when steps divide the dataset
        (Accelerate's ``remainder``, which ``gather_for_metrics`` keeps of the last gather);
        -1 with ``drop_last`` or an unknown length."""
        length, total = self.total_dataset_length, self.total_batch_size
        if length is None or not total or self.original.drop_last:
            return -1
        return length % total

    @property
    def batch_sampler(self) -> Any:
        """What deals this rank its batches (Accelerate's ``BatchSamplerShard`` place): its
        ``batch_sampler`` is the loader's own, ``even_batches`` can be switched."""
        return self._sampler if self._sampler is not None else self.original.batch_sampler

    def __getattr__(self, name: str) -> Any:
        if name in ("original", "_loader"):
            raise AttributeError(name)
        return getattr(self.original, name)

    @property  # type: ignore[misc]
    def __class__(self) -> type:
        """The loader's class, so ``isinstance(loader, DataLoader)`` holds as for Accelerate's
        prepared loaders (its ``DataLoaderAdapter`` answers the same); ``type(loader)`` is
        still ``DataLoaderShard``/``DataLoaderDispatcher``."""
        return type(self.original)

    def __reduce_ex__(self, protocol: Any) -> Any:
        # pickle's default reads __class__ (the DataLoader's, above): rebuild by the real type.
        return (_restore, (type(self), self.__dict__))

    def __len__(self) -> int:
        if self._sampler is not None:
            return len(self._sampler)
        if self._loader is not self.original:  # sample shards: their loader's own count
            return len(self._loader)
        # as iterable.deal: a step per batch with split_batches, else per `world` batches, a
        # last incomplete step unless drop_last
        whole, world = len(self.original), self._state.num_processes
        if self._split:
            return whole
        return whole // world if self.original.drop_last else -(-whole // world)

    @property
    def even_batches(self) -> bool:
        """Whether the last batches are padded so every rank gets as many of the same size."""
        return self._sampler.even if self._sampler is not None else True

    @even_batches.setter
    def even_batches(self, value: bool) -> None:
        if self._sampler is not None:
            self._sampler.even = value

    def set_epoch(self, epoch: int) -> None:
        """Start the next iteration at ``epoch`` (only for loops that count epochs themselves)."""
        self.epoch = epoch

    @property
    def iteration(self) -> int:
        """The epoch the next iteration runs (Accelerate's name; settable, as ``set_epoch``)."""
        return self.epoch

    @iteration.setter
    def iteration(self, epoch: int) -> None:
        self.epoch = epoch

    def state_dict(self) -> dict[str, Any]:
        """Where this loader is: epoch, batches already yielded in it, the shuffle seed, and the
        loader's own generator as it was when the epoch started."""
        seed = self._sampler.seed if self._sampler is not None else 0
        state: dict[str, Any] = {"epoch": self.epoch, "position": self.position, "seed": seed}
        if self._sampler is not None and self._sampler.generator is not None:
            epoch_start = self._sampler.epoch_state if self.position else None
            state["generator"] = (
                epoch_start if epoch_start is not None else self._sampler.generator.get_state()
            )
        if self._sampler is not None and self._sampler.epoch_seed is not None and self.position:
            state["epoch_seed"] = self._sampler.epoch_seed  # one process: this epoch's draw
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume: the next iteration continues ``state['epoch']`` after ``state['position']``."""
        self.epoch, self._skip = int(state["epoch"]), int(state["position"])
        if self._sampler is not None:
            self._sampler.seed = int(state["seed"])
            if "generator" in state and self._sampler.generator is not None:
                self._sampler.resume_state = state["generator"]
            if "epoch_seed" in state:
                self._sampler.resume_seed = int(state["epoch_seed"])

    def __iter__(self) -> Iterator[Any]:
        if self._sync_rng and self._skip == 0:
            synchronize_rng_states(self._sync_rng)
        if self._sampler is not None:
            self._sampler.epoch, self._sampler.skip = self.epoch, self._skip
            mix = (self._sampler.seed * 1_000_003 + self.epoch) * 1009 + self._state.process_index
            self._generator.manual_seed(mix % 2**63)
            own = self.original.generator is not None or self._skip
            self._loader.generator = self._generator if own else None
        source = self._loader if self._sampler is not None else self._dealt(self._skip)
        self.end_of_dataloader, self.remainder = False, self._first_remainder()
        self.position, self._skip = self._skip, 0
        if not self._gs.iterating:  # an epoch: the step count's total, where that is progress
            total = len(self) if self._sampler is not None else None
            reporting.loader_started(total and total - self.position, self._gs.accumulation_steps)
        self._gs.iterating.append(self)
        try:
            yield from self._batches(source)
        finally:
            self._gs.iterating.remove(self)

    def _batches(self, source: Any) -> Iterator[Any]:
        for item in source:
            self.position += 1
            if self._sampler is not None:
                # The sampler planned the epoch before the loader fetched this first batch.
                batch, last = item, self.position == self._sampler.planned
                if last:
                    self._final_remainder()
            else:
                batch, last, remainder = item
                if last and remainder is not None:
                    self.remainder = remainder
            self.end_of_dataloader = last
            if self._place:
                batch = ops.send_to_device(batch, self._state.device, self._non_blocking)
            if self._state.device.type == "xla":
                xla.sync()  # one step, one XLA graph: cut before each batch (as MpDeviceLoader)
            yield batch
        if self._state.device.type == "xla":
            xla.sync()
        self.epoch, self.position = self.epoch + 1, 0

    def _first_remainder(self) -> int:
        """``remainder`` while an epoch runs, as Accelerate's loaders have it: the last step's
        size for a loader of a map-style dataset; -1 for one it would dispatch (its dataset has
        no ``batch_size``) and for a stream, which learn it at their last batch."""
        if self._loader is not self.original and self._sampler is None:
            # Accelerate's sample shards: their length over their batch size, which always
            # divides it (so 0: nothing cut), unless unknown or dropped.
            try:
                len(self.original.dataset)  # type: ignore[arg-type]
            except TypeError:
                return -1
            return -1 if self.original.drop_last else 0
        if isinstance(self, DataLoaderDispatcher) or self._sampler is None:
            return -1
        return self._last_step_size()

    def _final_remainder(self) -> None:
        """At the last batch: what ``gather_for_metrics`` keeps of the last step's gather, as
        Accelerate's ``remainder`` there: the step's real samples when dispatching, else the
        dataset's length modulo ``total_batch_size`` (0 or -1: keep everything)."""
        dispatched = self._sampler.remainder if self._sampler is not None else None
        if dispatched is not None:
            self.remainder = dispatched

    def _dealt(self, skip: int) -> Iterator[tuple[Any, bool, int | None]]:
        """Iterable datasets: every rank reads the stream and takes its even share of each
        ``world`` batches, the last step padded from the start (``iterable.deal``)."""
        world, rank = self._state.num_processes, self._state.process_index
        if self._loader is not self.original:  # already this rank's batches (sample shards)
            return itertools.islice(iterable.ahead(self._loader), skip, None)
        steps = iterable.deal(
            self._loader, world, rank, drop_last=self._loader.drop_last, split_batches=self._split
        )
        return itertools.islice(steps, skip, None)


class DataLoaderShard(PreparedDataLoader):
    """Accelerate's name for a prepared loader of a map-style dataset (each rank loads its
    own batches), so ``isinstance`` checks in ported code hold."""


class DataLoaderDispatcher(PreparedDataLoader):
    """Accelerate's name for a prepared loader it would dispatch from the main process
    (``dispatch_batches=True``, the default for an IterableDataset). nbaccel's ranks each read
    their share instead; the batches are the same."""


def _restore(cls: type[PreparedDataLoader], state: dict[str, Any]) -> PreparedDataLoader:
    """A pickled prepared loader, rebuilt (``PreparedDataLoader.__reduce_ex__``)."""
    loader = object.__new__(cls)
    loader.__dict__.update(state)
    return loader


def loader_class(loader: DataLoader, dispatch_batches: bool | None) -> type[PreparedDataLoader]:
    """Which of Accelerate's two kinds a prepared ``loader`` is."""
    if dispatch_batches is None:
        dispatch_batches = isinstance(loader.dataset, IterableDataset)
    return DataLoaderDispatcher if dispatch_batches else DataLoaderShard


def _sample_shards(loader: DataLoader, world: int, rank: int, split: bool) -> DataLoader:
    """The loader over this rank's samples of its stream (``iterable.SampleShard``), in
    batches of its share of a step, with the loader's workers, collate and pinning."""
    size = loader.batch_size
    assert size is not None
    shard = iterable.SampleShard(loader.dataset, size, loader.drop_last, world, rank, split)
    kwargs = _loader_settings(loader, loader.generator)
    return DataLoader(
        shard, batch_size=size // world if split else size, drop_last=loader.drop_last, **kwargs
    )


def _loader_settings(loader: DataLoader, generator: Any) -> dict[str, Any]:
    """What a loader built in ``loader``'s place keeps of it: workers, collate, pinning."""
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
    return kwargs


def _rebuild(
    loader: DataLoader, batch_sampler: ShardedBatchSampler, generator: torch.Generator
) -> DataLoader:
    """The same loader (workers, collate, pinning) reading this rank's batches."""
    kwargs = _loader_settings(loader, generator)
    if getattr(loader, "pin_memory_device", ""):
        kwargs["pin_memory_device"] = loader.pin_memory_device
    if batch_sampler.items_are_batches:
        # The user's BatchSampler was the `sampler` and batch_size None: each item is a batch of
        # indices the dataset fetches at once, and no collation adds a dimension.
        return DataLoader(loader.dataset, sampler=batch_sampler, batch_size=None, **kwargs)
    return DataLoader(loader.dataset, batch_sampler=batch_sampler, **kwargs)


class _SkipFirst:
    """A loader whose every epoch starts ``num_batches`` in (Accelerate's skip_first_batches)."""

    def __init__(self, loader: Any, num_batches: int) -> None:
        self.loader, self.num_batches = loader, num_batches

    def __getattr__(self, name: str) -> Any:
        if name == "loader":
            raise AttributeError(name)
        return getattr(self.loader, name)

    def __len__(self) -> int:
        return max(0, len(self.loader) - self.num_batches)

    def __iter__(self) -> Iterator[Any]:
        if isinstance(self.loader, PreparedDataLoader):
            # Replaces (not adds to) a position restored by load_state: ported Accelerate loops
            # call load_state and then skip_first_batches with the same number.
            self.loader._skip = self.num_batches
            return iter(self.loader)
        return itertools.islice(iter(self.loader), self.num_batches, None)


def skip_first_batches(dataloader: Any, num_batches: int = 0) -> Any:
    """A loader that skips the first ``num_batches`` batches of each epoch it runs.

    ``skip_first_batches(train_dl, 25)`` resumes an epoch interrupted after 25 batches.

    >>> import torch
    >>> loader = torch.utils.data.DataLoader(range(10), batch_size=2)
    >>> [batch.tolist() for batch in skip_first_batches(loader, 3)]
    [[6, 7], [8, 9]]
    """
    if isinstance(dataloader, _SkipFirst):
        dataloader = dataloader.loader
    return _SkipFirst(dataloader, num_batches)
