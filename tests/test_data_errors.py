"""Errors at the data edges say what happened to which file and what to do: a full disk during
save_state, a full /dev/shm for a rank's result, a damaged checkpoint file. A failed save leaves
no partial files behind and the previous checkpoint loadable."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch

import nbaccel
from nbaccel.core import atomic, shared_tensors
from nbaccel.core.disk_space import OutOfSpaceError
from nbaccel.training.file_reading import UnreadableFileError
from nbaccel.training.model_files import load_checkpoint_in_model, save_model_files
from tests.disk_helpers import hidden_leftovers, small_tmpfs


def build(value: float, numel: int = 4):
    acc = nbaccel.Accelerator()
    model = torch.nn.Linear(numel, 1, bias=False)
    torch.nn.init.constant_(model.weight, value)
    model, _ = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    return acc, model


class Failing:
    def state_dict(self):
        raise RuntimeError("state_dict failed")

    def load_state_dict(self, state):
        pass


def test_save_state_on_a_full_disk_names_the_folder_and_keeps_the_previous_checkpoint(tmp_path):
    with small_tmpfs(tmp_path / "disk", "2m") as disk:
        ckpt = disk / "ckpt"
        acc, model = build(1.0, numel=300_000)  # 1.2 MB: fits once, not twice
        acc.save_state(ckpt)
        torch.nn.init.constant_(model.weight, 2.0)
        with pytest.raises(OutOfSpaceError) as raised:
            acc.save_state(ckpt)
        message = str(raised.value)
        assert message.startswith(f"save_state: no space left to write {ckpt}: it needs about 1.2")
        assert "Free space on that disk, or pass another folder to save_state()" in message
        assert "unexpected pos" not in message
        assert hidden_leftovers(disk) == []  # no .ckpt.partial, no temporary file
        acc2, model2 = build(5.0, numel=300_000)
        acc2.load_state(ckpt)
        assert torch.equal(model2.weight, torch.ones(1, 300_000))


def test_a_failed_save_state_removes_its_partial_files(tmp_path):
    ckpt = tmp_path / "ckpt"
    acc, model = build(1.0)
    acc.save_state(ckpt)
    acc.register_for_checkpointing(Failing())
    with pytest.raises(RuntimeError, match="state_dict failed"):
        acc.save_state(ckpt)
    assert hidden_leftovers(tmp_path) == []
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


def _damage(path: Path, how: str) -> None:
    data = path.read_bytes()
    damaged = {
        "cut-in-half": data[: len(data) // 2],
        "cut-near-the-end": data[: len(data) - 30],
        "empty": b"",
        "zeros": bytes(len(data)),
        "text": b"version https://git-lfs.github.com/spec/v1\noid sha256:0\n",
        "noise": bytes(range(256)) * 4,
    }[how]
    path.write_bytes(damaged)


EXPECTED = {
    "cut-in-half": "a zip archive (torch's format) cut short",
    "cut-near-the-end": "a zip archive (torch's format) cut short",
    "empty": "nothing (0 bytes)",
    "zeros": "only zero bytes",
    "text": "text: 'version https://git-lfs.github.com/spec/v1'",
    "noise": "data in no known format",
}


@pytest.mark.parametrize("how", EXPECTED)
@pytest.mark.parametrize("name", ["optimizer.bin", "custom_checkpoint_0.pkl"])
def test_load_state_of_a_damaged_file_names_it_and_says_what_it_holds(tmp_path, how, name):
    acc, _ = build(1.0)
    acc.register_for_checkpointing(torch.optim.lr_scheduler.StepLR(acc._optimizers[0], 1))
    acc.save_state(tmp_path / "ckpt")
    _damage(tmp_path / "ckpt" / name, how)
    with pytest.raises(UnreadableFileError) as raised:
        acc.load_state(tmp_path / "ckpt")
    message = str(raised.value)
    assert message.startswith(f"{tmp_path / 'ckpt' / name} cannot be read as a torch checkpoint")
    assert EXPECTED[how] in message, message
    assert "weights_only" not in message


def test_a_cut_short_model_file_is_named(tmp_path):
    save_model_files({"w": torch.ones(1000)}, tmp_path, max_shard_size=1000)
    shard = tmp_path / "model-00001-of-00001.safetensors"
    if not shard.exists():
        shard = tmp_path / "model.safetensors"
    _damage(shard, "cut-in-half")
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.zeros(1000))
    with pytest.raises(UnreadableFileError, match="safetensors file cut short"):
        load_checkpoint_in_model(model, tmp_path)


def test_a_full_shm_names_it_the_bytes_and_what_to_do(tmp_path, monkeypatch):
    with small_tmpfs(tmp_path / "shm", "1m") as shm:
        monkeypatch.setenv("NBACCEL_SHM_DIR", str(shm))
        transfer = shared_tensors.Transfer("test-token", None, 0)
        with pytest.raises(OutOfSpaceError) as raised:
            shared_tensors.dumps_result({"big": torch.zeros(500_000)}, transfer, rank=0)
        message = str(raised.value)
        assert message.startswith(f"rank 0's return value: no space left to write {shm}/nbaccel-")
        assert "it needs about 2.0 MB, with 1.0 MB free there" in message, message
        assert "--shm-size" in message
        assert "NBACCEL_SHM_DIR" in message
        assert os.listdir(shm) == []  # the partial result file is gone


def _return_big():
    return torch.ones(1_000_000)


@pytest.mark.slow
def test_a_launch_whose_result_does_not_fit_in_shm_says_so(tmp_path, monkeypatch):
    with small_tmpfs(tmp_path / "shm", "1m") as shm:
        monkeypatch.setenv("NBACCEL_SHM_DIR", str(shm))
        with pytest.raises(Exception) as raised:
            nbaccel.notebook_launcher(_return_big, num_processes=2, progress=False)
        message = str(raised.value)
        assert "rank 0's return value: no space left to write" in message, message
        assert str(shm) in message and "4.0 MB" in message
        assert "cannot be sent" not in message
        assert os.listdir(shm) == []
        monkeypatch.delenv("NBACCEL_SHM_DIR")
        assert nbaccel.notebook_launcher(_return_big, num_processes=2).sum() == 1_000_000


def test_a_write_removes_the_temporary_files_of_killed_writers_only(tmp_path):
    gone = subprocess.Popen(["true"])
    gone.wait()  # a pid that no longer runs
    host = atomic._HOST
    dead = tmp_path / f".f.pt.{host}~{gone.pid}.x1.tmp"
    live = tmp_path / f".f.pt.{host}~{os.getpid()}.x2.tmp"
    other_machine = tmp_path / f".f.pt.elsewhere~{gone.pid}.x3.tmp"
    other_file = tmp_path / f".g.pt.{host}~{gone.pid}.x4.tmp"
    for path in (dead, live, other_machine, other_file):
        path.write_bytes(b"partial")
    with atomic.atomic_write(tmp_path / "f.pt") as f:
        f.write(b"new")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["f.pt", live.name, other_machine.name, other_file.name]
    )
