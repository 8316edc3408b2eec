"""Ranks that pass ``save_state`` different folders (each its own temporary folder, as
Accelerate's own tests do) each get a whole checkpoint there, swapped in as one, and resume from
it bit for bit; where a rank holds only part of the state (FSDP) they are refused alike, before
anything is written."""

from __future__ import annotations

import os

import pytest
import torch

import nbaccel
from tests.test_accelerator_checkpoint import train_resumable

pytestmark = pytest.mark.slow  # real 2-rank launches


def in_own_folder(base: str, *args):
    return train_resumable(os.path.join(base, f"rank{os.environ['RANK']}"), *args)


def test_each_rank_resumes_from_its_own_folder(tmp_path):
    run = nbaccel.notebook_launcher
    full = run(train_resumable, args=(str(tmp_path / "one"), 10), num_processes=2, progress=False)
    assert run(in_own_folder, args=(str(tmp_path), 10, 5), num_processes=2, progress=False) is None
    shared = ["model.safetensors", "optimizer.bin", "scheduler.bin", "dataloader_0.pt"]
    for rank in (0, 1):
        files = sorted(os.listdir(tmp_path / f"rank{rank}"))
        assert files == sorted([*shared, f"random_states_{rank}.pkl"])
    assert sorted(os.listdir(tmp_path)) == ["rank0", "rank1"]  # no staging folder left
    resumed = run(in_own_folder, args=(str(tmp_path), 10, None, 5), num_processes=2)
    for key in full:
        assert torch.equal(full[key], resumed[key]), key


def fsdp_saves_in_own_folder(base: str) -> str:
    from nbaccel import Accelerator

    acc = Accelerator(strategy="fsdp")
    model = torch.nn.Linear(4, 4)
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    try:
        acc.save_state(os.path.join(base, f"rank{acc.process_index}"))
    except ValueError as exc:
        return str(exc)
    return "saved"


def test_fsdp_ranks_with_different_folders_are_refused_before_writing(tmp_path):
    said = nbaccel.notebook_launcher(
        fsdp_saves_in_own_folder, args=(str(tmp_path),), num_processes=2, return_all=True
    )
    assert said[0] == said[1]
    assert said[0].startswith(
        f"save_state: the ranks passed different folders (rank 0: {tmp_path}/rank0, rank 1: "
        f"{tmp_path}/rank1); with strategy='fsdp' each rank holds only part of the state"
    )
    assert "every rank must pass the same folder" in said[0]
    assert os.listdir(tmp_path) == []
