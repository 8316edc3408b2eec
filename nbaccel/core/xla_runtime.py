"""Whether work runs on torch_xla's PJRT runtime (TPU, or XLA's CPU devices), and how its ranks
must be started, decided from the environment alone: no device is touched and torch_xla is not
imported, so the kernel stays free of any runtime (PJRT allows one client per process).

PJRT starts ranks in one of two ways (torch_xla 2.9):

- threads: one process drives several devices, one thread each. XLA's CPU devices
  (``CPU_NUM_DEVICES``) only exist this way, and TPU v2/v3 hosts (Colab/Kaggle v2-8, v3-8) run
  one process with a thread per core;
- processes: one process per chip (TPU v4 and later), like one process per GPU.

>>> requested({"PJRT_DEVICE": "cpu"})
'CPU'
>>> requested({})
>>> uses_threads("CPU", 2, {}), uses_threads("CPU", 1, {}), uses_threads("TPU", 4, {})
(True, False, False)
>>> uses_threads("TPU", 8, {"TPU_ACCELERATOR_TYPE": "v3-8"})
True
"""

from __future__ import annotations

import glob
import importlib.util
import os
from collections.abc import Mapping

ENV_PJRT_DEVICE = "PJRT_DEVICE"
# Set by the launcher in a rank that hosts several XLA devices as threads (rank.xla).
ENV_XLA_THREADS = "NBACCEL_XLA_THREADS"


def tpu_present(env: Mapping[str, str] | None = None) -> bool:
    """Whether this looks like a TPU host (Cloud TPU VM, Colab, Kaggle); touches no device."""
    env = os.environ if env is None else env
    return bool(
        env.get("TPU_NAME")
        or env.get("COLAB_TPU_ADDR")
        or env.get("TPU_ACCELERATOR_TYPE")
        or os.path.exists("/dev/accel0")  # TPU v2-v4 chips
        or (glob.glob("/dev/vfio/[0-9]*") and env.get("TPU_WORKER_ID") is not None)  # v5e+
    )


def requested(env: Mapping[str, str] | None = None) -> str | None:
    """The PJRT device type work runs on (``"TPU"``, ``"CPU"``...), or ``None`` for plain torch.

    ``PJRT_DEVICE`` decides where it is set (``PJRT_DEVICE=CPU`` runs XLA on CPU devices);
    otherwise a TPU host with torch_xla installed means ``"TPU"``.
    """
    env = os.environ if env is None else env
    value = (env.get(ENV_PJRT_DEVICE) or "").strip().upper()
    if value:
        return value
    if tpu_present(env) and importlib.util.find_spec("torch_xla") is not None:
        return "TPU"
    return None


def accelerator_type(env: Mapping[str, str] | None = None) -> str:
    """The TPU generation and size, e.g. ``"v3-8"``, where the host says so ('' if unknown)."""
    env = os.environ if env is None else env
    return (env.get("TPU_ACCELERATOR_TYPE") or env.get("ACCELERATOR_TYPE") or "").lower()


def uses_threads(device: str, num_processes: int, env: Mapping[str, str] | None = None) -> bool:
    """Whether ``num_processes`` ranks on ``device`` must be threads of one process.

    XLA's CPU devices exist only as threads of one process (separate processes each get a
    runtime of their own with world size 1 and no collectives between them); TPU v2/v3 run a
    thread per core (``TPU_ACCELERATOR_TYPE`` says which generation; where it is not set, more
    ranks than ``/dev/accel*`` chips means cores). One rank never needs threads.
    """
    if num_processes <= 1:
        return False
    if device == "CPU":
        return True
    if device != "TPU":
        return False
    kind = accelerator_type(env)
    if kind:
        return kind.startswith(("v2", "v3"))
    # Unknown generation: v2/v3 chips have two cores, each a device, so more ranks than chips
    # means cores as threads (a v3-8 has 4 chips, 8 devices; a v4-8 has 4 chips, 4 devices).
    chips = len(glob.glob("/dev/accel[0-9]*"))
    return 0 < chips < num_processes
