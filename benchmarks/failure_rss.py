"""Section 4: how fast a rank's failure reaches the notebook, and what the kernel keeps per launch.

*Failure*: rank 1 raises right after its first optimizer step (having written ``time.time()``
to its record); rank 0 goes on training and meets the dead peer in its next all-reduce. Measured:
the client's ``time.time()`` when the cell's ``error`` message arrives minus the rank's time,
plus what the notebook is shown (the exception name, and whether rank 1's own message is in it).

*RSS*: one kernel per launcher, 20 short launches each (interleaved across the kernels); the
kernel's resident memory after launch 20 minus after launch 1, as the client reads it (psutil).
"""

from __future__ import annotations

import time
from typing import Any

import psutil

from benchmarks import harness as H

FAILURE_CONTENDERS = ("nbaccel", "accelerate", "mp_fork", "torchrun")
RSS_CONTENDERS = ("nbaccel", "accelerate", "mp_fork")
CAUSE = "benchmark failure injected"


def run_failure(reps: int, smoke: bool, world: int, scratch: H.Scratch) -> dict[str, Any]:
    contenders = [c for c in FAILURE_CONTENDERS if H.unavailable_reason(c) is None]
    cfg = {"mode": "raw", "steps": 1_000_000, "warmup": 0, "fail_rank": 1}
    delays: dict[str, list[float]] = {c: [] for c in contenders}
    shown: dict[str, dict[str, Any]] = {}
    errors: dict[str, list[str]] = {c: [] for c in contenders}
    with H.kernel(contenders) as session:
        for rep in range(reps):
            for c in H.rotated(contenders, rep):
                seen: dict[str, float] = {}

                def on_message(msg: dict[str, Any], seen: dict[str, float] = seen) -> None:
                    if msg["msg_type"] == "error" and "error" not in seen:
                        seen["error"] = time.time()

                try:
                    result = H.run_launch(
                        session,
                        c,
                        cfg,
                        world,
                        scratch,
                        expect_error=True,
                        on_message=on_message,
                        timeout=180,
                    )
                    failed_at = result["ranks"].get(1, {}).get("failed_at")
                    cell = result["cell"]
                    if cell.error is None or "error" not in seen or failed_at is None:
                        raise RuntimeError("the launch did not raise after rank 1 failed")
                    delays[c].append(seen["error"] - failed_at)
                    shown[c] = {
                        "exception": cell.error["ename"],
                        "names_rank_error": CAUSE in cell.error_text,
                        "error_chars": len(cell.error_text),
                    }
                except Exception as exc:  # noqa: BLE001 - reported, not fatal
                    errors[c].append(f"{type(exc).__name__}: {str(exc)[-400:]}")
    out: dict[str, Any] = {
        "what": "seconds from rank 1 raising to the cell's error reaching the client",
        "contenders": {},
    }
    for c in FAILURE_CONTENDERS:
        if c not in delays:
            out["contenders"][c] = {"unavailable": H.unavailable_reason(c)}
            continue
        out["contenders"][c] = {
            "call": H.CALLS[c],
            "seconds": H.summary(delays[c], digits=3),
            **shown.get(c, {}),
            "errors": errors[c],
        }
    return out


def run_rss(smoke: bool, world: int, scratch: H.Scratch) -> dict[str, Any]:
    launches = 2 if smoke else 20
    contenders = [c for c in RSS_CONTENDERS if H.unavailable_reason(c) is None]
    cfg = {"mode": "raw", "steps": 3, "warmup": 0}
    rss: dict[str, list[int]] = {c: [] for c in contenders}
    errors: dict[str, list[str]] = {c: [] for c in contenders}
    sessions: dict[str, Any] = {}
    kernels = [H.kernel([c]) for c in contenders]
    try:
        for c, manager in zip(contenders, kernels):
            sessions[c] = manager.__enter__()
        for i in range(launches):
            for c in H.rotated(contenders, i):
                try:
                    H.run_launch(sessions[c], c, cfg, world, scratch)
                except Exception as exc:  # noqa: BLE001 - reported, not fatal
                    errors[c].append(f"{type(exc).__name__}: {str(exc)[-300:]}")
                rss[c].append(psutil.Process(sessions[c].pid).memory_info().rss)
    finally:
        for c, manager in zip(contenders, kernels):
            if c in sessions:
                manager.__exit__(None, None, None)
    out: dict[str, Any] = {
        "what": f"kernel RSS growth from after launch 1 to after launch {launches}",
        "launches": launches,
        "contenders": {},
    }
    mib = 1 << 20
    for c in RSS_CONTENDERS:
        if c not in rss:
            out["contenders"][c] = {"unavailable": H.unavailable_reason(c)}
            continue
        values = rss[c]
        out["contenders"][c] = {
            "rss_after_first_mib": round(values[0] / mib, 1) if values else None,
            "rss_after_last_mib": round(values[-1] / mib, 1) if values else None,
            "growth_mib": round((values[-1] - values[0]) / mib, 1) if values else None,
            "growth_per_launch_kib": (
                round((values[-1] - values[0]) / 1024 / (len(values) - 1), 1)
                if len(values) > 1
                else None
            ),
            "errors": errors[c],
        }
    return out
