"""Section "reporting": what ``nbaccel.log()`` and ``nbaccel.progress`` cost inside a rank.

One rank is launched with ``nbaccel.notebook_launcher`` (so the event channel, the tick thread
and the tqdm hook are the real ones) and times, interleaved ``reps`` times, each in a loop that
does nothing else: an empty loop (subtracted), ``for _ in nbaccel.progress(range(N))``,
``for _ in tqdm.tqdm(range(N))`` as a rank sees it (hooked, drawing to the dashboard), a second
launch with ``NBACCEL_TQDM=0`` for plain tqdm (drawing to /dev/null), and ``nbaccel.log()`` with
a float, with a one-element tensor, and with both. Per-call costs are medians over the
repetitions; the ratios against tqdm come from the same rank in the same run. The machine is
shared, so single numbers wobble by tens of percent; compare ratios, not absolutes.
"""

from __future__ import annotations

import statistics
from typing import Any

from benchmarks import harness as H


def _measure(n_iter: int, n_log: int, reps: int) -> dict[str, list[float]]:
    """Runs in the rank: per-call microseconds of each loop, ``reps`` interleaved times."""
    import os
    import time

    import torch
    import tqdm

    import nbaccel

    loss = torch.tensor(0.25)
    devnull = open(os.devnull, "w")  # noqa: SIM115 - lives as long as the rank

    def empty(n: int) -> None:
        for _ in range(n):
            pass

    def progress(n: int) -> None:
        for _ in nbaccel.progress(range(n)):
            pass

    def tqdm_loop(n: int) -> None:
        for _ in tqdm.tqdm(range(n), file=devnull):
            pass

    def log_float(n: int) -> None:
        log = nbaccel.log
        for i in range(n):
            log({"lr": 0.1}, step=i)

    def log_tensor(n: int) -> None:
        log = nbaccel.log
        for i in range(n):
            log({"loss": loss}, step=i)

    def log_both(n: int) -> None:
        log = nbaccel.log
        for i in range(n):
            log({"loss": loss, "lr": 0.1}, step=i)

    loops = {
        "progress": (progress, n_iter),
        "tqdm": (tqdm_loop, n_iter),
        "log_float": (log_float, n_log),
        "log_tensor": (log_tensor, n_log),
        "log_tensor_and_float": (log_both, n_log),
    }
    out: dict[str, list[float]] = {name: [] for name in loops}
    for _ in range(reps):
        for name, (fn, n) in loops.items():
            t0 = time.perf_counter()
            empty(n)
            t1 = time.perf_counter()
            fn(n)
            t2 = time.perf_counter()
            out[name].append(((t2 - t1) - (t1 - t0)) / n * 1e6)
    return out


def run(reps: int, smoke: bool) -> dict[str, Any]:
    import nbaccel

    n_iter, n_log = (20_000, 5_000) if smoke else (1_000_000, 200_000)
    inner = 2 if smoke else max(7, reps)
    hooked = nbaccel.notebook_launcher(
        _measure, args=(n_iter, n_log, inner), num_processes=1, view=H.QuietView()
    )
    plain = nbaccel.notebook_launcher(
        _measure,
        args=(n_iter, 10, 1),
        num_processes=1,
        view=H.QuietView(),
        env={"NBACCEL_TQDM": "0"},
    )
    rows = {
        "log_float": ("nbaccel.log({'lr': 0.1}, step=i)", hooked["log_float"]),
        "log_tensor": ("nbaccel.log({'loss': tensor}, step=i)", hooked["log_tensor"]),
        "log_tensor_and_float": (
            "nbaccel.log({'loss': tensor, 'lr': 0.1}, step=i)",
            hooked["log_tensor_and_float"],
        ),
        "progress": ("for _ in nbaccel.progress(range(N))", hooked["progress"]),
        "tqdm_hooked": ("for _ in tqdm.tqdm(range(N)) in a rank (hooked)", hooked["tqdm"]),
        "tqdm_plain": ("for _ in tqdm.tqdm(range(N)), NBACCEL_TQDM=0", plain["tqdm"]),
    }
    contenders = {
        name: {"description": desc, "us_per_call": H.summary(values, 4)}
        for name, (desc, values) in rows.items()
    }
    # Paired per repetition: the progress loop and the tqdm loop ran back to back.
    pairs = [p / t for p, t in zip(hooked["progress"], hooked["tqdm"]) if t > 0]
    return {
        "what": "microseconds per call/iteration inside a launched rank, empty loop subtracted",
        "iterations": n_iter,
        "log_calls": n_log,
        "contenders": contenders,
        "progress_vs_tqdm_hooked_paired": round(statistics.median(pairs), 3) if pairs else None,
        "progress_vs_tqdm_plain": H.ratio(
            contenders["progress"]["us_per_call"]["median"],
            contenders["tqdm_plain"]["us_per_call"]["median"],
        ),
        "targets": {"log_us": 1.0, "progress_vs_tqdm": 1.0},
    }
