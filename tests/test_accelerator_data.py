"""Prepared DataLoaders shard every epoch disjointly, reshuffle without set_epoch, and
gather_for_metrics returns exactly the dataset; collectives and process control on 2 ranks."""

from __future__ import annotations

import io
import sys

import torch
from torch.utils.data import DataLoader, TensorDataset

import nbaccel


def shard_report(n: int, batch_size: int, shuffle: bool) -> dict:
    """Per epoch: the indices this rank saw, and the gathered-for-metrics indices."""
    from nbaccel import Accelerator, set_seed

    set_seed(0)
    acc = Accelerator()
    dl = acc.prepare(
        DataLoader(TensorDataset(torch.arange(n)), batch_size=batch_size, shuffle=shuffle)
    )
    epochs = []
    for _ in range(2):
        seen, metrics = [], []
        for (idx,) in dl:
            # On the device (a launched CPU process's is Accelerate's `cpu:0`; a CPU tensor's
            # device has no index, so the kinds are compared).
            assert idx.device.type == acc.device.type
            seen += idx.tolist()
            metrics.append(acc.gather_for_metrics(idx))
        epochs.append({"seen": seen, "metrics": torch.cat(metrics).tolist()})
    return {"len": len(dl), "epochs": epochs, "rank": acc.process_index}


def test_shards_are_disjoint_reshuffled_and_gather_for_metrics_is_exact():
    n = 23  # not divisible by 2 ranks x 4
    ranks = nbaccel.notebook_launcher(
        shard_report, args=(n, 4, True), num_processes=2, progress=False, return_all=True
    )
    assert [r["len"] for r in ranks] == [3, 3]  # len() is the per-rank number of batches
    orders = []
    for epoch in range(2):
        a, b = (r["epochs"][epoch]["seen"] for r in ranks)
        assert len(a) == len(b)  # even batches: both ranks take the same number of steps
        assert set(a) | set(b) == set(range(n))
        # Only the samples borrowed to fill the last step are seen twice.
        assert len(a) + len(b) - n == len(set(a) & set(b)) == 1
        for r in ranks:
            gathered = r["epochs"][epoch]["metrics"]
            assert len(gathered) == n and sorted(gathered) == list(range(n))
        orders.append(ranks[0]["epochs"][epoch]["seen"])
    assert orders[0] != orders[1]  # a new shuffle each epoch without set_epoch


def collectives() -> dict:
    from nbaccel import Accelerator

    acc = Accelerator()
    rank = acc.process_index
    t = torch.tensor([rank + 1.0])
    ragged = torch.ones(rank + 1, 2) * rank
    padded = acc.pad_across_processes(ragged, dim=0, pad_index=-1)
    out = io.StringIO()
    old, sys.stdout = sys.stdout, out
    try:
        acc.print("hello from", rank)
    finally:
        sys.stdout = old
    calls = []
    acc.on_main_process(lambda: calls.append(rank))()
    order = []
    with acc.main_process_first():
        order.append(rank)
    with acc.split_between_processes(list(range(5))) as part:
        mine = part
    return {
        "gather": acc.gather({"t": t})["t"].tolist(),
        "sum": acc.reduce(t, "sum").item(),
        "mean": acc.reduce(t, "mean").item(),
        "objects": acc.gather_object([{"rank": rank}]),
        "padded": acc.gather(padded).shape,
        "broadcast": acc.broadcast(torch.tensor([rank * 10])).item(),
        "printed": out.getvalue(),
        "calls": calls,
        "split": mine,
        "main": acc.is_main_process,
        "local_main": acc.is_local_main_process,
    }


def test_collectives_and_process_control():
    r0, r1 = nbaccel.notebook_launcher(
        collectives, num_processes=2, progress=False, return_all=True
    )
    for r in (r0, r1):
        assert r["gather"] == [1.0, 2.0]
        assert r["sum"] == 3.0 and r["mean"] == 1.5
        assert r["objects"] == [{"rank": 0}, {"rank": 1}]
        assert tuple(r["padded"]) == (4, 2)
        assert r["broadcast"] == 0
    assert r0["printed"] == "hello from 0\n" and r1["printed"] == ""
    assert r0["calls"] == [0] and r1["calls"] == []
    assert r0["split"] == [0, 1, 2] and r1["split"] == [3, 4]
    assert (r0["main"], r1["main"], r0["local_main"], r1["local_main"]) == (
        True,
        False,
        True,
        False,
    )


def test_dataloader_in_one_process_keeps_every_sample():
    report = shard_report(10, 4, False)  # in the kernel: one process, nothing duplicated
    assert report["len"] == 3
    assert report["epochs"][0]["seen"] == list(range(10))
    assert report["epochs"][1]["metrics"] == list(range(10))


def rng_after_epoch_start(rng_types: list[str] | None) -> float:
    from nbaccel import Accelerator

    acc = Accelerator(rng_types=rng_types)
    torch.manual_seed(100 + acc.process_index)  # ranks start out of step on purpose
    dl = acc.prepare(DataLoader(TensorDataset(torch.arange(4)), batch_size=1))
    next(iter(dl))
    return torch.rand(1).item()


def test_rng_types_synchronise_global_generators_each_epoch():
    run = nbaccel.notebook_launcher
    synced = run(
        rng_after_epoch_start, args=(["torch"],), num_processes=2, return_all=True, progress=False
    )
    assert synced[0] == synced[1]
    apart = run(
        rng_after_epoch_start, args=(None,), num_processes=2, return_all=True, progress=False
    )
    assert apart[0] != apart[1]  # the default ("generator") leaves per-rank randomness alone
