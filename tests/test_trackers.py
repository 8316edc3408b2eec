"""A docs-style Accelerate loop runs to the end under the launcher: log_with="all" (TensorBoard
event files read back), ProjectConfiguration(total_limit=2) checkpoints, save_model files loaded
back, DistributedDataParallelKwargs, pre-hooks; log() also reaches the dashboard. Missing
tracker packages warn instead of crashing."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

import nbaccel
from nbaccel.utils import GeneralTracker
from tests.test_reporting import RecordingView


def docs_loop(project: str):
    """The shape of Accelerate's tutorials, with only the import changed."""
    from torch.utils.data import DataLoader, TensorDataset

    from nbaccel import Accelerator
    from nbaccel.utils import DistributedDataParallelKwargs, ProjectConfiguration, set_seed

    set_seed(0)
    config = ProjectConfiguration(project, automatic_checkpoint_naming=True, total_limit=2)
    accelerator = Accelerator(
        log_with="all",
        project_config=config,
        kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=True)],
    )
    hooks = []
    accelerator.register_save_state_pre_hook(lambda models, weights, d: hooks.append(len(weights)))
    accelerator.register_load_state_pre_hook(lambda models, d: hooks.append(os.path.basename(d)))
    accelerator.init_trackers("run", config={"lr": 0.1, "epochs": 3})
    ds = TensorDataset(torch.randn(32, 4), torch.randn(32, 1))
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(ds, batch_size=4, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    step = 0
    for _epoch in range(3):
        for x, y in loader:
            loss = torch.nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            accelerator.log({"loss": loss.item()}, step=step)
            step += 1
        accelerator.save_state()
    accelerator.load_state()  # the newest automatically named checkpoint
    accelerator.wait_for_everyone()
    accelerator.save_model(model, os.path.join(project, "final"), max_shard_size="100B")
    writer = accelerator.get_tracker("tensorboard", unwrap=True)
    accelerator.end_training()
    state = {k: v.clone() for k, v in accelerator.get_state_dict(model).items()}
    return state, step, hooks, accelerator.save_iteration, type(writer).__name__


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None, reason="tensorboard missing")
def test_docs_style_loop_with_trackers_checkpoints_and_save_model(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from nbaccel.utils import load_checkpoint_in_model

    view = RecordingView()
    results = nbaccel.notebook_launcher(
        docs_loop, args=(str(tmp_path),), num_processes=2, view=view, return_all=True
    )
    state, steps, hooks, iteration, writer = results[0]
    assert steps == 12  # 32 samples / (2 ranks x 4) x 3 epochs
    assert writer == "SummaryWriter" and results[1][4] == "GeneralTracker"  # rank 1: none
    # ProjectConfiguration(total_limit=2): checkpoint_0 was removed, the newest two remain.
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["checkpoint_1", "checkpoint_2"]
    assert iteration == 3  # three saves; load_state leaves the counter alone (as Accelerate)
    assert hooks == [1, 1, 1, "checkpoint_2"]  # (models, one state dict per model, folder)
    # save_model: safetensors shards of at most 100 bytes plus an index, loadable into a model.
    files = sorted(os.listdir(tmp_path / "final"))
    assert "model.safetensors.index.json" in files and len(files) > 2
    fresh = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    load_checkpoint_in_model(fresh, str(tmp_path / "final"), strict=True)
    for key, value in fresh.state_dict().items():
        assert torch.equal(value, state[key]), key
    # TensorBoard: the event files hold every logged step, read back with tensorboard itself.
    events = EventAccumulator(str(tmp_path / "run"))
    events.Reload()
    loss = events.Scalars("loss")
    assert [e.step for e in loss] == list(range(12))
    # The dashboard got the values too (from every rank).
    for rank in (0, 1):
        assert "loss" in view.state.ranks[rank].metrics


class Recorder(GeneralTracker):
    name, requires_logging_directory = "recorder", False

    def __init__(self) -> None:
        super().__init__()
        self.calls: list = []

    tracker = property(lambda self: self.calls)

    def store_init_configuration(self, values: dict) -> None:
        self.calls.append(("config", values))

    def log(self, values: dict, step: int | None = None, **kwargs) -> None:
        self.calls.append(("log", values, step))

    def finish(self) -> None:
        self.calls.append(("finish",))


def test_custom_tracker_and_missing_packages_warn_not_crash(tmp_path):
    missing = [n for n in ("wandb", "mlflow", "comet_ml") if importlib.util.find_spec(n) is None]
    recorder = Recorder()
    wanted = [*missing, recorder]
    if missing:
        with pytest.warns(UserWarning, match="not installed"):
            acc = nbaccel.Accelerator(cpu=True, log_with=wanted, project_dir=str(tmp_path))
    else:
        acc = nbaccel.Accelerator(cpu=True, log_with=wanted, project_dir=str(tmp_path))
    acc.init_trackers("proj", config={"lr": 1})
    acc.log({"loss": torch.tensor(0.5)}, step=3)
    assert acc.get_tracker("recorder", unwrap=True) is recorder.calls
    acc.end_training()
    assert recorder.calls == [("config", {"lr": 1}), ("log", {"loss": 0.5}, 3), ("finish",)]
    with pytest.raises(ValueError, match="not a known tracker"):
        nbaccel.Accelerator(cpu=True, log_with="nope")
    with pytest.raises(ValueError, match="needs a folder"):
        nbaccel.Accelerator(cpu=True, log_with="tensorboard")
