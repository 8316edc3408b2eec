"""``nbaccel demo``: the README's main job, a small 2-process training run end to end.

It trains a tiny regression model on generated data (no downloads, no extra packages) with
DistributedDataParallel, launched through :func:`nbaccel.notebook_launcher`, so a new user sees
labelled per-rank output and the returned result in a few seconds on a laptop CPU.

>>> from nbaccel.demo import run_demo
>>> run_demo(num_processes=2, steps=50)        # doctest: +SKIP
{'world_size': 2, 'steps': 50, 'final_loss': 0.0102, 'weight_error': 0.03}
"""

from __future__ import annotations

import os
import time

# Fixed "true" model the demo learns, y = X @ TRUE_WEIGHTS + TRUE_BIAS + noise.
TRUE_WEIGHTS = (2.0, -3.0, 0.5, 1.5)
TRUE_BIAS = 0.25


def train(steps: int = 200, lr: float = 0.05, batch_size: int = 32, seed: int = 0) -> dict:
    """Train a linear model on synthetic data on every rank; return rank-level results.

    Uses ``nbaccel.Accelerator`` when it can be imported, else plain DDP (same numbers).

    Example::

        nbaccel.notebook_launcher(train, args=(100,), num_processes=2)
    """
    try:
        from nbaccel.accelerator import Accelerator
    except ImportError:
        return train_plain_ddp(steps, lr, batch_size, seed)
    import torch

    accelerator = Accelerator()
    rank, world = accelerator.process_index, accelerator.num_processes
    features, targets = _data(batch_size * world * 8, seed, rank, world)
    model = torch.nn.Linear(len(TRUE_WEIGHTS), 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    model, optimizer = accelerator.prepare(model, optimizer)
    features, targets = features.to(accelerator.device), targets.to(accelerator.device)
    generator = torch.Generator().manual_seed(seed + rank)

    print(f"rank {rank}/{world}: {features.shape[0]} samples, {steps} steps", flush=True)
    started = time.perf_counter()
    loss = torch.tensor(0.0)
    for step in range(1, steps + 1):
        idx = torch.randint(0, features.shape[0], (batch_size,), generator=generator)
        loss = torch.nn.functional.mse_loss(model(features[idx]).squeeze(-1), targets[idx])
        optimizer.zero_grad()
        accelerator.backward(loss)
        optimizer.step()
        if step % max(1, steps // 4) == 0 or step == steps:
            print(f"rank {rank}: step {step:4d}  loss {loss.item():.4f}", flush=True)
    final = accelerator.reduce(loss.detach(), reduction="mean")
    weight = accelerator.unwrap_model(model).weight.detach().cpu().squeeze(0)
    return {
        "world_size": world,
        "steps": steps,
        "final_loss": round(float(final), 4),
        "weight_error": round((weight - torch.tensor(TRUE_WEIGHTS)).abs().max().item(), 3),
        "seconds": round(time.perf_counter() - started, 2),
    }


def _data(n: int, seed: int, rank: int, world: int):
    import torch

    torch.manual_seed(seed)  # same data and initial weights on every rank
    features = torch.randn(n, len(TRUE_WEIGHTS))
    targets = features @ torch.tensor(TRUE_WEIGHTS) + TRUE_BIAS + 0.05 * torch.randn(n)
    # Each rank sees its own shard, as a DistributedSampler would give it.
    return features[rank::world], targets[rank::world]


def train_plain_ddp(
    steps: int = 200, lr: float = 0.05, batch_size: int = 32, seed: int = 0
) -> dict:
    """The same job with nothing but torch: DDP over gloo (also without any launcher).

    Runs under ``notebook_launcher``, ``nbaccel launch`` or plain ``torchrun`` (it reads the
    usual RANK/WORLD_SIZE variables); without them it runs as a single process.

    Example::

        nbaccel.notebook_launcher(train_plain_ddp, args=(100,), num_processes=2)
    """
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    distributed = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if distributed and not dist.is_initialized():
        dist.init_process_group("gloo")
    rank = dist.get_rank() if distributed else 0
    world = dist.get_world_size() if distributed else 1

    torch.manual_seed(seed)  # same data and initial weights on every rank
    true_w = torch.tensor(TRUE_WEIGHTS)
    features = torch.randn(batch_size * world * 8, len(TRUE_WEIGHTS))
    targets = features @ true_w + TRUE_BIAS + 0.05 * torch.randn(features.shape[0])
    # Each rank sees its own shard, as a DistributedSampler would give it.
    features, targets = features[rank::world], targets[rank::world]

    model = torch.nn.Linear(len(TRUE_WEIGHTS), 1)
    if distributed:
        model = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    generator = torch.Generator().manual_seed(seed + rank)

    print(f"rank {rank}/{world}: {features.shape[0]} samples, {steps} steps", flush=True)
    started = time.perf_counter()
    loss = torch.tensor(0.0)
    for step in range(1, steps + 1):
        idx = torch.randint(0, features.shape[0], (batch_size,), generator=generator)
        prediction = model(features[idx]).squeeze(-1)
        loss = torch.nn.functional.mse_loss(prediction, targets[idx])
        optimizer.zero_grad()
        loss.backward()  # DDP averages the gradients across ranks here
        optimizer.step()
        if step % max(1, steps // 4) == 0 or step == steps:
            print(f"rank {rank}: step {step:4d}  loss {loss.item():.4f}", flush=True)

    # The mean of the ranks' last losses is the number everyone agrees on.
    final = loss.detach().clone()
    if distributed:
        dist.all_reduce(final)
        final /= world
    layer = model.module if distributed else model
    weight_error = (layer.weight.detach().squeeze(0) - true_w).abs().max().item()
    result = {
        "world_size": world,
        "steps": steps,
        "final_loss": round(final.item(), 4),
        "weight_error": round(weight_error, 3),
        "seconds": round(time.perf_counter() - started, 2),
    }
    if distributed:
        dist.destroy_process_group()
    return result


def run_demo(num_processes: int = 2, steps: int = 200) -> dict:
    """Launch the demo training on ``num_processes`` CPU ranks and return rank 0's result.

    Example::

        >>> run_demo(2, steps=100)["world_size"]       # doctest: +SKIP
        2
    """
    from nbaccel.launcher import notebook_launcher

    return notebook_launcher(train, args=(steps,), num_processes=num_processes, progress="text")
