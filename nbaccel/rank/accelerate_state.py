"""What Accelerate's own ``Accelerator`` runs in this rank (the one transformers' ``Trainer``
makes), reported as the rank's settings, so the launch's summary says what the ranks ran, not
what the launch asked for.

nbaccel's ``Accelerator`` reports its settings itself; Accelerate's cannot, so the rank reads
them from Accelerate's shared state when a progress bar starts (the Trainer's, after it made its
Accelerator) and when the function ends. Accelerate is never imported here: a rank that did not
import it has nothing to report.

Example (outside a launch it reports nothing)::

    report()          # after accelerate.Accelerator(mixed_precision="bf16") in this rank
"""

from __future__ import annotations

import sys
from typing import Any

# Accelerate's DistributedType values that are one of nbaccel's strategies; every other one
# (MULTI_CPU, MULTI_GPU, NO, ...) runs as DDP, or as one process, which the launch calls "ddp".
STRATEGIES = {"FSDP": "fsdp", "DEEPSPEED": "deepspeed", "XLA": "xla"}


def settings() -> tuple[str, str, str, int] | None:
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
            STRATEGIES.get(str(kind), "ddp"),
            str(shared.get("device")),
            int(accumulation.get("num_steps", 1)),
        )
    except Exception:  # noqa: BLE001 - another Accelerate version: report nothing, never fail
        return None


def report() -> None:
    """Send this rank's Accelerate settings to the kernel, once per change; nothing where
    Accelerate made no Accelerator here or nbaccel's own ``Accelerator`` reported."""
    found = settings()
    if found is not None:
        from nbaccel.rank import reporting

        reporting.report_settings(*found, source="accelerate")
