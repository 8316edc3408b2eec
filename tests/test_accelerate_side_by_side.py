"""The same loop under nbaccel and under Accelerate (the pinned test-only dependency), on 2 real
gloo ranks and in a plain process, must give the same values: the gradient state's counters and
flags step by step (``accelerator.step``, ``end_of_dataloader``, ``remainder``, with a loop
nested in another and with ``sync_with_dataloader=False``), clipping inside ``accumulate()``
(the gradient norms and the weights), TensorBoard's files, what ``print(accelerator.state)``
shows, what ``gather_object``/``gather_for_metrics`` return for objects that are not lists,
``split_between_processes`` of dicts and strings, ``get_state_dict(unwrap=False)`` and
``save_model``'s shard files. Each check was a difference once; each test runs one launch per
library and compares everything that launch returns."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from tests.side_by_side import run_as

pytest.importorskip("accelerate")
pytestmark = pytest.mark.slow  # real 2-rank launches of both libraries


def _lists(value):
    """Tensors as lists (with their dtype), so results compare with ``==``."""
    if isinstance(value, torch.Tensor):
        return ("tensor", str(value.dtype), value.tolist())
    if isinstance(value, dict):
        return {k: _lists(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_lists(v) for v in value)
    return value


def accumulation(lib: str) -> dict:
    """A training loop with an evaluation loop inside it, accumulating over 3 micro-steps."""
    import importlib

    mod, utils = importlib.import_module(lib), importlib.import_module(f"{lib}.utils")
    utils.set_seed(0)
    acc = mod.Accelerator(cpu=True, gradient_accumulation_steps=3)
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    train = DataLoader(TensorDataset(torch.randn(22, 2), torch.randn(22, 1)), batch_size=2)
    evals = DataLoader(TensorDataset(torch.arange(6.0)), batch_size=2)
    model, opt, train, evals = acc.prepare(model, opt, train, evals)
    out: dict = {"state": repr(acc.state), "steps": []}
    gs = acc.gradient_state
    for x, y in train:
        for _ in evals:  # an evaluation between two steps
            pass
        out["steps"].append((acc.step, gs.end_of_dataloader, gs.remainder, str(gs)))
        with acc.accumulate(model):
            acc.backward(torch.nn.functional.mse_loss(model(x), y))
            opt.step()
            opt.zero_grad()
        out["steps"].append((acc.step, acc.sync_gradients, acc.optimizer_step_was_skipped))
    out["after"] = (acc.step, str(gs))
    out["weights"] = [p.detach().clone() for p in model.parameters()]
    acc.gradient_accumulation_steps = 4
    out["set_steps"] = (acc.gradient_accumulation_steps, gs.num_steps, str(gs))
    acc.free_memory()
    out["freed"] = (acc.step, acc.optimizer_step_was_skipped)

    # Accumulation groups that run on over the end of an epoch.
    plugin = utils.GradientAccumulationPlugin(
        num_steps=2, sync_with_dataloader=False, adjust_scheduler=False
    )
    acc = mod.Accelerator(cpu=True, gradient_accumulation_plugin=plugin)
    model = acc.prepare(torch.nn.Linear(2, 1))
    loader = acc.prepare(DataLoader(TensorDataset(torch.ones(10, 2)), batch_size=2))
    out["across_epochs"] = []
    for _ in range(2):
        for (x,) in loader:
            with acc.accumulate(model):
                model(x).sum().backward()
            out["across_epochs"].append((acc.step, acc.sync_gradients))
    out["plugin"] = str(acc.gradient_state)

    # Clipping at every micro-step, synced or not: Accelerate clips each time.
    utils.set_seed(0)
    acc = mod.Accelerator(cpu=True, gradient_accumulation_steps=2)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    data = TensorDataset(torch.randn(16, 3) * 5, torch.randn(16, 2))
    model, opt, loader = acc.prepare(model, opt, DataLoader(data, batch_size=2))
    out["clipped"] = []
    for x, y in loader:
        with acc.accumulate(model):
            acc.backward(torch.nn.functional.mse_loss(model(x), y))
            norm = acc.clip_grad_norm_(model.parameters(), 0.1)
            out["clipped"].append((norm, acc.clip_grad_value_(model.parameters(), 0.05)))
            opt.step()
            opt.zero_grad()
    out["clipped weights"] = [p.detach().clone() for p in model.parameters()]
    return _lists(out)


def test_accumulation_and_loader_state_match_accelerate():
    ours, theirs = (run_as(lib, accumulation, 2) for lib in ("nbaccel", "accelerate"))
    assert ours == theirs
    # What the comparison covers (so that a change to both cannot pass unnoticed):
    steps = ours[0]["steps"]
    assert steps[-2][:3] == (5, True, 2)  # the last batch, after an inner loop ended
    assert steps[-1][:2] == (0, True)  # it synced, and the count starts again
    assert ours[0]["state"].startswith("Distributed environment: DistributedType.MULTI_CPU")
    assert ours[0]["across_epochs"][2:4] == [(3, False), (4, True)]  # a group spans epochs
    assert all(norm is not None for norm, _ in ours[0]["clipped"])  # mid-group too


class _Stream(IterableDataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        return iter(torch.arange(float(self.n)))


class _SizedStream(_Stream):
    def __len__(self) -> int:
        return self.n


def streams(lib: str) -> dict:
    """IterableDataset loaders under dispatch_batches None/False and split_batches: each
    rank's batches, gather_for_metrics, the remainder, the end flags and len()."""
    import importlib

    mod, utils = importlib.import_module(lib), importlib.import_module(f"{lib}.utils")
    out = {}
    for dispatch in (None, False):
        for split in (False, True):
            for kind in (_Stream, _SizedStream):
                for n in (7, 12):
                    config = utils.DataLoaderConfiguration(
                        dispatch_batches=dispatch, split_batches=split
                    )
                    acc = mod.Accelerator(cpu=True, dataloader_config=config)
                    loader = acc.prepare(DataLoader(kind(n), batch_size=4))
                    seen = [
                        (x, acc.gather_for_metrics(x), acc.gradient_state.remainder) for x in loader
                    ]
                    size = len(loader) if kind is _SizedStream else None
                    ends = loader.end_of_dataloader
                    out[f"{dispatch} {split} {kind.__name__} {n}"] = (seen, size, ends)
    return _lists(out)


