"""nbaccel: launch distributed PyTorch training from a notebook cell.

>>> import nbaccel
>>> def train():
...     return nbaccel.Accelerator().process_index
>>> nbaccel.notebook_launcher(train, num_processes=2)   # doctest: +SKIP
0

Heavy pieces (torch, the Accelerator) load on first use, so ``import nbaccel`` stays quick.
In a notebook kernel the fork server starts warming up (importing torch) in the background at
import, so the first launch is fast too; ``NBACCEL_NO_WARMUP=1`` turns that off.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

from nbaccel.config import ConfigError, LaunchConfig
from nbaccel.errors import LaunchError, LaunchTimeoutError, RankFailedError
from nbaccel.launcher import notebook_launcher

__version__ = "0.1.0"

# Public names that are imported when first used: name -> module.
_LAZY = {
    "Accelerator": "nbaccel.accelerator",
    "set_seed": "nbaccel.random",
    "progress": "nbaccel.reporting",
    "log": "nbaccel.reporting",
    "configure": "nbaccel.ui.config_panel",
    "hardware": "nbaccel.hardware",
}

__all__ = [
    "ConfigError",
    "LaunchConfig",
    "LaunchError",
    "LaunchTimeoutError",
    "RankFailedError",
    "notebook_launcher",
    "__version__",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module 'nbaccel' has no attribute {name!r}")
    module = importlib.import_module(module_name)
    value = module if module_name.rsplit(".", 1)[-1] == name else getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


def _warm_up_in_kernel() -> None:
    """Start the fork server now if this is an interactive kernel (not a rank, not a script)."""
    from nbaccel.config import ENV_LAUNCHER

    if os.environ.get("NBACCEL_NO_WARMUP") or os.environ.get(ENV_LAUNCHER):
        return
    if "ipykernel" not in sys.modules:
        return
    try:
        from nbaccel.processes import ensure_server

        ensure_server()
    except Exception:  # noqa: BLE001 - warming up is an optimisation; the launch will retry
        pass


_warm_up_in_kernel()
