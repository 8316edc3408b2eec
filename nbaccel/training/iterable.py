"""Dealing an IterableDataset's batches out to the ranks, as Accelerate's default does for
iterable datasets (its ``DataLoaderDispatcher``): every ``world`` consecutive batches form one
global step, split evenly over the ranks; an incomplete last step is evened out with samples
from the start of the stream, and its number of real samples is reported so that
``gather_for_metrics`` drops the padding again. With the loader's ``drop_last`` an incomplete
last step is dropped; with ``split_batches`` a step is one batch, cut into equal slices. With
``dispatch_batches=False`` Accelerate shards the samples instead (its
``IterableDatasetShard``): :class:`SampleShard` does what it does.

Every rank reads the whole stream (it must be the same on every rank, as for Accelerate's
shards) and keeps its own part, so nothing is broadcast.

>>> import torch
>>> batches = [torch.arange(i, min(i + 4, 17)) for i in range(0, 17, 4)]
>>> [(b.tolist(), last, rest) for b, last, rest in deal(batches, world=2, rank=1)]
[([4, 5, 6, 7], False, None), ([12, 13, 14, 15], False, None), ([0], True, 1)]
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import IterableDataset

__all__ = ["SampleShard", "ahead", "deal"]


def deal(
    batches: Iterable[Any],
    world: int,
    rank: int,
    drop_last: bool = False,
    split_batches: bool = False,
) -> Iterator[tuple[Any, bool, int | None]]:
    """Yield ``(batch, is_last, remainder)`` for this rank; ``remainder`` is the number of real
    samples in the last global step (Accelerate's dispatcher's ``remainder`` there), else None.
    With ``split_batches`` a step is one batch, cut into ``world`` slices.

    Example::

        for batch, last, remainder in deal(loader, world=2, rank=0):
            ...
    """
    per_step = 1 if split_batches else world
    stream = iter(batches)
    first: Any = None  # the stream's first samples, to pad an uneven last step
    round_ = _take(stream, per_step)
    while round_:
        upcoming = _take(stream, per_step)
        last = not upcoming
        if len(round_) < per_step and drop_last:
            return
        sizes = [_size(b) for b in round_]
        if first is None:
            first = round_[0]
        done = sum(sizes) if last else None
        if not split_batches and len(round_) == world and len(set(sizes)) == 1:
            yield round_[rank], last, done
        else:  # one batch to split, or the last, incomplete step: concatenate, even out, split
            whole, real = _concat(round_), sum(sizes)
            per = -(-real // world)  # ceil: each rank's share
            while _size(whole) < per * world:
                whole = _concat([whole, _slice(first, 0, per * world - _size(whole))])
            yield _slice(whole, rank * per, (rank + 1) * per), last, done
        round_ = upcoming


def ahead(batches: Iterable[Any]) -> Iterator[tuple[Any, bool, None]]:
    """``(batch, is_last, None)`` for each batch: one read ahead tells the last."""
    stream = iter(batches)
    current = next(stream, _END)
    while current is not _END:
        upcoming = next(stream, _END)
        yield current, upcoming is _END, None
        current = upcoming


_END = object()


class SampleShard(IterableDataset):
    """What Accelerate's ``IterableDatasetShard`` gives a rank (``dispatch_batches=False``):
    the stream is read in chunks of ``batch_size * world`` samples (``batch_size`` with
    ``split_batches``), of which this rank takes its ``rank``-th contiguous part; a last,
    short chunk is filled up by repeating the first chunk (dropped with ``drop_last``).

    >>> [list(SampleShard(range(7), 2, False, world=2, rank=r)) for r in (0, 1)]
    [[0, 1, 4, 5], [2, 3, 6, 0]]
    """

    def __init__(
        self,
        dataset: Any,  # an IterableDataset (anything iterable)
        batch_size: int,
        drop_last: bool,
        world: int,
        rank: int,
        split_batches: bool = False,
    ) -> None:
        self.dataset, self.batch_size, self.drop_last = dataset, batch_size, drop_last
        self.world, self.rank, self.split_batches = world, rank, split_batches

    def __iter__(self) -> Iterator[Any]:
        chunk_size = self.batch_size if self.split_batches else self.batch_size * self.world
        mine = chunk_size // self.world
        start, stop = self.rank * mine, (self.rank + 1) * mine
        first: list[Any] | None = None
        chunk: list[Any] = []
        for sample in self.dataset:
            chunk.append(sample)
            if len(chunk) == chunk_size:
                yield from chunk[start:stop]
                first = first if first is not None else chunk
                chunk = []
        if chunk and not self.drop_last:
            first = first if first is not None else list(chunk)
            while len(chunk) < chunk_size:
                chunk += first
            yield from chunk[start:stop]

    def __len__(self) -> int:
        # Accelerate's count (batch_size * world per chunk, with split_batches too), which is
        # what its loader's len() reports.
        length, chunk = len(self.dataset), self.batch_size * self.world
        chunks = length // chunk if self.drop_last else -(-length // chunk)
        return chunks * self.batch_size


def _take(stream: Iterator[Any], count: int) -> list[Any]:
    out = []
    for batch in stream:
        out.append(batch)
        if len(out) == count:
            break
    return out


def _is_container(value: Any) -> bool:
    return isinstance(value, (torch.Tensor, Mapping, list, tuple))


def _size(batch: Any) -> int:
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.dim() else 1
    if isinstance(batch, Mapping):
        return _size(next(iter(batch.values())))
    if isinstance(batch, (list, tuple)):
        if batch and _is_container(batch[0]):
            return _size(batch[0])
        return len(batch)
    raise TypeError(_unsupported(batch))


def _concat(parts: list[Any]) -> Any:
    head = parts[0]
    if isinstance(head, torch.Tensor):
        return torch.cat(parts)
    if isinstance(head, Mapping):
        return _rebuild(head, {k: _concat([p[k] for p in parts]) for k in head})
    if isinstance(head, (list, tuple)):
        if head and _is_container(head[0]):  # fields of a collated batch: (x, y)
            return _rebuild(head, [_concat(list(col)) for col in zip(*parts, strict=True)])
        return [item for p in parts for item in p]  # a collated list of strings or numbers
    raise TypeError(_unsupported(head))


def _slice(batch: Any, start: int, stop: int) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch[start:stop]
    if isinstance(batch, Mapping):
        return _rebuild(batch, {k: _slice(v, start, stop) for k, v in batch.items()})
    if isinstance(batch, (list, tuple)):
        if batch and _is_container(batch[0]):
            return _rebuild(batch, [_slice(v, start, stop) for v in batch])
        return list(batch[start:stop])
    raise TypeError(_unsupported(batch))


def _rebuild(like: Any, values: Any) -> Any:
    """A container of ``like``'s type (dict, BatchEncoding, tuple, namedtuple) with ``values``."""
    if isinstance(like, Mapping):
        try:
            return type(like)(values)
        except TypeError:
            return dict(values)
    if isinstance(like, tuple) and hasattr(like, "_fields"):
        return type(like)(*values)
    return type(like)(values)


def _unsupported(batch: Any) -> str:
    return (
        f"an IterableDataset loader's last batches have different sizes and a batch of type "
        f"{type(batch).__name__} cannot be split evenly over the ranks. Yield tensors, or "
        "dicts/tuples/lists of tensors, or use DataLoader(..., drop_last=True)."
    )
