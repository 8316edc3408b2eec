"""Each rank's batches are Accelerate's: the same samples on the same rank in the same order,
the same padding, the same ``len`` and ``remainder`` (what ``gather_for_metrics`` keeps).

Both libraries' ``prepare_data_loader`` take ``num_processes``/``process_index``, so rank r of N
is built in this one process for each library and compared (no process group is needed to
deal batches: every rank computes the same plan). Shuffled loaders draw their shuffle seed
from torch's global RNG at ``prepare``, so each build starts from the same ``manual_seed``.
Real multi-rank runs of the same rules are in ``test_accelerate_even_batches.py``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, SequentialSampler

from nbaccel.training import sharding
from nbaccel.training.data_compat import prepare_data_loader as nbaccel_prepare

accelerate_data_loader = pytest.importorskip("accelerate.data_loader")

EPOCHS = 2


@pytest.fixture(autouse=True)
def _without_hf_datasets(monkeypatch):
    # Accelerate asks the package metadata whether `datasets` is installed on every
    # prepare_data_loader (only to shard its IterableDatasets, never these map-style ones):
    # most of this grid's time. The answer cannot change what these loaders are dealt.
    monkeypatch.setattr(accelerate_data_loader, "is_datasets_available", lambda: False)


class Indices(torch.utils.data.Dataset):
    """Sample i is i; a list of indices (a BatchSampler used as ``sampler``) fetches them all."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: Any) -> torch.Tensor:
        return torch.tensor(index)


def rank_view(
    prepare: Callable[..., Any], make: Callable[[], DataLoader], world: int, rank: int, **kw: Any
) -> dict[str, Any]:
    """What rank ``rank`` of ``world`` gets from ``prepare(make())``: its batches for two
    epochs, its ``len`` and the ``remainder`` seen during its last batch."""
    torch.manual_seed(1234)
    loader = prepare(make(), num_processes=world, process_index=rank, **kw)
    epochs, remainders = [], []
    for _ in range(EPOCHS):
        batches = []
        for batch in loader:
            batches.append(batch.tolist())
            remainder = loader.remainder
        epochs.append(batches)
        remainders.append(remainder if batches else None)
    return {"epochs": epochs, "len": len(loader), "remainder": remainders}


def both(make: Callable[[], DataLoader], world: int, **kw: Any) -> None:
    for rank in range(world):
        ours = rank_view(nbaccel_prepare, make, world, rank, **kw)
        theirs = rank_view(accelerate_data_loader.prepare_data_loader, make, world, rank, **kw)
        assert ours == theirs, (world, rank, kw)


SIZES = [1, 2, 5, 7, 16, 17, 38, 50]
BATCH_SIZES = [1, 3, 4, 8, 32, 64]
WORLDS = [2, 3, 4]


def grid(*flags: str) -> list[tuple[Any, ...]]:
    """Sizes x batch sizes x ranks x the flags, every combination."""
    values = [SIZES, BATCH_SIZES, WORLDS] + [[False, True]] * len(flags)
    return list(itertools.product(*values))


def test_the_notebook_cases_deal_as_accelerate():
    """The CV notebooks' shapes (38 and 50 samples, batch 64 and 32, 2 and 3 ranks, shuffled),
    every flag; the whole grid is below (slow)."""
    for n, bs, world, even, split_batches in itertools.product(
        [38, 50], [32, 64], [2, 3], [True, False], [False, True]
    ):
        if split_batches and bs % world:
            continue
        both(
            lambda n=n, bs=bs: DataLoader(range(n), batch_size=bs, shuffle=True),
            world,
            even_batches=even,
            split_batches=split_batches,
        )


@pytest.mark.slow  # ~2000 loaders per library
@pytest.mark.parametrize("shuffle", [False, True], ids=["sequential", "shuffled"])
def test_plain_loaders_deal_as_accelerate(shuffle):
    for n, bs, world, even, drop_last in grid("even", "drop_last"):
        both(
            lambda n=n, bs=bs, drop_last=drop_last: DataLoader(
                range(n), batch_size=bs, shuffle=shuffle, drop_last=drop_last
            ),
            world,
            even_batches=even,
        )


@pytest.mark.slow  # ~1000 loaders per library
@pytest.mark.parametrize("shuffle", [False, True], ids=["sequential", "shuffled"])
def test_split_batches_as_accelerate(shuffle):
    for n, bs, world, even, drop_last in grid("even", "drop_last"):
        if bs % world:
            continue  # refused by both (tested below)
        both(
            lambda n=n, bs=bs, drop_last=drop_last: DataLoader(
                range(n), batch_size=bs, shuffle=shuffle, drop_last=drop_last
            ),
            world,
            even_batches=even,
            split_batches=True,
        )


