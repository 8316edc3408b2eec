"""Section 1: time from the launch cell starting to every rank's first training step.

For each contender and repetition a fresh kernel imports torch, the workload and the contender
(outside the timing), then launches ``train`` in ``mode="raw"`` (plain DDP, so only the
launchers differ) once — the *first launch* — and again ``repeats`` times in the same kernel —
*repeated launches*. The latency is the last rank's ``time.time()`` after its first optimizer step
minus the kernel's ``time.time()`` just before the launcher call; for torchrun that is just before
``subprocess.run`` starts it. Repetitions are interleaved with a rotating order.

``no_launcher`` is the floor: the kernel imports what the first optimizer step imports
(``torch._dynamo``, the fastest way known here: the garbage collector paused), then runs the same
function itself, as one process. Some process must do that import after the import cell, whatever
launches the ranks, so no launcher's first launch right after the import cell can be faster, and
``floor_vs_accelerate`` bounds the ratio any launcher can reach against Accelerate's.
"""

from __future__ import annotations

from typing import Any

from benchmarks import harness as H

CONTENDERS = ("nbaccel", "accelerate", "mp_fork", "mp_spawn", "torchrun", "no_launcher")
# The contenders a smoke run launches twice: their repeat launch takes another path (nbaccel's
# warm fork server, the kernel's imports already done); the others' repeat is their first again.
TWICE_IN_SMOKE = ("nbaccel", "no_launcher")


def run(reps: int, smoke: bool, world: int, scratch: H.Scratch) -> dict[str, Any]:
    cfg = {"mode": "raw", "steps": 3 if smoke else 10, "warmup": 0}
    repeats = 1 if smoke else 2
    contenders = [c for c in CONTENDERS if H.unavailable_reason(c) is None]
    raw: dict[str, dict[str, list]] = {
        c: {
            **{k + kind: [] for k in ("", "cell_", "load_") for kind in ("first", "repeat")},
            "errors": [],
        }
        for c in contenders
    }

    def launch(session: Any, c: str, kind: str) -> None:
        ranks = 1 if c == "no_launcher" else world
        try:
            load = H.load_now()
            result = H.run_launch(session, c, cfg, ranks, scratch)
            raw[c][kind].append(H.first_step_latency(result, ranks))
            raw[c]["cell_" + kind].append(result["t1"] - result["t0"])
            if load is not None:
                raw[c]["load_" + kind].append(load)
        except Exception as exc:  # noqa: BLE001 - one failed launch is reported, not fatal
            raw[c]["errors"].append(f"{kind}: {type(exc).__name__}: {str(exc)[-400:]}")

    if smoke:
        # One kernel for all: a smoke run checks the wiring, not the first-launch cost.
        with H.kernel(contenders) as session:
            for c in contenders:
                launch(session, c, "first")
                if c in TWICE_IN_SMOKE:
                    launch(session, c, "repeat")
    else:
        for rep in range(reps):
            for c in H.rotated(contenders, rep):
                with H.kernel([c]) as session:
                    launch(session, c, "first")
                    for _ in range(repeats):
                        launch(session, c, "repeat")

    out: dict[str, Any] = {
        "what": "seconds from the kernel's clock just before the launcher call to the last "
        "rank's first optimizer step (same plain-DDP function for all)",
        "steps_per_launch": cfg["steps"],
        "repeats_per_kernel": repeats,
        "fresh_kernel_per_first_launch": not smoke,
        "contenders": {},
    }
    for c in CONTENDERS:
        if c not in raw:
            out["contenders"][c] = {"unavailable": H.unavailable_reason(c)}
            continue
        r = raw[c]
        out["contenders"][c] = {
            "call": H.CALLS[c],
            "first_launch_s": H.summary(r["first"]),
            "repeat_launch_s": H.summary(r["repeat"]),
            "cell_first_s": H.summary(r["cell_first"]),
            "cell_repeat_s": H.summary(r["cell_repeat"]),
            "load_first_1min": H.summary(r["load_first"], 2),
            "load_repeat_1min": H.summary(r["load_repeat"], 2),
            "errors": r["errors"],
        }
    base = out["contenders"].get("nbaccel", {})
    for entry in out["contenders"].values():
        if "unavailable" in entry or "unavailable" in base:
            continue
        for key in ("first_launch_s", "repeat_launch_s"):
            entry[key.replace("_s", "_vs_nbaccel")] = H.ratio(
                entry[key]["median"], base[key]["median"]
            )
    first = {c: e.get("first_launch_s", {}).get("median") for c, e in out["contenders"].items()}
    out["nbaccel_first_vs_accelerate"] = H.ratio(first.get("nbaccel"), first.get("accelerate"))
    out["floor_vs_accelerate"] = H.ratio(first.get("no_launcher"), first.get("accelerate"))
    return out
