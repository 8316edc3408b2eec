"""Make a rank the kernel's twin at the moment of the launch.

A rank is forked from the fork server, not from the kernel, so without this it would see the
server's world: the server's working directory and ``sys.path`` (a module imported in the kernel
after ``os.chdir`` would be missing), the server's RNG states (the same numpy stream on every
rank and in every launch; ``torch.manual_seed`` in the kernel ignored), and the server's
multiprocessing start method (DataLoader workers started by a fork server, so a Dataset defined
in a notebook cell cannot be pickled), and the server's warnings filters, logger levels and
progress-bar switches (``core.kernel_settings``: a notebook's ``warnings.filterwarnings("ignore")``
or ``transformers.logging.set_verbosity_error()`` would not hold in its ranks). :func:`apply` gives the rank what a fork of the kernel
would have — what Accelerate's fork launcher gives — except that multiprocessing's default
start method is the platform's own, as in a fresh interpreter (``fork`` on Linux before Python
3.14, so DataLoader workers fork from the rank as under torchrun), and Python's ``random`` is
reseeded per process (as ``os.fork`` does).

Example::

    apply(spec)   # spec.sys_path, spec.cwd, spec.rng_state from the kernel
"""

from __future__ import annotations

import multiprocessing
import os
import random
import sys
from typing import Any

from nbaccel.core import kernel_settings
from nbaccel.core.events import RankSpec


def apply(spec: RankSpec) -> None:
    """Give this process the kernel's sys.path, cwd, RNG states and process-wide settings, and
    a fresh start method."""
    if spec.cwd is not None:
        try:
            os.chdir(spec.cwd)
        except OSError as exc:
            print(
                f"nbaccel: could not enter the kernel's directory {spec.cwd}: {exc}",
                file=sys.stderr,
            )
    if spec.sys_path is not None:
        sys.path[:] = spec.sys_path
    multiprocessing.set_start_method(None, force=True)  # the platform default, as if fresh
    random.seed()  # fresh per process, as after os.fork()
    set_rng_state(spec.rng_state)
    kernel_settings.apply(spec.settings)


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore the kernel's torch and numpy global RNG states where it had them.

    Where the kernel had not imported numpy, its global stream is seeded afresh (the fork server
    imported it, so every rank would otherwise share the server's stream).
    """
    if "torch" in state:
        import torch

        torch.set_rng_state(torch.frombuffer(bytearray(state["torch"]), dtype=torch.uint8))
        # CUDA generators seed lazily from the same value, as after torch.manual_seed.
        torch.cuda.manual_seed_all(state["torch_seed"])
    if "numpy" in state:
        import numpy

        numpy.random.set_state(state["numpy"])
    elif "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
