"""Where nbaccel used to differ from Accelerate, it now behaves the same. Each test body runs on
2 real gloo ranks, once with ``nbaccel.Accelerator`` and once with ``accelerate.Accelerator``
(the pinned test-only dependency), and both must give the expected answer."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import nbaccel

pytest.importorskip("accelerate")
pytestmark = pytest.mark.slow  # real 2-rank launches
LIBS = ["nbaccel", "accelerate"]


def _accelerator(lib: str, **kwargs):
    import importlib

    return importlib.import_module(lib).Accelerator(cpu=True, **kwargs)


def loaders(lib: str):
    """Batch-sampler loaders, a BatchSampler as sampler, a seeded generator, reduce max."""
    from torch.utils.data import BatchSampler, SequentialSampler

    acc = _accelerator(lib)
    ten = TensorDataset(torch.arange(10))
    out = {}
    dl = acc.prepare(DataLoader(ten, batch_sampler=BatchSampler(SequentialSampler(ten), 4, False)))
    out["sizes"] = [len(x) for (x,) in dl]
    out["metrics"] = torch.cat([acc.gather_for_metrics(x) for (x,) in dl]).tolist()
    as_sampler = DataLoader(
        ten, sampler=BatchSampler(SequentialSampler(ten), 4, False), batch_size=None
    )
    dl = acc.prepare(as_sampler)
    out["sampler_sizes"] = [len(x) for (x,) in dl]
    out["sampler_metrics"] = torch.cat([acc.gather_for_metrics(x) for (x,) in dl]).tolist()
    g = torch.Generator().manual_seed(3)
    dl = acc.prepare(
        DataLoader(TensorDataset(torch.arange(16)), batch_size=8, shuffle=True, generator=g)
    )
    out["epochs"] = [[acc.gather(x).tolist() for (x,) in dl] for _ in range(2)]
    out["max"] = acc.reduce(torch.tensor([1.0 + acc.process_index, 5.0 - acc.process_index]), "max")
    out["sum"] = acc.reduce(torch.tensor(1.0 + acc.process_index), "sum")
    return out


@pytest.mark.parametrize("lib", LIBS)
def test_loaders_and_reduce_behave_like_accelerate(lib):
    out = nbaccel.notebook_launcher(loaders, args=(lib,), num_processes=2, progress=False)
    # Every rank gets as many batches of the same size; the duplicates are dropped again.
    assert out["sizes"] == [4, 4]
    assert out["metrics"] == list(range(10))
    assert out["sampler_sizes"] == [4, 4]
    assert out["sampler_metrics"] == list(range(10))
    # 2 ranks x 8 == 1 process x 16 with the same seeded generator, epoch after epoch.
    g = torch.Generator().manual_seed(3)
    plain = DataLoader(TensorDataset(torch.arange(16)), batch_size=16, shuffle=True, generator=g)
    assert out["epochs"] == [[x.tolist() for (x,) in plain] for _ in range(2)]
    assert out["max"].tolist() == [2.0, 5.0]
    assert out["sum"].item() == 3.0


def random_batch_samplers(lib: str):
    """A user's BatchSampler(RandomSampler(...)), as batch_sampler and as sampler, on ranks
    whose global RNGs differ: each epoch must still deal every sample exactly once."""
    from torch.utils.data import BatchSampler, RandomSampler

    acc = _accelerator(lib)
    torch.manual_seed(100 + acc.process_index)
    ds = TensorDataset(torch.arange(16))
    out = {}
    for how in ("batch_sampler", "sampler"):
        batches = BatchSampler(RandomSampler(ds), 4, False)
        if how == "batch_sampler":
            dl = acc.prepare(DataLoader(ds, batch_sampler=batches))
        else:
            dl = acc.prepare(DataLoader(ds, sampler=batches, batch_size=None))
        out[how] = [torch.cat([acc.gather(x) for (x,) in dl]).tolist() for _ in range(2)]
    return out


@pytest.mark.parametrize("lib", LIBS)
def test_a_random_batch_sampler_is_shuffled_alike_on_every_rank(lib):
    out = nbaccel.notebook_launcher(
        random_batch_samplers, args=(lib,), num_processes=2, progress=False
    )
    for how, epochs in out.items():
        for order in epochs:
            assert sorted(order) == list(range(16)), (how, order)  # none twice, none missed
        assert epochs[0] != epochs[1], how  # and reshuffled each epoch


def control(lib: str, folder: str):
    """set_trigger on one rank, on_* decorators, gather_for_metrics of objects, even_batches
    off, split_batches, step_scheduler_with_optimizer=False, skip_first_batches."""
    import importlib

    mod = importlib.import_module(lib)
    utils = importlib.import_module(f"{lib}.utils")
    acc = _accelerator(lib, step_scheduler_with_optimizer=False)
    out = {"before": acc.check_trigger()}
    if acc.process_index == 1:
        acc.set_trigger()
    out["after"] = acc.check_trigger()
    out["again"] = acc.check_trigger()
    out["last"] = acc.on_last_process(lambda: acc.process_index)()
    out["on1"] = acc.on_process(process_index=1)(lambda: "one")()
    out["local_main"] = acc.on_local_main_process(lambda: "main")()
    words = [f"w{i}" for i in range(5)]
    dl = acc.prepare(DataLoader(words, batch_size=2))
    out["objects"] = [
        w for batch in dl for w in acc.gather_for_metrics(batch, use_gather_object=True)
    ]
    uneven = utils.DataLoaderConfiguration(even_batches=False)
    acc2 = mod.Accelerator(cpu=True, dataloader_config=uneven)
    dl = acc2.prepare(DataLoader(TensorDataset(torch.arange(5)), batch_size=2))
    out["uneven"] = [x.tolist() for (x,) in dl]
    split = utils.DataLoaderConfiguration(split_batches=True)
    acc3 = mod.Accelerator(cpu=True, dataloader_config=split)
    dl = acc3.prepare(DataLoader(TensorDataset(torch.arange(8)), batch_size=4))
    out["split"] = [x.tolist() for (x,) in dl]
    model = torch.nn.Linear(1, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
    model, opt, sched = acc.prepare(model, opt, sched)
    sched.step()
    out["lr"] = sched.get_last_lr()[0]  # stepped once, not num_processes times
    dl = acc.prepare(DataLoader(TensorDataset(torch.arange(12)), batch_size=2))
    out["skipped"] = [x.tolist() for (x,) in acc.skip_first_batches(dl, 2)]
    return out


@pytest.mark.parametrize("lib", LIBS)
def test_process_control_behaves_like_accelerate(lib, tmp_path):
    outs = nbaccel.notebook_launcher(
        control, args=(lib, str(tmp_path)), num_processes=2, progress=False, return_all=True
    )
    for rank, out in enumerate(outs):
        assert (out["before"], out["after"], out["again"]) == (False, True, False)
        assert out["last"] == (1 if rank == 1 else None)
        assert out["on1"] == ("one" if rank == 1 else None)
        assert out["local_main"] == ("main" if rank == 0 else None)
        assert out["objects"] == ["w0", "w1", "w2", "w3", "w4"]
        assert out["lr"] == 0.5
    assert outs[0]["uneven"] == [[0, 1], [4]] and outs[1]["uneven"] == [[2, 3]]
    assert outs[0]["split"] == [[0, 1], [4, 5]] and outs[1]["split"] == [[2, 3], [6, 7]]
    assert outs[0]["skipped"] == [[8, 9]] and outs[1]["skipped"] == [[10, 11]]


def loader_attributes(lib: str):
    """What loops read from a prepared DataLoader besides its batches (DataLoaderShard's)."""
    acc = _accelerator(lib)
    dl = acc.prepare(DataLoader(TensorDataset(torch.arange(16)), batch_size=4))
    ends = []
    for _ in dl:
        ends.append(dl.end_of_dataloader)
    uneven = acc.prepare(DataLoader(TensorDataset(torch.arange(18)), batch_size=4))
    return {
        "uneven_remainder": [uneven.remainder for _ in uneven][-1],
        "total_batch_size": dl.total_batch_size,
        "total_dataset_length": dl.total_dataset_length,
        "device": torch.device(dl.device).type,
        "ends": ends,
        "end_after_loop": dl.end_of_dataloader,
        "remainder": dl.remainder,
    }


@pytest.mark.parametrize("lib", LIBS)
def test_prepared_loader_attributes_are_accelerates(lib):
    outs = nbaccel.notebook_launcher(
        loader_attributes, args=(lib,), num_processes=2, progress=False, return_all=True
    )
    for out in outs:
        assert out == {
            "total_batch_size": 8,
            "total_dataset_length": 16,
            "device": "cpu",
            "ends": [False, True],
            "end_after_loop": True,
            "remainder": 0,
            "uneven_remainder": 2,  # 18 samples in steps of 8: the last step has 2
        }


def device_and_reduce(lib: str) -> dict:
    """What a launched process prints for its device, and reduce with a scale (which
    Accelerate applies on XLA devices only)."""
    import warnings

    acc = _accelerator(lib)
    t = torch.tensor([1.0, 2.0]) * (acc.process_index + 1)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        scaled = acc.reduce(t, "sum", scale=2.0).tolist()
    return {"device": repr(acc.device), "scaled": scaled}


@pytest.mark.parametrize("processes", [1, 2])
def test_device_and_reduce_scale_are_accelerates(processes):
    outs = {
        lib: nbaccel.notebook_launcher(
            device_and_reduce,
            args=(lib,),
            num_processes=processes,
            progress=False,
            return_all=True,
            env={"ACCELERATE_USE_CPU": "true"} if lib == "accelerate" else {},
        )
        for lib in LIBS
    }
    assert outs["nbaccel"] == outs["accelerate"]
    assert outs["nbaccel"][0]["device"] == "device(type='cpu', index=0)"  # launched: cpu:0


def test_a_plain_process_is_on_cpu_as_with_accelerate():
    import subprocess
    import sys

    script = (
        "import importlib, sys; lib = importlib.import_module(sys.argv[1]); "
        "print(repr(lib.Accelerator(cpu=True).device))"
    )
    printed = {
        lib: subprocess.run(
            [sys.executable, "-c", script, lib], capture_output=True, text=True, check=True
        ).stdout.strip()
        for lib in LIBS
    }
    assert printed["nbaccel"] == printed["accelerate"] == "device(type='cpu')"


def test_reduce_says_when_it_ignores_scale():
    with pytest.warns(UserWarning, match=r"reduce\(scale=2.0\) is ignored.*XLA devices only"):
        out = nbaccel.Accelerator(cpu=True).reduce(torch.tensor([1.0, 2.0]), scale=2.0)
    assert out.tolist() == [1.0, 2.0]


def process_group_options(lib: str, rendezvous: str) -> tuple:
    """InitProcessGroupKwargs with an init_method and a backend: both reach the process group."""
    import importlib
    import os

    import torch.distributed as dist

    utils = importlib.import_module(f"{lib}.utils")
    options = utils.InitProcessGroupKwargs(backend="gloo", init_method=f"file://{rendezvous}")
    acc = _accelerator(lib, kwargs_handlers=[options])
    return dist.get_backend(), os.path.exists(rendezvous), acc.reduce(torch.tensor(1.0)).item()


def test_init_process_group_kwargs_reach_the_process_group(tmp_path):
    outs = {
        lib: nbaccel.notebook_launcher(
            process_group_options,
            args=(lib, str(tmp_path / f"{lib}-rendezvous")),
            num_processes=2,
            progress=False,
            return_all=True,
            env={"ACCELERATE_USE_CPU": "true"} if lib == "accelerate" else {},
        )
        for lib in LIBS
    }
    assert outs["nbaccel"] == outs["accelerate"] == [("gloo", True, 2.0)] * 2