def test_iterable_loaders_deal_and_gather_as_accelerate():
    ours, theirs = (run_as(lib, streams, 2) for lib in ("nbaccel", "accelerate"))
    assert ours == theirs
    # split_batches cuts each batch of 4 in two; sharded samples pad from the start, unsized
    seen, size, _ = ours[0]["None True _SizedStream 7"]
    assert [x[2] for x, _, _ in seen] == [[0.0, 1.0], [4.0, 5.0]] and size == 2
    seen, _, _ = ours[1]["False False _Stream 12"]
    assert [x[2] for x, _, _ in seen] == [[4.0, 5.0, 6.0, 7.0], [0.0, 1.0, 2.0, 3.0]]


def gathering(lib: str, folder: str) -> dict:
    """gather_object/gather_for_metrics of objects, loaders' remainders, splitting, state
    dicts and shard files."""
    import copy
    import importlib
    import os

    mod, utils = importlib.import_module(lib), importlib.import_module(f"{lib}.utils")
    acc = mod.Accelerator(cpu=True)
    r = acc.process_index
    out: dict = {}
    for name, obj in {"tuple": ("a", r), "str": "ab", "dict": {"k": r}, "list": [{"k": r}]}.items():
        out[f"gather_object {name}"] = utils.gather_object(obj)
        out[f"objects {name}"] = acc.gather_for_metrics(obj, use_gather_object=True)
    out["mixed"] = acc.gather_for_metrics([torch.tensor([r]), "x"])
    for n in (7, 8):  # a stream: -1 until its last step, then that step's real samples
        loader = acc.prepare(DataLoader(_Stream(n), batch_size=2))
        out[f"stream {n}"] = [
            (acc.gradient_state.remainder, loader.remainder, acc.gather_for_metrics(x))
            for x in loader
        ]
    config = utils.DataLoaderConfiguration(dispatch_batches=True)
    dispatcher = mod.Accelerator(cpu=True, dataloader_config=config)
    loader = dispatcher.prepare(DataLoader(TensorDataset(torch.arange(11.0)), batch_size=3))
    out["dispatched"] = [
        (dispatcher.gradient_state.remainder, dispatcher.gather_for_metrics(x)) for (x,) in loader
    ]
    out["outside"] = (acc.gradient_state.remainder, acc.gradient_state.end_of_dataloader)
    ignored = mod.Accelerator(cpu=True, split_batches=True)  # Accelerate 1.x ignores it
    batches = ignored.prepare(DataLoader(TensorDataset(torch.arange(8.0)), batch_size=4))
    out["split_batches="] = [x for (x,) in batches]
    kinds = [isinstance(loader, DataLoader), type(loader).__name__, loader.__class__.__name__]
    counts = [loader.iteration]
    list(loader)
    loader.set_epoch(5)
    out["loader"] = (kinds, [*counts, loader.iteration])

    given = {"a": [1, 2, 3], "b": torch.arange(3), "c": "xyz"}
    with acc.split_between_processes(given, apply_padding=True) as part:
        out["split dict"] = (copy.deepcopy(part), part is given)
    with acc.split_between_processes("abc") as part:
        out["split str"] = part

    model = acc.prepare(torch.nn.Linear(3, 2))
    out["wrapped names"] = list(acc.get_state_dict(model, unwrap=False))
    out["names"] = list(acc.get_state_dict(model))

    torch.manual_seed(0)  # 1024, 256, 4096, 64, 128, 8 bytes
    layers = [torch.nn.Linear(4, 64), torch.nn.Linear(64, 16), torch.nn.Linear(16, 2)]
    net = acc.prepare(torch.nn.Sequential(*layers))
    acc.save_model(net, f"{folder}/shards", max_shard_size="1KB")
    tied = torch.nn.Sequential(torch.nn.Embedding(40, 4), torch.nn.Linear(4, 40, bias=False))
    tied[1].weight = tied[0].weight
    acc.save_model(
        acc.prepare(tied), f"{folder}/tied", max_shard_size=500, safe_serialization=False
    )
    acc.wait_for_everyone()
    for kind in ("shards", "tied"):
        path = f"{folder}/{kind}"
        files = sorted(os.listdir(path))
        index = [open(f"{path}/{f}").read() for f in files if f.endswith(".json")]
        out[kind] = (files, index)
    return _lists(out)


