"""Same seed, same run: ``set_seed(s)`` and the same loop give bitwise the same losses with
nbaccel as with Accelerate (the pinned test-only dependency), on 1 and on 2 processes.

Both libraries draw from torch's global RNG at the same places: a shuffled loader draws its
shuffle seed at ``prepare`` (2 processes; on 1 the sampler draws each epoch, as plain torch
does), and every epoch's iterator draws the loader's base seed. Dropout masks come next from
the same global stream, so any extra or missing draw changes the losses from the first step.
"""

from __future__ import annotations

import pytest

from tests.side_by_side import run_as

pytest.importorskip("accelerate")
pytestmark = pytest.mark.slow  # real launches, both libraries


def seeded_losses(lib: str, shuffle: bool = True, epochs: int = 2) -> list[float]:
    """An MLP with dropout on a shuffled loader, seeded once: this rank's losses."""
    import importlib

    import torch
    from torch.utils.data import DataLoader, TensorDataset

    module = importlib.import_module(lib)
    importlib.import_module(f"{lib}.utils").set_seed(1234)
    acc = module.Accelerator(cpu=True)
    x, y = torch.randn(64, 8), torch.randn(64, 1)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(16, 1)
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    sequential = DataLoader(TensorDataset(x, y), batch_size=4)  # prepared, never iterated
    loader = DataLoader(TensorDataset(x, y), batch_size=4, shuffle=shuffle)
    model, opt, loader, sequential = acc.prepare(model, opt, loader, sequential)
    losses = []
    for _ in range(epochs):
        for xb, yb in loader:
            loss = torch.nn.functional.mse_loss(model(xb), yb)
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    return losses


def _run(lib: str, processes: int, function=seeded_losses, **kwargs) -> list[list[float]]:
    return run_as(lib, function, processes, **kwargs)


@pytest.mark.parametrize("processes", [1, 2])
@pytest.mark.parametrize("shuffle", [True, False], ids=["shuffled", "sequential"])
def test_same_losses_as_accelerate(processes, shuffle):
    ours = _run("nbaccel", processes, shuffle=shuffle)
    theirs = _run("accelerate", processes, shuffle=shuffle)
    assert len(ours[0]) == 2 * 64 // (4 * processes)
    assert ours == theirs  # exact floats: every draw from the global RNG lines up


def seeded_gpt2_losses(lib: str) -> list[float]:
    """A tiny GPT-2 from a config (dropout in every block) on a shuffled loader."""
    import importlib

    import torch
    from torch.utils.data import DataLoader, TensorDataset
    from transformers import GPT2Config, GPT2LMHeadModel

    module = importlib.import_module(lib)
    importlib.import_module(f"{lib}.utils").set_seed(1234)
    acc = module.Accelerator(cpu=True)
    config = GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=32, n_positions=8)
    model = GPT2LMHeadModel(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, 32, (16, 8))
    loader = DataLoader(TensorDataset(ids), batch_size=2, shuffle=True)
    model, opt, loader = acc.prepare(model, opt, loader)
    losses = []
    for (batch,) in loader:
        loss = model(input_ids=batch, labels=batch).loss
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("processes", [1, 2])
def test_same_gpt2_losses_as_accelerate(processes):
    pytest.importorskip("transformers")
    ours = _run("nbaccel", processes, seeded_gpt2_losses)
    theirs = _run("accelerate", processes, seeded_gpt2_losses)
    assert len(ours[0]) == 16 // (2 * processes)
    assert ours == theirs
