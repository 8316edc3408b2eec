"""Section 3: what reaches the notebook during a long loop: iopub messages and bytes per second.

Two ways to watch 2 ranks train for 5,000 steps, in one kernel with the widget dashboard forced
(``NBACCEL_VIEW=widgets``), interleaved:

- ``nbaccel_dash``: ``nbaccel.progress`` + ``accelerator.log`` every step, nbaccel's dashboard;
- ``accelerate_tqdm``: a per-rank ``tqdm`` bar (tqdm's default 0.1 s redraw interval) under
  Accelerate's launcher, whose forked ranks write through the kernel's own output streams.

Every iopub message of the cell is counted (``stream``, ``comm_msg``, ``display_data``, ...; the
two ``status`` messages are not) and sized as the JSON of its header, parent header, metadata and
content. Rates are over the cell's wall time as the client saw it.
"""

from __future__ import annotations

import collections
from typing import Any

from benchmarks import harness as H

CONTENDERS = {
    "nbaccel_dash": ("nbaccel", "nbaccel_dash"),
    "accelerate_tqdm": ("accelerate", "accelerate_tqdm"),
}


def _reason(name: str) -> str | None:
    launcher, mode = CONTENDERS[name]
    if mode.startswith("nbaccel"):
        return H.unavailable_reason("nbaccel_acc")
    return H.unavailable_reason(launcher)


def run(reps: int, smoke: bool, world: int, scratch: H.Scratch) -> dict[str, Any]:
    steps = 60 if smoke else 5000
    names = [n for n in CONTENDERS if _reason(n) is None]
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    errors: dict[str, list[str]] = {n: [] for n in names}
    if names:
        launchers = [CONTENDERS[n][0] for n in names]
        with H.kernel(launchers, env={"NBACCEL_VIEW": "widgets"}) as session:
            for rep in range(reps):
                for name in H.rotated(names, rep):
                    launcher, mode = CONTENDERS[name]
                    cfg = {"mode": mode, "steps": steps, "warmup": 0}
                    try:
                        result = H.run_launch(session, launcher, cfg, world, scratch)
                    except Exception as exc:  # noqa: BLE001 - reported, not fatal
                        errors[name].append(f"{type(exc).__name__}: {str(exc)[-400:]}")
                        continue
                    messages = result["cell"].messages
                    seconds = result["done"] - result["sent"]
                    size = sum(H.message_bytes(m) for m in messages)
                    runs[name].append(
                        {
                            "seconds": seconds,
                            "messages": len(messages),
                            "bytes": size,
                            "msgs_per_s": len(messages) / seconds,
                            "bytes_per_s": size / seconds,
                            "by_type": dict(collections.Counter(m["msg_type"] for m in messages)),
                        }
                    )

    out: dict[str, Any] = {
        "what": "iopub messages and bytes reaching the notebook per second of the launch cell",
        "steps": steps,
        "contenders": {},
    }
    for name in CONTENDERS:
        if name not in runs:
            out["contenders"][name] = {"unavailable": _reason(name)}
            continue
        rs = runs[name]
        out["contenders"][name] = {
            "msgs_per_s": H.summary([r["msgs_per_s"] for r in rs], digits=2),
            "bytes_per_s": H.summary([r["bytes_per_s"] for r in rs], digits=0),
            "messages_per_run": H.summary([r["messages"] for r in rs], digits=0),
            "bytes_per_run": H.summary([r["bytes"] for r in rs], digits=0),
            "cell_seconds": H.summary([r["seconds"] for r in rs], digits=2),
            "by_type_last_run": rs[-1]["by_type"] if rs else {},
            "errors": errors[name],
        }
    return out
