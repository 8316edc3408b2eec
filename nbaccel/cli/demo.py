"""``nbaccel demo``: the README's main job, a small 2-process training run end to end.

It trains a tiny regression model on generated data (no downloads, no extra packages) with
``nbaccel.Accelerator`` (DDP over gloo), launched through :func:`nbaccel.notebook_launcher`, so a new user sees
labelled per-rank output and the returned result in a few seconds on a laptop CPU.

>>> from nbaccel.cli.demo import run_demo
>>> run_demo(num_processes=2, steps=50)        # doctest: +SKIP
{'world_size': 2, 'steps': 50, 'final_loss': 0.0102, 'weight_error': 0.03}
"""

from __future__ import annotations

import time

# Fixed "true" model the demo learns, y = X @ TRUE_WEIGHTS + TRUE_BIAS + noise.
TRUE_WEIGHTS = (2.0, -3.0, 0.5, 1.5)
TRUE_BIAS = 0.25


def train(steps: int = 200, lr: float = 0.05, batch_size: int = 32, seed: int = 0) -> dict:
    """Train a linear model on synthetic data on every rank; return rank-level results.

    Example::

        nbaccel.notebook_launcher(train, args=(100,), num_processes=2)
    """
    import torch

    from nbaccel.training.accelerator import Accelerator

    accelerator = Accelerator()
    rank, world = accelerator.process_index, accelerator.num_processes
    features, targets = _data(batch_size * world * 8, seed, rank, world)
    model = torch.nn.Linear(len(TRUE_WEIGHTS), 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    model, optimizer = accelerator.prepare(model, optimizer)
    features, targets = features.to(accelerator.device), targets.to(accelerator.device)
    generator = torch.Generator().manual_seed(seed + rank)

    # The launcher labels every line with its rank already ("[rank0] ..."): no rank here.
    shard = f"{features.shape[0]} samples (this rank's shard of {world})"
    print(f"data: {shard}, {steps} steps", flush=True)
    started = time.perf_counter()
    loss = torch.tensor(0.0)
    for step in range(1, steps + 1):
        idx = torch.randint(0, features.shape[0], (batch_size,), generator=generator)
        loss = torch.nn.functional.mse_loss(model(features[idx]).squeeze(-1), targets[idx])
        optimizer.zero_grad()
        accelerator.backward(loss)
        optimizer.step()
        if step % max(1, steps // 4) == 0 or step == steps:
            print(f"step {step:4d}  loss {loss.item():.4f}", flush=True)
    final = accelerator.reduce(loss.detach(), reduction="mean")
    weight = accelerator.unwrap_model(model).weight.detach().cpu().squeeze(0)
    return {
        "world_size": world,
        "steps": steps,
        "final_loss": round(float(final), 4),
        "weight_error": round((weight - torch.tensor(TRUE_WEIGHTS)).abs().max().item(), 3),
        # The training loop alone, on this rank; the launch's own total (start, rendezvous,
        # exit) is the "launch took" time in the summary line.
        "training_loop_seconds": round(time.perf_counter() - started, 2),
    }


def _data(n: int, seed: int, rank: int, world: int):
    import torch

    torch.manual_seed(seed)  # same data and initial weights on every rank
    features = torch.randn(n, len(TRUE_WEIGHTS))
    targets = features @ torch.tensor(TRUE_WEIGHTS) + TRUE_BIAS + 0.05 * torch.randn(n)
    # Each rank sees its own shard, as a DistributedSampler would give it.
    return features[rank::world], targets[rank::world]


def run_demo(num_processes: int = 2, steps: int = 200) -> dict:
    """Launch the demo training on ``num_processes`` CPU ranks and return rank 0's result.

    Example::

        >>> run_demo(2, steps=100)["world_size"]       # doctest: +SKIP
        2
    """
    from nbaccel.launchers import notebook_launcher

    return notebook_launcher(train, args=(steps,), num_processes=num_processes, progress="text")
