"""What this rank's Accelerator runs, told to the kernel, so the launch's summary says what the
ranks ran (``mixed_precision=bf16 (set in code)``), not what the launch asked for.

nbaccel's ``Accelerator`` calls :func:`report_settings` itself. Accelerate's own (the one
transformers' ``Trainer`` makes) cannot, so :func:`report_accelerate` reads its settings from
Accelerate's shared state when a progress bar starts (the Trainer's, after it made its
Accelerator) and when the function ends. Accelerate is never imported here: in a rank that did
not import it there is nothing to read.

>>> found = accelerate_settings()  # None where Accelerate made no Accelerator in this process
>>> found is None or len(found) == 4  # precision, strategy, device, accumulation steps
True
"""

from __future__ import annotations

import sys
from typing import Any

from nbaccel.core import events, strategy_registry

# What was last sent: "nbaccel" once nbaccel's Accelerator reported, else the RankSettings read
# from Accelerate's, or None.
_sent: Any = None


def report_settings(
    mixed_precision: str,
    strategy: str,
    device: str,
    accumulation: int,
    source: str = "nbaccel",
    parallelism: str = "",
    coordinates: str = "",
) -> None:
    """Tell the kernel what this rank's Accelerator runs (a no-op outside a launch).
    ``source="accelerate"``: read from Accelerate's; sent only when it changed, and never over
    what nbaccel's own Accelerator reported in this rank."""
    global _sent
    rank = events.current_rank()
    if rank is None:
        return
    settings = events.RankSettings(
        rank, mixed_precision, strategy, device, accumulation, parallelism, coordinates
    )
    if source != "nbaccel" and _sent in ("nbaccel", settings):
        return
    _sent = "nbaccel" if source == "nbaccel" else settings
    events.emit(settings)


def accelerate_settings() -> tuple[str, str, str, int] | None:
    """(mixed_precision, strategy, device, gradient accumulation steps) of the Accelerator
    Accelerate made in this process, or None where it made none."""
    module = sys.modules.get("accelerate.state")
    if module is None:
        return None
    try:
        shared: dict[str, Any] = module.AcceleratorState._shared_state
        if "_mixed_precision" not in shared:  # no Accelerator (a PartialState holds no precision)
            return None
        kind = getattr(shared.get("distributed_type"), "value", "")
        accumulation = module.GradientState._shared_state.get("plugin_kwargs", {})
        return (
            str(shared["_mixed_precision"]),
            # Accelerate's DistributedType value of a registered strategy; every other one
            # (MULTI_CPU, MULTI_GPU, NO, ...) runs as DDP or one process: the default strategy
            strategy_registry.by_accelerate_type(str(kind)) or strategy_registry.DEFAULT,
            str(shared.get("device")),
            int(accumulation.get("num_steps", 1)),
        )
    except Exception:  # noqa: BLE001 - another Accelerate version: report nothing, never fail
        return None


def report_accelerate() -> None:
    """Report what Accelerate's own Accelerator runs in this rank, where it made one."""
    found = accelerate_settings()
    if found is not None:
        report_settings(*found, source="accelerate")