@pytest.mark.slow  # ~4000 loaders per library
@pytest.mark.parametrize("as_sampler", [False, True], ids=["batch_sampler", "sampler"])
def test_batch_sampler_loaders_deal_as_accelerate(as_sampler):
    for n, bs, world, even, drop_last, shuffle in grid("even", "drop_last", "shuffle"):

        def make(n=n, bs=bs, drop_last=drop_last, shuffle=shuffle):
            generator = torch.Generator().manual_seed(n) if shuffle else None
            inner = RandomSampler(range(n), generator=generator) if shuffle else None
            batches = BatchSampler(inner or SequentialSampler(range(n)), bs, drop_last)
            if as_sampler:
                return DataLoader(Indices(n), sampler=batches, batch_size=None)
            return DataLoader(range(n), batch_sampler=batches)

        both(make, world, even_batches=even)
        # Accelerate refuses split_batches for a BatchSampler passed as `sampler` (the loader's
        # batch_sampler is None then); nbaccel splits it like any batch sampler.
        if bs % world == 0 and not as_sampler:
            both(make, world, even_batches=even, split_batches=True)


class ListedBatches:
    """A batch sampler of given batches, of any sizes (a bucketing sampler's shape)."""

    def __init__(self, batches: list[list[int]], batch_size: int | None) -> None:
        self.batches, self.batch_size, self.drop_last = batches, batch_size, False

    def __iter__(self):
        return iter([list(b) for b in self.batches])

    def __len__(self) -> int:
        return len(self.batches)


UNEVEN = [
    [[0, 1, 2], [3], [4, 5, 6], [7, 8, 9]],
    [[0, 1], [2, 3, 4, 5], [6]],
    [[0, 1, 2, 3], [4, 5], [6, 7, 8, 9], [10, 11, 12, 13], [14]],
    [[0], [1], [2]],
]


@pytest.mark.parametrize("batches", UNEVEN, ids=range(len(UNEVEN)))
def test_batch_samplers_of_uneven_sizes_as_accelerate(batches):
    """Short batches before the last, and batch samplers without a batch_size."""
    n = sum(len(b) for b in batches)
    for world, even, size in itertools.product(WORLDS, [False, True], [None, 4]):
        both(
            lambda size=size: DataLoader(range(n), batch_sampler=ListedBatches(batches, size)),
            world,
            even_batches=even,
        )
        if size is not None and size % world == 0:
            both(
                lambda size=size: DataLoader(range(n), batch_sampler=ListedBatches(batches, size)),
                world,
                even_batches=even,
                split_batches=True,
            )


def test_the_cv_notebook_case_fills_every_rank_from_the_start():
    """The case that made the CV notebooks differ: 38 samples, batch 64, 2 ranks."""
    ranks = sharding.deal([list(range(38))], 64, world=2, even=True, drop_last=False)
    assert ranks[0] == [list(range(38)) + list(range(26))]
    assert ranks[1] == [list(range(26, 38)) + list(range(38)) + list(range(14))]


def test_one_process_keeps_the_loaders_batches():
    loader = nbaccel_prepare(DataLoader(range(5), batch_size=2), num_processes=1, process_index=0)
    assert [b.tolist() for b in loader] == [[0, 1], [2, 3], [4]]


@pytest.mark.parametrize(
    ("batches", "split_batches", "drop_last", "expected", "remainder"),
    [
        # 7 samples in batches of 2 on 2 ranks: the last step has 3, each rank gets 2.
        ([[0, 1], [2, 3], [4, 5], [6]], False, False, [[[0, 1], [4, 5]], [[2, 3], [6, 0]]], 3),
        # drop_last: the loader yields no [6], and the incomplete group [4, 5] is dropped.
        ([[0, 1], [2, 3], [4, 5]], False, True, [[[0, 1]], [[2, 3]]], 4),
        ([[0, 1, 2, 3], [4, 5, 6]], True, False, [[[0, 1], [4, 5]], [[2, 3], [6, 0]]], 3),
        ([[0, 1, 2, 3], [4, 5]], True, False, [[[0, 1], [4]], [[2, 3], [5]]], 2),
    ],
)
def test_dispatching_splits_each_step_evenly(
    batches, split_batches, drop_last, expected, remainder
):
    # Accelerate's dispatcher needs a process group; test_accelerate_even_batches.py compares
    # it on real ranks. Here: the rule itself.
    assert sharding.dispatch(batches, 2, split_batches, drop_last) == (expected, remainder)


def test_split_batches_needs_a_batch_size_the_ranks_divide():
    with pytest.raises(
        ValueError, match=r"batch_size \(6\).*multiple of the number of processes \(4\)"
    ):
        nbaccel_prepare(
            DataLoader(range(8), batch_size=6), num_processes=4, process_index=0, split_batches=True
        )
