"""Accelerator.prepared() pairs every optimizer with its own model, and save_state/load_state
round-trip two models with two optimizers (a generator and a discriminator)."""

from __future__ import annotations

import pytest
import torch

import nbaccel


def two_models(ckpt: str, strategy: str):
    """Prepare D's optimizer before G's, so position-based pairing would get both wrong."""
    from nbaccel import Accelerator, set_seed

    set_seed(0)
    acc = Accelerator(strategy=strategy)
    gen = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Linear(8, 4))
    disc = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 1))
    opt_d = torch.optim.Adam(disc.parameters(), lr=0.01)
    opt_g = torch.optim.SGD(gen.parameters(), lr=0.05, momentum=0.9)
    gen, disc, opt_d, opt_g = acc.prepare(gen, disc, opt_d, opt_g)
    prepared = acc.prepared()
    pairs = [m is disc for m in prepared.optimizer_models], [m is gen for m in prepared.models]

    def step():
        x = torch.randn(5, 3) + acc.process_index
        loss = disc(gen(x)).pow(2).mean()
        acc.backward(loss)
        opt_d.step()
        opt_g.step()
        opt_d.zero_grad()
        opt_g.zero_grad()

    def snapshot():
        return {
            "g": {k: v.clone() for k, v in acc.get_state_dict(gen).items()},
            "d": {k: v.clone() for k, v in acc.get_state_dict(disc).items()},
            "opt_d": prepared.strategy.optimizer_state_dict(disc, opt_d.optimizer),
            "opt_g": prepared.strategy.optimizer_state_dict(gen, opt_g.optimizer),
        }

    for _ in range(3):
        step()
    acc.save_state(ckpt)
    saved = _tensors(snapshot())  # copies: optimizer state tensors change in place
    for _ in range(2):
        step()
    acc.load_state(ckpt)
    return pairs, saved, _tensors(snapshot())


def _tensors(state):
    """Flatten nested state into (path, tensor-or-value) pairs for comparison in the kernel."""
    out = {}

    def walk(prefix, value):
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}/{k}", v)
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                walk(f"{prefix}/{i}", v)
        else:
            out[prefix] = value.clone() if isinstance(value, torch.Tensor) else value

    walk("", state)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_optimizers_round_trip_with_their_own_models(tmp_path, strategy):
    ckpt = str(tmp_path / "ckpt")
    (optimizer_pairs, model_order), saved, restored = nbaccel.notebook_launcher(
        two_models, args=(ckpt, strategy), num_processes=2, progress=False
    )
    # opt_d (prepared first) belongs to the discriminator, opt_g to the generator.
    assert optimizer_pairs == [True, False]
    assert model_order == [True, False]
    assert saved.keys() == restored.keys()
    assert any(k.startswith("/opt_d/state") for k in saved)  # Adam state really was saved
    for key, value in saved.items():
        other = restored[key]
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, other), key
        else:
            assert value == other, key
