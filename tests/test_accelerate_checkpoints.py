"""``save_state`` folders move between nbaccel and Accelerate (the pinned test-only dependency)
both ways: the same file names, the same contents, and a run resumed from either library's
folder by either library continues bit for bit as Accelerate's own resume does.

Each library trains an epoch and saves (model with dropout, AdamW, a scheduler, a registered
object, a shuffled loader); then each library resumes from both folders and trains another
epoch, on 1 and on 2 processes.
"""

from __future__ import annotations

import copy

import pytest
import torch

import nbaccel
from tests.side_by_side import run_as

pytest.importorskip("accelerate")


class Counter:
    """A registered object (Accelerate's ``custom_checkpoint_<i>.pkl``)."""

    def __init__(self) -> None:
        self.steps = 0

    def state_dict(self) -> dict:
        return {"steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        self.steps = state["steps"]


def run(lib: str, save_to: str | None = None, resume_from: list[str] = ()) -> dict:
    """Train one epoch and save to ``save_to``; or, for each of ``resume_from``, build the
    same run, load that folder and train one more epoch. Returns this rank's losses."""
    import importlib

    from torch.utils.data import DataLoader, TensorDataset

    module = importlib.import_module(lib)
    utils = importlib.import_module(f"{lib}.utils")

    def build():
        utils.set_seed(7)
        acc = module.Accelerator(cpu=True)
        data = torch.Generator().manual_seed(0)
        x, y = torch.randn(32, 6, generator=data), torch.randn(32, 1, generator=data)
        model = torch.nn.Sequential(
            torch.nn.Linear(6, 8), torch.nn.Dropout(0.2), torch.nn.Linear(8, 1)
        )
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        loader = DataLoader(TensorDataset(x, y), batch_size=4, shuffle=True)
        counter = Counter()
        acc.register_for_checkpointing(counter)
        return acc, counter, *acc.prepare(model, opt, sched, loader)

    def epoch(acc, counter, model, opt, sched, loader) -> list[float]:
        losses = []
        for xb, yb in loader:
            loss = torch.nn.functional.mse_loss(model(xb), yb)
            acc.backward(loss)
            opt.step()
            sched.step()
            opt.zero_grad()
            counter.steps += 1
            losses.append(loss.item())
        return losses

    out: dict = {}
    if save_to is not None:
        parts = build()
        out["first"] = epoch(*parts)
        parts[0].save_state(save_to)
        out["second"] = epoch(*parts)  # the run not interrupted
    for folder in resume_from:
        parts = build()
        parts[0].load_state(folder)
        out[folder] = {"losses": epoch(*parts), "counter": parts[1].steps}
    return out


def _launch(lib: str, processes: int, **kwargs) -> list[dict]:
    return run_as(lib, run, processes, **kwargs)


def _contents(folder) -> dict:
    """Every file of a checkpoint folder read back as plain values."""
    from safetensors.torch import load_file

    from nbaccel.training.file_reading import torch_load_with_numpy

    out = {}
    for file in sorted(folder.iterdir()):
        if file.suffix == ".safetensors":
            out[file.name] = load_file(file)
        elif file.name.startswith("custom_checkpoint_"):
            out[file.name] = torch.load(file, weights_only=False)  # a user's object's state
        else:
            out[file.name] = torch_load_with_numpy(file)
    return out


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if hasattr(a, "shape"):  # a NumPy generator's key array
        return (a == b).all()
    return a == b


@pytest.mark.slow  # real launches, both libraries
@pytest.mark.parametrize("processes", [1, 2])
def test_save_state_folders_move_both_ways(processes, tmp_path):
    folders = {lib: str(tmp_path / lib) for lib in ("nbaccel", "accelerate")}
    saved = {lib: _launch(lib, processes, save_to=folders[lib]) for lib in folders}
    assert saved["nbaccel"] == saved["accelerate"]  # the same first epoch (same seed)

    # The same files with the same contents; nbaccel adds where each loader is in its epoch.
    ours, theirs = (_contents(tmp_path / lib) for lib in ("nbaccel", "accelerate"))
    assert set(ours) - set(theirs) == {"dataloader_0.pt"}
    assert set(theirs) == set(ours) - {"dataloader_0.pt"}
    for name in theirs:
        assert _same(ours[name], theirs[name]), name

    resumed = {
        lib: _launch(lib, processes, resume_from=[folders["nbaccel"], folders["accelerate"]])
        for lib in folders
    }
    reference = [rank[folders["accelerate"]] for rank in resumed["accelerate"]]
    # The registered object came back: the saved epoch's steps, then one more epoch.
    assert reference[0]["counter"] == 2 * 32 // (4 * processes)
    for lib, folder in [
        ("nbaccel", folders["accelerate"]),  # nbaccel resumes Accelerate's folder as it does
        ("accelerate", folders["nbaccel"]),  # and Accelerate resumes nbaccel's as its own
    ]:
        assert [rank[folder] for rank in resumed[lib]] == reference, (lib, folder)
    # nbaccel's own resume also puts each loader back where it was in its epochs (the file
    # Accelerate's layout has no place for): exactly the run that was not interrupted. Without
    # it, Accelerate's several processes start the loader's first order again.
    ours = [rank[folders["nbaccel"]]["losses"] for rank in resumed["nbaccel"]]
    assert ours == [rank["second"] for rank in saved["nbaccel"]]
    assert (ours == [r["losses"] for r in reference]) == (processes == 1)


def _one_process_run(value: float):
    """A prepared model, optimizer, scheduler, loader and registered object in this process."""
    from torch.utils.data import DataLoader

    acc = nbaccel.Accelerator()
    model = torch.nn.Linear(2, 1, bias=False)
    torch.nn.init.constant_(model.weight, value)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    counter = Counter()
    acc.register_for_checkpointing(counter)
    loader = DataLoader(torch.arange(8.0).view(4, 2), batch_size=2, shuffle=True)
    return acc, counter, *acc.prepare(model, opt, sched, loader)


def _step(acc, counter, model, opt, sched, loader) -> None:
    for batch in loader:
        acc.backward(model(batch).sum())
        opt.step()
        sched.step()
        opt.zero_grad()
        counter.steps += 1
        break  # stop inside the epoch: the loader's position is saved too


def test_pytorch_model_bin_without_safe_serialization(tmp_path):
    parts = _one_process_run(1.0)
    parts[0].save_state(tmp_path / "ckpt", safe_serialization=False)
    names = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert "pytorch_model.bin" in names and "model.safetensors" not in names
    again = _one_process_run(5.0)
    again[0].load_state(tmp_path / "ckpt")
    assert again[2].weight.tolist() == [[1.0, 1.0]]


def test_folders_of_nbaccels_earlier_layout_still_load(tmp_path):
    """model_0.pt, optimizer_0.pt, ..., random_states_0.pt (nbaccel's own generator format)
    and accelerator.pt (scaler and accumulation step): what nbaccel wrote before it wrote
    Accelerate's names. Built here from a current save, file by file; both folders resume the
    same run."""
    import shutil

    from safetensors.torch import load_file

    from nbaccel.training.file_reading import torch_load_with_numpy
    from nbaccel.training.rng import capture_rng_state, restore_rng_states_file

    parts = _one_process_run(1.0)
    _step(*parts)
    current, legacy = tmp_path / "current", tmp_path / "legacy"
    parts[0].save_state(current)
    shutil.copytree(current, legacy)
    torch.save(load_file(legacy / "model.safetensors"), legacy / "model_0.pt")
    for new, old in [
        ("optimizer.bin", "optimizer_0.pt"),
        ("scheduler.bin", "scheduler_0.pt"),
        ("custom_checkpoint_0.pkl", "custom_0.pt"),
    ]:
        (legacy / new).rename(legacy / old)
    restore_rng_states_file(torch_load_with_numpy(legacy / "random_states_0.pkl"))
    torch.save(capture_rng_state(), legacy / "random_states_0.pt")
    torch.save({"precision": {}, "micro_step": 0}, legacy / "accelerator.pt")
    for name in ("model.safetensors", "random_states_0.pkl"):
        (legacy / name).unlink()

    resumed = []
    for folder in (current, legacy):
        again = _one_process_run(5.0)
        again[0].load_state(folder)
        assert again[1].steps == 1 and again[2].weight.tolist() == parts[2].weight.tolist()
        _step(*again)
        state = copy.deepcopy(again[3].state_dict())
        resumed.append([again[2].weight.detach().clone(), state, torch.rand(3)])
    assert _same(resumed[0], resumed[1])


def saved_models(lib: str, folder: str) -> None:
    """save_model of a model with tied weights: whole, sharded, and as .bin."""
    import importlib

    module = importlib.import_module(lib)
    acc = module.Accelerator(cpu=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False))
    model[1].weight = model[0].weight  # tied, as a language model's head
    model = acc.prepare(model)
    acc.save_model(model, f"{folder}/whole")
    acc.save_model(model, f"{folder}/sharded", max_shard_size=100)
    acc.save_model(model, f"{folder}/bin", safe_serialization=False)


@pytest.mark.slow  # real launches, both libraries
def test_save_model_writes_accelerates_files(tmp_path):
    import json

    from safetensors.torch import load_file

    for lib in ("nbaccel", "accelerate"):
        nbaccel.notebook_launcher(
            saved_models, args=(lib, str(tmp_path / lib)), num_processes=1, progress=False
        )
    for kind in ("whole", "sharded", "bin"):
        ours, theirs = tmp_path / "nbaccel" / kind, tmp_path / "accelerate" / kind
        names = sorted(p.name for p in theirs.iterdir())
        assert sorted(p.name for p in ours.iterdir()) == names, kind
        for name in names:  # the same tensors under the same names (a tied one stored once)
            if name.endswith(".json"):
                read = json.loads
                same = read((ours / name).read_text()) == read((theirs / name).read_text())
            elif name.endswith(".safetensors"):
                same = _same(load_file(ours / name), load_file(theirs / name))
            else:
                same = _same(torch.load(ours / name), torch.load(theirs / name))
            assert same, (kind, name)
