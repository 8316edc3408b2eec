"""Run one function on nbaccel's ranks as itself and as Accelerate (the same seed, the same
launcher), so a test compares the two libraries' numbers from one run each.

The function takes the library's name first (``"nbaccel"`` or ``"accelerate"``) and imports its
``Accelerator`` from it; Accelerate's ranks are told they run on CPU as its own launcher would.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import nbaccel


def run_as(lib: str, function: Callable[..., Any], processes: int, **kwargs: Any) -> list[Any]:
    """Every rank's return value of ``function(lib, **kwargs)`` on ``processes`` CPU ranks."""
    env = {"ACCELERATE_USE_CPU": "true"} if lib == "accelerate" else {}
    return nbaccel.notebook_launcher(
        function,
        args=(lib,),
        kwargs=kwargs,
        num_processes=processes,
        progress=False,
        return_all=True,
        env=env,
    )
