"""IterableDataset loaders on 2 real gloo ranks, once with nbaccel and once with Accelerate:
every rank takes as many steps with batches of the same size, and ``gather_for_metrics`` gives
back exactly the stream (an uneven last step is padded, then the padding dropped)."""

from __future__ import annotations

import importlib

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

import nbaccel

pytest.importorskip("accelerate")
pytestmark = pytest.mark.slow  # real 2-rank launches
LIBS = ["nbaccel", "accelerate"]


class Stream(IterableDataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        return iter(torch.arange(self.n))


def run(lib: str, n: int, drop_last: bool):
    acc = importlib.import_module(lib).Accelerator(cpu=True)
    dl = acc.prepare(DataLoader(Stream(n), batch_size=4, drop_last=drop_last))
    sizes, metrics = [], []
    for _ in range(2):  # two epochs: the loader starts over cleanly
        for x in dl:
            sizes.append(len(x))
            metrics += acc.gather_for_metrics(x).tolist()
    return sizes, metrics


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize(("n", "drop_last"), [(17, False), (21, False), (17, True)])
def test_iterable_dataset_even_steps_and_exact_metrics(lib, n, drop_last):
    ranks = nbaccel.notebook_launcher(
        run, args=(lib, n, drop_last), num_processes=2, return_all=True, progress=False
    )
    (sizes0, metrics0), (sizes1, metrics1) = ranks
    assert sizes0 == sizes1  # same steps, same batch sizes: no rank waits alone in a collective
    kept = list(range(16 if drop_last else n))
    assert metrics0 == metrics1 == kept + kept