def test_gathering_splitting_and_saving_match_accelerate(tmp_path):
    ours, theirs = (
        run_as(lib, gathering, 2, folder=str(tmp_path / lib)) for lib in ("nbaccel", "accelerate")
    )
    assert ours == theirs
    assert ours[0]["gather_object str"] == ["a", "b", "a", "b"]
    assert ours[1]["split dict"] == (
        {"a": [3, 3], "b": ("tensor", "torch.int64", [2, 2]), "c": "xyz"},
        True,
    )
    assert ours[0]["stream 7"][-1][:2] == (3, 3) and ours[0]["stream 7"][0][:2] == (-1, -1)
    assert ours[0]["wrapped names"] == ["module.weight", "module.bias"]
    assert ours[0]["loader"] == ([True, "DataLoaderDispatcher", "DataLoader"], [1, 5])
    assert len(ours[0]["shards"][0]) == 4  # 3 shards and the index


def _plain(lib: str, folder: str) -> str:
    """What a plain process (no launcher: one process, DistributedType.NO) prints."""
    script = f"""
import torch, {lib} as lib
from {lib}.utils import gather_object, ProjectConfiguration
config = ProjectConfiguration({folder!r}, automatic_checkpoint_naming=True)
acc = lib.Accelerator(cpu=True, project_config=config)
print(acc.state)
print(acc.gradient_state)
items = ["a", "b"]
with acc.split_between_processes(items) as part:
    print(part is items)
print(gather_object("ab"), acc.gather_for_metrics(("a", 1)))
acc.prepare(torch.nn.Linear(1, 1))
acc.save_state()
acc.save_state()
acc.project_configuration.iteration = 0  # as a run resumed in a new process starts
acc.load_state()  # the newest, checkpoint_1
print("after load_state:", acc.save_iteration)
import os
from {lib}.utils import ProfileKwargs
with acc.profile(ProfileKwargs(activities=["cpu"], output_trace_dir={folder!r} + "/trace")):
    torch.ones(2) + 1
print(os.listdir({folder!r} + "/trace"))
for wrong in (lambda: acc.load_state({folder!r} + "/missing"), lambda: acc.register_for_checkpointing(1)):
    try:
        wrong()
    except ValueError as caught:  # what ported code catches
        print("ValueError")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_one_plain_process_prints_what_accelerate_prints(tmp_path):
    ours, theirs = (_plain(lib, str(tmp_path / lib)) for lib in ("nbaccel", "accelerate"))
    assert ours == theirs
    assert "after load_state: 0\n" in ours  # the save counter is the user's to set
    assert ours.endswith("['profile_0.json']\nValueError\nValueError\n")


def tracking(lib: str, folder: str):
    """log_with="tensorboard": a run's config and logged values of every kind, read back."""
    import glob
    import importlib
    import os

    import yaml
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = importlib.import_module(lib).Accelerator(
        cpu=True, log_with="tensorboard", project_dir=folder
    )
    acc.init_trackers("run", config={"lr": 0.1, "batch": 4, "name": "x"})
    for step in range(2):
        values = {
            "loss": 1.0 / (step + 1),
            "t": torch.tensor(2.0),
            "note": "text",
            "pair": {"a": 1},
        }
        acc.log(values, step=step)
    acc.end_training()
    if not acc.is_main_process:
        return None
    read = {}
    for events in sorted(glob.glob(f"{folder}/**/events.out*", recursive=True)):
        where = os.path.relpath(os.path.dirname(events), folder)
        if where.count("/") == 1 and where[4:5].isdigit():
            where = "run/<time>"  # add_hparams' own folder
        found = EventAccumulator(os.path.dirname(events))
        found.Reload()
        scalars = {
            t: [(e.step, e.value) for e in found.Scalars(t)] for t in found.Tags()["scalars"]
        }
        read[where] = (scalars, found.Tags()["tensors"])
    configs = [yaml.safe_load(open(f)) for f in glob.glob(f"{folder}/run/*/hparams.yml")]
    return read, configs


