"""save_state/load_state resume a run bit for bit; a save killed mid-write leaves the previous
checkpoint (or file) loadable, and the next save removes what the killed one left."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import nbaccel

pytestmark = pytest.mark.slow  # real training runs, and a subprocess killed mid-save

REPO = Path(__file__).resolve().parent.parent


def train_resumable(ckpt: str, total: int, stop_at: int | None = None, resume_at: int = 0):
    """Dropout (per-rank RNG), Adam (state), a schedule and a shuffled loader: all must resume."""
    from nbaccel import Accelerator, set_seed

    set_seed(0)
    acc = Accelerator()
    g = torch.Generator().manual_seed(7)
    ds = TensorDataset(torch.randn(48, 4, generator=g), torch.randn(48, 1, generator=g))
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.3), torch.nn.Linear(8, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    dl = DataLoader(ds, batch_size=4, shuffle=True)  # 6 batches per rank per epoch
    model, opt, dl, sched = acc.prepare(model, opt, dl, sched)
    step = resume_at
    if resume_at:
        acc.load_state(ckpt)
    while step < total:
        for x, y in dl:
            loss = torch.nn.functional.mse_loss(model(x), y)
            acc.backward(loss)
            opt.step()
            sched.step()
            opt.zero_grad()
            step += 1
            if step == stop_at:
                acc.save_state(ckpt)
                return None
            if step == total:
                break
    return {k: v.clone() for k, v in acc.get_state_dict(model).items()}


def test_resume_from_save_state_is_bit_for_bit(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    run = nbaccel.notebook_launcher
    full = run(train_resumable, args=(ckpt, 10), num_processes=2, progress=False)
    assert run(train_resumable, args=(ckpt, 10, 5), num_processes=2, progress=False) is None
    assert sorted(os.listdir(ckpt)) == sorted(
        ["model.safetensors", "optimizer.bin", "scheduler.bin", "dataloader_0.pt"]
        + ["random_states_0.pkl", "random_states_1.pkl"]
    )
    resumed = run(train_resumable, args=(ckpt, 10, None, 5), num_processes=2, progress=False)
    for key in full:
        assert torch.equal(full[key], resumed[key]), key


def test_one_process_resume_in_a_later_epoch_is_bit_for_bit(tmp_path):
    """One process shuffles as plain torch does, drawing each epoch's order from the global
    RNG; the checkpoint keeps that draw, so a resumed epoch does not draw a new order."""
    ckpt = str(tmp_path / "ckpt")
    run = nbaccel.notebook_launcher
    full = run(train_resumable, args=(ckpt, 16), num_processes=1, progress=False)
    assert run(train_resumable, args=(ckpt, 16, 14), num_processes=1, progress=False) is None
    resumed = run(train_resumable, args=(ckpt, 16, None, 14), num_processes=1, progress=False)
    for key in full:
        assert torch.equal(full[key], resumed[key]), key


_KILLED_SAVE = """
import os, signal, sys, torch
sys.path.insert(0, {repo!r})
from tests.test_accelerator_checkpoint import build

class Bomb:
    # Pickling this kills the process, like a crash or an OOM-kill in the middle of a write.
    def __reduce__(self):
        os.kill(os.getpid(), signal.SIGKILL)

class Holder:
    def state_dict(self):
        return {{"big": torch.zeros(10_000), "bomb": Bomb()}}
    def load_state_dict(self, state):
        pass

acc, model = build(2.0)
if sys.argv[1] == "state":
    acc.register_for_checkpointing(Holder())
    acc.save_state({ckpt!r})
else:
    acc.save({{"w": torch.full((3,), 2.0), "bomb": Bomb()}}, {file!r})
"""


def build(value: float):
    from nbaccel import Accelerator

    acc = Accelerator()
    model = torch.nn.Linear(3, 1)
    torch.nn.init.constant_(model.weight, value)
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    return acc, model


def test_killed_save_leaves_previous_checkpoint_loadable(tmp_path):
    ckpt, file = tmp_path / "ckpt", tmp_path / "weights.pt"
    acc, model = build(1.0)  # in this process: one rank, the kernel case
    acc.save_state(ckpt)
    acc.save({"w": torch.full((3,), 1.0)}, file)
    script = _KILLED_SAVE.format(repo=str(REPO), ckpt=str(ckpt), file=str(file))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NBACCEL_L", "RANK"))}
    for what in ("state", "file"):
        proc = subprocess.run(
            [sys.executable, "-c", script, what], env=env, capture_output=True, timeout=120
        )
        assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    # What the kills left, for the next saves to remove.
    assert (tmp_path / ".ckpt.partial").is_dir()
    assert len(list(tmp_path.glob(".weights.pt.*.tmp"))) == 1

    acc2, model2 = build(5.0)
    acc2.load_state(ckpt)
    assert torch.equal(model2.weight, torch.ones(1, 3))
    assert torch.equal(torch.load(file, weights_only=True)["w"], torch.ones(3))
    acc2.save_state(ckpt)  # clean up after the killed ones
    acc2.save({"w": torch.full((3,), 3.0)}, file)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "weights.pt"]
