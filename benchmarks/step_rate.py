"""Section 2: training steps per second of the same model and loop under four drivers.

All run in one kernel with the widget dashboard forced (``NBACCEL_VIEW=widgets``), interleaved:

- ``raw``: plain DDP loop, ranks from ``torch.multiprocessing.start_processes(fork)``;
- ``nbaccel``: ``nbaccel.Accelerator`` loop under ``notebook_launcher(progress=False)``;
- ``nbaccel_dash``: the same plus ``nbaccel.progress`` around the loop and ``accelerator.log``
  every step, under ``notebook_launcher()`` with the live widget dashboard in the kernel;
- ``accelerate``: Accelerate's ``Accelerator(cpu=True)`` loop under Accelerate's launcher;
- ``nbaccel_progress`` / ``nbaccel_log``: diagnostics, the dashboard run with only one of the
  two per-step calls, to show which one costs.

Each rank times its steady state (after ``warmup`` steps) with ``perf_counter``; a run's rate is
the slowest rank's. The kernel's CPU seconds per second of the launch (``time.process_time``,
every kernel thread) show what the relay and the view take from the cores the ranks run on.
Thread counts are pinned in the workload, so launchers' defaults do not differ.
"""

from __future__ import annotations

from typing import Any

from benchmarks import harness as H

# contender -> (launcher, workload mode, extra launcher keywords)
CONTENDERS = {
    "raw": ("mp_fork", "raw", ""),
    "nbaccel": ("nbaccel", "nbaccel", ", progress=False"),
    "nbaccel_dash": ("nbaccel", "nbaccel_dash", ""),
    "accelerate": ("accelerate", "accelerate", ""),
    # Diagnostics: the dashboard with only one of the two per-step calls.
    "nbaccel_progress": ("nbaccel", "nbaccel_progress", ""),
    "nbaccel_log": ("nbaccel", "nbaccel_log", ""),
}
DESCRIPTIONS = {
    "raw": "raw torch DDP loop (start_processes fork)",
    "nbaccel": "nbaccel Accelerator (no view)",
    "nbaccel_dash": "nbaccel Accelerator + widget dashboard + progress/log every step",
    "accelerate": "Accelerate Accelerator(cpu=True) under accelerate.notebook_launcher",
    "nbaccel_progress": "(diagnostic) nbaccel + dashboard + progress only",
    "nbaccel_log": "(diagnostic) nbaccel + dashboard + accelerator.log only",
}


def _reason(name: str) -> str | None:
    launcher, mode, _ = CONTENDERS[name]
    return H.unavailable_reason(launcher) or (
        H.unavailable_reason("nbaccel_acc") if mode.startswith("nbaccel") else None
    )


def run(reps: int, smoke: bool, world: int, scratch: H.Scratch) -> dict[str, Any]:
    steps, warmup = (40, 10) if smoke else (1500, 100)
    names = [n for n in CONTENDERS if _reason(n) is None]
    rates: dict[str, list[float]] = {n: [] for n in names}
    kernel_cpu: dict[str, list[float]] = {n: [] for n in names}
    errors: dict[str, list[str]] = {n: [] for n in names}
    launchers = [CONTENDERS[n][0] for n in names]
    if names:
        with H.kernel(launchers, env={"NBACCEL_VIEW": "widgets"}) as session:
            for rep in range(reps):
                for name in H.rotated(names, rep):
                    launcher, mode, kw = CONTENDERS[name]
                    cfg = {"mode": mode, "steps": steps, "warmup": warmup}
                    try:
                        result = H.run_launch(session, launcher, cfg, world, scratch, kw=kw)
                        per_rank = [r.get("steps_per_s") for r in result["ranks"].values()]
                        if len(per_rank) != world or None in per_rank:
                            raise RuntimeError(f"ranks reported {result['ranks']}")
                        rates[name].append(min(per_rank))
                        share = H.kernel_cpu_share(result)
                        if share is not None:
                            kernel_cpu[name].append(share)
                    except Exception as exc:  # noqa: BLE001 - reported, not fatal
                        errors[name].append(f"{type(exc).__name__}: {str(exc)[-400:]}")

    out: dict[str, Any] = {
        "what": "steady-state optimizer steps per second (slowest rank), higher is better",
        "steps": steps,
        "warmup": warmup,
        "target": "nbaccel_dash within 3% of raw",
        "contenders": {},
    }
    raw_median = None
    for name in CONTENDERS:
        if name not in rates:
            out["contenders"][name] = {"unavailable": _reason(name)}
            continue
        stats = H.summary(rates[name], digits=2)
        if name == "raw":
            raw_median = stats["median"]
        out["contenders"][name] = {
            "description": DESCRIPTIONS[name],
            "steps_per_s": stats,
            "kernel_cpu_per_s": H.summary(kernel_cpu[name], digits=3),
            "errors": errors[name],
        }
    for name, entry in out["contenders"].items():
        if "steps_per_s" in entry:
            entry["vs_raw"] = H.ratio(entry["steps_per_s"]["median"], raw_median)
            entry["vs_raw_paired"] = H.paired_ratio(rates[name], rates.get("raw", []))
    dash = out["contenders"].get("nbaccel_dash", {}).get("vs_raw")
    out["target_met"] = None if dash is None else dash >= 0.97
    return out
