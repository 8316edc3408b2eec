"""The one training function every contender runs: same model, data and loop, in every rank.

``train(cfg)`` reads its rank from the environment (every launcher sets ``RANK``/``WORLD_SIZE``/
``MASTER_*``), trains a small MLP with DDP for ``cfg["steps"]`` steps and writes what the
benchmark needs to ``<out_dir>/rank<N>.json``: the wall-clock time (``time.time()``, comparable
across processes) right after its first optimizer step, and its steady-state steps per second.
The file is written after the loop, so measuring costs the loop nothing.

``cfg["mode"]`` picks only how the loop is driven, never what it computes:

- ``raw``: ``torch.distributed`` + ``DistributedDataParallel`` + ``DistributedSampler``;
- ``nbaccel`` / ``nbaccel_dash``: ``nbaccel.Accelerator``; ``_dash`` adds ``nbaccel.progress``
  around the loop and ``accelerator.log`` every step;
- ``accelerate`` / ``accelerate_tqdm``: Accelerate's ``Accelerator(cpu=True)`` (Accelerate only
  enters multi-process CPU mode with ``cpu=True``); ``_tqdm`` adds a per-rank ``tqdm`` bar.

Run as a script (``python -m benchmarks.workload '<json cfg>'``) it is the torchrun contender.
"""

from __future__ import annotations

import itertools
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

# Model and data sizes: small enough that launcher and loop overheads are visible on 2 CPU cores.
IN_FEATURES, HIDDEN, CLASSES = 64, 256, 10
SAMPLES, BATCH = 4096, 32


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _build(torch: Any) -> tuple[Any, Any]:
    torch.manual_seed(0)  # identical initial weights and data on every rank and contender
    model = torch.nn.Sequential(
        torch.nn.Linear(IN_FEATURES, HIDDEN),
        torch.nn.ReLU(),
        torch.nn.Linear(HIDDEN, HIDDEN),
        torch.nn.ReLU(),
        torch.nn.Linear(HIDDEN, CLASSES),
    )
    data = torch.utils.data.TensorDataset(
        torch.randn(SAMPLES, IN_FEATURES), torch.randint(0, CLASSES, (SAMPLES,))
    )
    return model, data


def _forever(loader: Any, sampler: Any = None):
    """Batches across epochs, so a run of any length uses the same per-epoch loader."""
    for epoch in itertools.count():
        if sampler is not None:
            sampler.set_epoch(epoch)
        yield from loader


def train(cfg: dict[str, Any]) -> dict[str, Any]:
    entered = time.time()  # the function's own span, entered → left, is no launcher's cost
    import torch
    import torch.nn.functional as F

    mode = cfg["mode"]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # Launchers differ in the thread count they give ranks; pin it so only the loop differs.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    model, data = _build(torch)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    acc = None
    sampler = None
    if mode == "raw":
        import torch.distributed as dist

        dist.init_process_group("gloo")
        model = torch.nn.parallel.DistributedDataParallel(model)
        sampler = torch.utils.data.distributed.DistributedSampler(data, shuffle=True, seed=0)
        loader = torch.utils.data.DataLoader(data, batch_size=BATCH, sampler=sampler)
    else:
        if mode.startswith("nbaccel"):
            from nbaccel import Accelerator

            acc = Accelerator()
        else:
            from accelerate import Accelerator

            acc = Accelerator(cpu=True)
        loader = torch.utils.data.DataLoader(data, batch_size=BATCH, shuffle=True)
        model, optimizer, loader = acc.prepare(model, optimizer, loader)

    steps, warmup = int(cfg["steps"]), int(cfg.get("warmup", 0))
    batches: Any = itertools.islice(_forever(loader, sampler), steps)
    if mode in ("nbaccel_dash", "nbaccel_progress"):
        import nbaccel

        batches = nbaccel.progress(batches, total=steps, desc="train", unit_scale=BATCH)
    elif mode == "accelerate_tqdm":
        from tqdm import tqdm

        batches = tqdm(batches, total=steps, desc=f"rank {rank}")
    log = mode in ("nbaccel_dash", "nbaccel_log")
    fail_rank = cfg.get("fail_rank")

    first_step = t_start = None
    for step, (x, y) in enumerate(batches):
        if step == warmup:
            t_start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        if acc is None:
            loss.backward()
        else:
            acc.backward(loss)
        optimizer.step()
        if log:
            acc.log({"loss": loss}, step=step)
        if first_step is None:
            first_step = time.time()
            if rank == fail_rank:
                _write(cfg, rank, {"failed_at": time.time()})
                raise RuntimeError(f"benchmark failure injected in rank {rank}")
    t_end = time.perf_counter()
    measured = steps - warmup
    rate = measured / (t_end - t_start) if t_start is not None and measured > 0 else None
    record = {"first_step": first_step, "steps_per_s": rate, "pid": os.getpid()}
    _write(cfg, rank, {**record, "entered": entered, "left": time.time()})
    return {"rank": rank, "steps_per_s": rate}


def _write(cfg: dict[str, Any], rank: int, record: dict[str, Any]) -> None:
    path = Path(cfg["out_dir"]) / f"rank{rank}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record))
    tmp.replace(path)  # readers never see half a file


def train_indexed(index: int, cfg: dict[str, Any]) -> None:
    """Entry for ``torch.multiprocessing.start_processes``, which passes the index and sets no
    rendezvous variables: set what torchrun would, then run the same ``train``."""
    os.environ.update(
        RANK=str(index),
        LOCAL_RANK=str(index),
        WORLD_SIZE=str(cfg["world_size"]),
        LOCAL_WORLD_SIZE=str(cfg["world_size"]),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(cfg["port"]),
    )
    train(cfg)
    _tear_down_process_group()


def _tear_down_process_group() -> None:
    """For launchers whose ranks exit through interpreter teardown (spawn, torchrun): a gloo
    group left alive makes that exit abort ("terminate called without an active exception",
    SIGABRT). nbaccel and fork-based launchers end ranks without C++ static destructors."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def read_ranks(out_dir: str | Path, world: int) -> dict[int, dict[str, Any]]:
    """Each rank's record; a rank that wrote none is missing from the result."""
    found = {}
    for rank in range(world):
        path = Path(out_dir) / f"rank{rank}.json"
        if path.exists():
            found[rank] = json.loads(path.read_text())
    return found


if __name__ == "__main__":
    train(json.loads(sys.argv[1]))
    _tear_down_process_group()
