"""A strategy variant: one module, one line (tests/test_extension_points.py): DDP whose
gradients travel in 1 MiB buckets, by the options its constructor takes."""

from __future__ import annotations

from nbaccel.core.strategy_registry import get, register

ENTRY = register(get("ddp").variant("ddp_small_buckets", bucket_cap_mb=1))
