"""Section "heavy": the kernel has imported a heavy package (``from transformers import Trainer``,
before the launcher), and the launched function imports it too, as a Hugging Face notebook does.

For each contender and repetition a fresh kernel imports torch, the workload, transformers'
Trainer and then the contender, and defines ``train_hf`` in a cell (``from transformers import
Trainer`` in its body, then the same plain-DDP ``train`` as section 1). It is launched right after
that import cell (*first launch*), then, after the kernel has idled ``IDLE_S`` seconds (as it
does while the person reads the output: nbaccel's fork server finishes mirroring the kernel's
imports meanwhile), again ``repeats`` times (*warm relaunch*), timed as in section 1: the
kernel's clock just before the launcher call → the last rank's first optimizer step, and the
launcher call whole (until the cell can go on). The load average is recorded beside each launch.

Accelerate's ranks are forks of the kernel, so they inherit transformers; nbaccel's come from a
fresh fork server that mirrors the kernel's imports (the function's first, before the ranks fork).
"""

from __future__ import annotations

import importlib.util
import time
from typing import Any

from benchmarks import harness as H

CONTENDERS = ("nbaccel", "accelerate")
# Seconds the kernel idles between the first launch and the relaunches (none in a smoke run).
IDLE_S = 5.0
HEAVY = "from transformers import Trainer"
DEFINE = (
    "def train_hf(cfg):\n"
    "    from transformers import Trainer  # noqa: F401 - what a Trainer notebook's function does\n"
    "    return W.train(cfg)\n"
)
CALL = {
    "nbaccel": "nbaccel.notebook_launcher(train_hf, args=(_cfg,), num_processes={world})",
    "accelerate": (
        "accelerate_launcher(train_hf, args=(_cfg,), num_processes={world}, "
        "use_port=str(W.free_port()))"
    ),
}


def unavailable_reason(contender: str) -> str | None:
    if importlib.util.find_spec("transformers") is None:
        return "transformers is not installed (the dev extra pins it)"
    return H.unavailable_reason(contender)


def run(reps: int, smoke: bool, world: int, scratch: H.Scratch) -> dict[str, Any]:
    cfg = {"mode": "raw", "steps": 3 if smoke else 10, "warmup": 0}
    repeats = 1 if smoke else 3
    reps = 1 if smoke else reps
    contenders = [c for c in CONTENDERS if unavailable_reason(c) is None]
    kinds = ("first", "repeat", "first_cell", "repeat_cell", "first_load", "repeat_load")
    kinds += ("first_function", "repeat_function")
    raw: dict[str, dict[str, list]] = {
        c: {**{k: [] for k in kinds}, "import_cell": [], "errors": []} for c in contenders
    }
    for rep in range(reps):
        for c in H.rotated(contenders, rep):
            try:
                with H.kernel() as session:  # torch and the workload only
                    cell = f"{HEAVY}\n{H.IMPORTS[c]}\n{DEFINE}"
                    raw[c]["import_cell"].append(H.timed_cell(session, cell))
                    for i, kind in enumerate(["first"] + ["repeat"] * repeats):
                        if i == 1 and not smoke:
                            time.sleep(IDLE_S)  # once, after the first launch
                        load = H.load_now()
                        result = H.run_call(
                            session, CALL[c].format(world=world), cfg, world, scratch
                        )
                        raw[c][kind].append(H.first_step_latency(result, world))
                        raw[c][kind + "_cell"].append(result["t1"] - result["t0"])
                        raw[c][kind + "_load"].append(load)
                        raw[c][kind + "_function"].append(H.function_span(result, world))
            except Exception as exc:  # noqa: BLE001 - one failed run is reported, not fatal
                raw[c]["errors"].append(f"{type(exc).__name__}: {str(exc)[-400:]}")
    out: dict[str, Any] = {
        "what": "seconds from the launcher call to the last rank's first optimizer step, in a "
        f"kernel that ran `{HEAVY}` before the launcher; the function imports it too",
        "repeats_per_kernel": repeats,
        "idle_before_relaunch_s": 0 if smoke else IDLE_S,
        "contenders": {},
    }
    for c in CONTENDERS:
        if c not in raw:
            out["contenders"][c] = {"unavailable": unavailable_reason(c)}
            continue
        r = raw[c]
        out["contenders"][c] = {
            "first_launch_s": H.summary(r["first"]),
            "repeat_launch_s": H.summary(r["repeat"]),
            "first_cell_s": H.summary(r["first_cell"]),
            "repeat_cell_s": H.summary(r["repeat_cell"]),
            "first_load_1min": H.summary([x for x in r["first_load"] if x is not None], 2),
            "repeat_load_1min": H.summary([x for x in r["repeat_load"] if x is not None], 2),
            "import_cell_s": H.summary(r["import_cell"]),
            # The function's own span (first rank in → last rank out) in each launch.
            "first_function_s": H.summary(r["first_function"]),
            "repeat_function_s": H.summary(r["repeat_function"]),
            "errors": r["errors"],
        }
    keys = ("first_launch_s", "repeat_launch_s", "first_cell_s", "repeat_cell_s")
    medians = {
        c: {k: e.get(k, {}).get("median") for k in keys} for c, e in out["contenders"].items()
    }
    for key in keys:
        out[key.replace("_s", "_nbaccel_vs_accelerate")] = H.ratio(
            medians.get("nbaccel", {}).get(key), medians.get("accelerate", {}).get(key)
        )
    # The floor of the warm-relaunch ratio: the function's own span (the shorter of the two
    # contenders' medians) over Accelerate's whole call. A launcher that cost nothing would
    # reach this ratio, no lower.
    spans = [
        e["repeat_function_s"]["median"]
        for e in out["contenders"].values()
        if e.get("repeat_function_s", {}).get("median") is not None
    ]
    out["repeat_floor_vs_accelerate"] = H.ratio(
        min(spans, default=None), medians.get("accelerate", {}).get("repeat_cell_s")
    )
    return out
