"""Section "transfer": how long a tensor argument takes to reach the ranks, and a result to come back.

Launched from this process with ``nbaccel.notebook_launcher`` on ``world`` CPU ranks (no notebook
needed: the path measured is pickling/shared memory, not the frontend). For each size:

- argument: the kernel's ``time.time()`` just before the launcher call → the last rank entering
  the function with the tensor in hand (it touches one element of it);
- result: rank 0's ``time.time()`` just before it returns a tensor of that size (allocated before
  the clock starts) → the kernel's clock when the launcher has returned it.

Each is also measured for a 4-byte tensor in the same repetition; the "extra" columns are the
paired per-repetition differences (the launch's own cost taken out). Repetitions interleave the
sizes. The machine is shared with other work, so single runs wobble; compare medians.
"""

from __future__ import annotations

import gc
import statistics
import time
from typing import Any

from benchmarks import harness as H

MB = 1_000_000


def _receive(tensor: Any) -> float:
    import time

    float(tensor[-1])  # the data is really there
    return time.time()


def _produce(nbytes: int) -> tuple[Any, float]:
    import time

    import torch

    tensor = torch.ones(max(1, nbytes // 4))
    return tensor, time.time()


def _argument_seconds(world: int, nbytes: int) -> float:
    import torch

    import nbaccel

    tensor = torch.ones(max(1, nbytes // 4))
    t0 = time.time()
    entered = nbaccel.notebook_launcher(
        _receive, args=(tensor,), num_processes=world, view=H.QuietView(), return_all=True
    )
    return max(entered) - t0


def _result_seconds(world: int, nbytes: int) -> float:
    import nbaccel

    tensor, sent = nbaccel.notebook_launcher(
        _produce, args=(nbytes,), num_processes=world, view=H.QuietView()
    )
    done = time.time()
    if tensor.numel() != max(1, nbytes // 4):
        raise RuntimeError(f"result has {tensor.numel()} elements, expected {nbytes // 4}")
    return done - sent


def run(reps: int, smoke: bool, world: int) -> dict[str, Any]:
    sizes = [1 * MB] if smoke else [1 * MB, 100 * MB, 200 * MB, 1000 * MB]
    reps = 1 if smoke else reps
    raw: dict[int, dict[str, list[float]]] = {
        n: {"arg": [], "arg_base": [], "res": [], "res_base": []} for n in sizes
    }
    errors: list[str] = []
    _argument_seconds(world, 4)  # the fork server's first start is not a transfer
    for rep in range(reps):
        for n in H.rotated([str(s) for s in sizes], rep):
            n = int(n)
            try:
                raw[n]["arg_base"].append(_argument_seconds(world, 4))
                raw[n]["arg"].append(_argument_seconds(world, n))
                gc.collect()
                raw[n]["res_base"].append(_result_seconds(world, 4))
                raw[n]["res"].append(_result_seconds(world, n))
                gc.collect()
            except Exception as exc:  # noqa: BLE001 - reported in the table
                errors.append(f"{n // MB} MB: {type(exc).__name__}: {str(exc)[-300:]}")
    contenders: dict[str, Any] = {}
    for n, r in raw.items():
        arg_extra = [a - b for a, b in zip(r["arg"], r["arg_base"])]
        res_extra = [a - b for a, b in zip(r["res"], r["res_base"])]
        contenders[f"{n // MB} MB"] = {
            "bytes": n,
            "argument_s": H.summary(r["arg"]),
            "argument_extra_s": H.summary(arg_extra),
            "result_s": H.summary(r["res"]),
            "result_extra_s": H.summary(res_extra),
            "tiny_argument_s": H.summary(r["arg_base"]),
            "tiny_result_s": H.summary(r["res_base"]),
            "argument_gb_per_s": _rate(n, r["arg"]),
            "result_gb_per_s": _rate(n, r["res"]),
        }
    return {
        "what": "seconds; argument: launcher call -> last rank has it; result: rank 0 returns -> "
        "launcher returned it; 'extra' = minus the same with a 4-byte tensor (paired)",
        "world_size": world,
        "contenders": contenders,
        "errors_all": errors,
        "targets": {"200 MB argument_s": 0.3, "200 MB result_s": 0.3},
    }


def _rate(nbytes: int, seconds: list[float]) -> float | None:
    if not seconds:
        return None
    return round(nbytes / statistics.median(seconds) / 1e9, 2)
