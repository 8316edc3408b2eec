"""Section "scaling": launch → first step as the rank count grows, and the first launch in a fresh
kernel as a function of the pause between the import cell and the launch cell.

- ranks: one kernel per contender and repetition; after one untimed launch (the fork server, or
  torch elastic, warmed), ``train`` in ``mode="raw"`` is launched on 1, 2, 4 and 8 CPU ranks (in a
  rotating order) and timed like section 1: the kernel's clock just before the launcher call → the
  last rank's first optimizer step. 8 ranks on 2 cores is oversubscribed on purpose.
- fresh kernel: a new kernel imports torch and the workload, then runs the contender's import
  cell (timed: ``import nbaccel`` should add little to it), waits 0, 1 or 5 s (a person reading
  the next cell), then runs the launch cell once; timed the same way.
  nbaccel starts warming its fork server at ``import nbaccel``, so the pause is when that pays off.

Contenders interleave in a rotating order within each repetition. The machine is shared, so
compare within a row.
"""

from __future__ import annotations

import time
from typing import Any

from benchmarks import harness as H

CONTENDERS = ("nbaccel", "accelerate", "mp_fork")
RANKS = (1, 2, 4, 8)
PAUSES = (0.0, 1.0, 5.0)


def run(reps: int, smoke: bool, scratch: H.Scratch) -> dict[str, Any]:
    cfg = {"mode": "raw", "steps": 2 if smoke else 5, "warmup": 0}
    ranks = (1, 2) if smoke else RANKS
    pauses = (0.0,) if smoke else PAUSES
    reps = 1 if smoke else reps
    # A smoke run checks the wiring with nbaccel alone (every kernel costs seconds).
    contenders = [c for c in CONTENDERS if H.unavailable_reason(c) is None]
    contenders = contenders[:1] if smoke else contenders
    by_ranks: dict[str, dict[int, list[float]]] = {c: {n: [] for n in ranks} for c in contenders}
    by_pause: dict[str, dict[float, list[float]]] = {c: {p: [] for p in pauses} for c in contenders}
    errors: dict[str, list[str]] = {c: [] for c in contenders}
    import_s: dict[str, list[float]] = {c: [] for c in contenders}

    def timed(session: Any, c: str, world: int) -> float:
        result = H.run_launch(session, c, cfg, world, scratch)
        return H.first_step_latency(result, world)

    for rep in range(reps):
        for c in H.rotated(contenders, rep):
            try:
                with H.kernel([c]) as session:
                    timed(session, c, 2)  # warm: this row is about rank count, not first start
                    for n in H.rotated([str(n) for n in ranks], rep):
                        if c == "accelerate" and n == "1":
                            continue  # its launcher runs 1 process in the kernel itself
                        by_ranks[c][int(n)].append(timed(session, c, int(n)))
            except Exception as exc:  # noqa: BLE001 - one failure is reported, not fatal
                errors[c].append(f"ranks: {type(exc).__name__}: {str(exc)[-300:]}")
            for pause in H.rotated([str(p) for p in pauses], rep):
                try:
                    with H.kernel() as session:  # torch and the workload only
                        import_s[c].append(H.timed_cell(session, H.IMPORTS[c]))
                        time.sleep(float(pause))
                        by_pause[c][float(pause)].append(timed(session, c, 2))
                except Exception as exc:  # noqa: BLE001
                    errors[c].append(f"pause {pause}: {type(exc).__name__}: {str(exc)[-300:]}")

    out: dict[str, Any] = {
        "what": "seconds from the launcher call to the last rank's first optimizer step",
        "ranks": list(ranks),
        "pauses_s": list(pauses),
        "contenders": {},
    }
    for c in CONTENDERS:
        if c not in contenders:
            why = H.unavailable_reason(c) or "not run in a smoke run"
            out["contenders"][c] = {"unavailable": why}
            continue
        out["contenders"][c] = {
            "call": H.CALLS[c],
            "by_ranks": {str(n): H.summary(v) for n, v in by_ranks[c].items()},
            "fresh_kernel_by_pause": {f"{p:g}": H.summary(v) for p, v in by_pause[c].items()},
            "first_launch_s": H.summary(by_pause[c][pauses[0]]),
            "import_cell_s": H.summary(import_s[c]),
            "errors": errors[c],
        }
    base = out["contenders"].get("nbaccel", {})
    for entry in out["contenders"].values():
        if "unavailable" in entry or "unavailable" in base:
            continue
        entry["fresh_vs_nbaccel"] = {
            p: H.ratio(s["median"], base["fresh_kernel_by_pause"][p]["median"])
            for p, s in entry["fresh_kernel_by_pause"].items()
        }
    return out