def test_tensorboard_tracking_writes_what_accelerate_writes(tmp_path):
    ours, theirs = (
        run_as(lib, tracking, 2, folder=str(tmp_path / lib))[0] for lib in ("nbaccel", "accelerate")
    )
    assert ours == theirs
    read, configs = ours
    assert read["run"][0]["loss"] == [(0, 1.0), (1, 0.5)] and read["run"][1] == [
        "note/text_summary"
    ]
    assert configs == [{"lr": 0.1, "batch": 4, "name": "x"}]


def local_sgd(lib: str) -> dict:
    """LocalSGD: ranks train apart (no gradient all-reduce) and average every 3 steps."""
    import importlib

    mod, utils = importlib.import_module(lib), importlib.import_module(f"{lib}.utils")
    LocalSGD = importlib.import_module(f"{lib}.local_sgd").LocalSGD
    utils.set_seed(0)
    acc = mod.Accelerator(cpu=True)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = TensorDataset(torch.randn(32, 3), torch.randn(32, 1))
    model, opt, loader = acc.prepare(model, opt, DataLoader(data, batch_size=2))
    weights = []
    with LocalSGD(acc, model, local_sgd_steps=3) as averaging:
        for x, y in loader:
            acc.backward(torch.nn.functional.mse_loss(model(x), y))
            opt.step()
            opt.zero_grad()
            averaging.step()
            weights.append(acc.unwrap_model(model).weight.detach().clone())
    final = acc.unwrap_model(model).weight.detach().clone()
    schedule = acc.prepare(torch.optim.lr_scheduler.StepLR(opt.optimizer, 1))
    kinds = (
        isinstance(opt, importlib.import_module(f"{lib}.optimizer").AcceleratedOptimizer),
        isinstance(schedule, importlib.import_module(f"{lib}.scheduler").AcceleratedScheduler),
    )
    return _lists(
        {"weights": weights, "final": final, "steps": averaging.num_steps, "kinds": kinds}
    )


def test_local_sgd_averages_as_accelerate():
    ours, theirs = (run_as(lib, local_sgd, 2) for lib in ("nbaccel", "accelerate"))
    assert ours == theirs
    assert ours[0]["weights"][2] == ours[1]["weights"][2]  # averaged at step 3
    assert ours[0]["weights"][0] != ours[1]["weights"][0]  # apart before
