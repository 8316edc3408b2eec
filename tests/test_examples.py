"""The three Accelerate examples ported in examples/ (only the import changed, a synthetic
dataset of the same shape instead of the download) run under notebook_launcher and under
``nbaccel launch``: checkpointing + resume, trackers, accumulation + early stopping."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest
import torch

import nbaccel
from tests.test_cli_support import run_cli

pytestmark = pytest.mark.slow  # real 2-rank launches
EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.fixture(autouse=True)
def examples_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))  # ranks inherit the kernel's sys.path


def test_checkpointing_example_resumes_mid_epoch_to_the_same_weights(tmp_path):
    import checkpointing

    run = nbaccel.notebook_launcher
    argv = ["--cpu", "--checkpointing_steps", "6", "--output_dir", str(tmp_path)]
    full = run(checkpointing.main, args=(argv,), num_processes=2, progress=False)
    assert full["steps"] == 12  # 128 samples / (2 ranks x 16) x 3 epochs
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_12", "step_6"]
    resume = argv[:1] + ["--resume_from_checkpoint", str(tmp_path / "step_6")]
    resumed = run(checkpointing.main, args=(resume,), num_processes=2, progress=False)
    assert resumed["steps"] == 12 and resumed["accuracy"] == full["accuracy"]
    for key, value in full["weights"].items():
        assert torch.equal(value, resumed["weights"][key]), key


def test_early_stopping_example_in_a_notebook_and_from_the_cli(tmp_path):
    import early_stopping

    argv = ["--cpu", "--gradient_accumulation_steps", "2"]
    outs = nbaccel.notebook_launcher(
        early_stopping.main, args=(argv,), num_processes=2, progress=False, return_all=True
    )
    # 4 batches per rank per epoch, 3 epochs, a real step every 2 batches.
    assert [o["micro_steps"] for o in outs] == [12, 12]
    assert [o["optimizer_steps"] for o in outs] == [6, 6]
    threshold = ["--loss_threshold", "0.69"]
    stop = nbaccel.notebook_launcher(
        early_stopping.main,
        args=(argv + threshold,),
        num_processes=2,
        progress=False,
        return_all=True,
    )
    # Whichever rank crossed the threshold, every rank stopped at the same step.
    assert stop[0]["stopped_at"] == stop[1]["stopped_at"] is not None
    assert stop[0]["micro_steps"] < 12
    result = run_cli(
        "launch",
        "--num_processes",
        "2",
        str(EXAMPLES / "early_stopping.py"),
        *argv,
        *threshold,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    steps = stop[0]["optimizer_steps"]
    assert f"optimizer steps {steps}, micro-steps {stop[0]['micro_steps']}" in result.stdout


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None, reason="tensorboard missing")
def test_tracking_example_from_the_cli_writes_tensorboard_events(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    result = run_cli(
        "launch",
        "--num_processes",
        "2",
        str(EXAMPLES / "tracking.py"),
        "--cpu",
        "--with_tracking",
        "--project_dir",
        str(tmp_path / "logs"),
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    events = EventAccumulator(str(tmp_path / "logs" / "tracking"))
    events.Reload()
    assert [e.step for e in events.Scalars("accuracy")] == [0, 1, 2]
    assert [e.value for e in events.Scalars("epoch")] == [0.0, 1.0, 2.0]


def test_examples_import_nbaccel_where_accelerate_was():
    for name in ("checkpointing", "tracking", "early_stopping"):
        tree = ast.parse((EXAMPLES / f"{name}.py").read_text())
        modules = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert {"nbaccel", "nbaccel.utils"} <= modules
        assert not [m for m in modules if m and m.split(".")[0] == "accelerate"]
