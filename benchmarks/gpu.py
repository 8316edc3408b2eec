"""Section 5 (optional): mixed-precision step time on one GPU, nbaccel against plain autocast.

Runs only where CUDA is available (otherwise the section says so and is skipped). In this
process, one GPU, the same MLP for every contender, interleaved:

- ``autocast_bf16``: a plain loop under ``torch.autocast("cuda", dtype=torch.bfloat16)``;
- ``nbaccel_bf16``: ``nbaccel.Accelerator(mixed_precision="bf16")`` with ``autocast()`` and
  ``backward()``;
- ``nbaccel_fp8``: ``Accelerator(mixed_precision="fp8")`` (compute capability 8.9+ and torchao;
  reported as unavailable otherwise, with the reason).

Step time is the median over timed steps (after warm-up) of CUDA-synchronised wall time.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

from benchmarks import harness as H

WIDTH, DEPTH, BATCH = 4096, 4, 512


def _model(torch: Any) -> Any:
    torch.manual_seed(0)
    layers: list[Any] = []
    for _ in range(DEPTH):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.GELU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(WIDTH, 16))


def _time_steps(torch: Any, contender: str, steps: int, warmup: int) -> float:
    device = torch.device("cuda")
    model = _model(torch)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(BATCH, WIDTH, device=device)
    y = torch.randint(0, 16, (BATCH,), device=device)
    if contender == "autocast_bf16":
        model = model.to(device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def forward_context() -> Any:
            return torch.autocast("cuda", dtype=torch.bfloat16)

        backward = torch.Tensor.backward
    else:
        from nbaccel import Accelerator

        acc = Accelerator(mixed_precision=contender.split("_", 1)[1])
        model, optimizer = acc.prepare(model, optimizer)
        forward_context, backward = acc.autocast, acc.backward
    times = []
    for step in range(warmup + steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        with forward_context():
            loss = torch.nn.functional.cross_entropy(model(x), y)
        backward(loss)
        optimizer.step()
        torch.cuda.synchronize()
        if step >= warmup:
            times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


def run(reps: int, smoke: bool) -> dict[str, Any]:
    import torch

    if not torch.cuda.is_available():
        return {
            "skipped": "CUDA is not available on this machine (torch "
            f"{torch.__version__}); the GPU section runs only where a CUDA device is visible."
        }
    steps, warmup = (5, 2) if smoke else (50, 10)
    contenders = ["autocast_bf16", "nbaccel_bf16", "nbaccel_fp8"]
    results: dict[str, list[float]] = {c: [] for c in contenders}
    errors: dict[str, str] = {}
    for rep in range(reps):
        for c in H.rotated(contenders, rep):
            if c in errors:
                continue
            try:
                results[c].append(_time_steps(torch, c, steps, warmup))
            except Exception as exc:  # noqa: BLE001 - e.g. fp8 on a GPU without fp8 support
                errors[c] = f"{type(exc).__name__}: {str(exc)[:300]}"
            with contextlib.suppress(Exception):
                torch.cuda.empty_cache()
    out: dict[str, Any] = {
        "what": "median seconds per training step on one GPU (lower is better)",
        "device": torch.cuda.get_device_name(0),
        "model": f"MLP {DEPTH}x{WIDTH}, batch {BATCH}",
        "contenders": {},
    }
    base = H.summary(results["autocast_bf16"], digits=6)["median"]
    for c in contenders:
        if c in errors and not results[c]:
            out["contenders"][c] = {"unavailable": errors[c]}
            continue
        stats = H.summary(results[c], digits=6)
        out["contenders"][c] = {"step_s": stats, "vs_autocast_bf16": H.ratio(stats["median"], base)}
    return out
