"""Find out what this machine can run (CPU cores, GPUs, TPU, MPS) without initialising CUDA.

Initialising CUDA in a notebook kernel is harmless for forkserver launches but breaks ``fork`` and
costs memory, so GPUs are listed through ``nvidia-smi`` (which talks to the driver, not to a CUDA
context) unless the kernel has already initialised CUDA itself.

>>> hw = detect()
>>> hw.cpu_count >= 1
True
"""

from __future__ import annotations

import dataclasses
import functools
import os
import shutil
import subprocess
import sys

from nbaccel.core import xla_runtime

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def loopback_interface() -> str:
    """This machine's loopback network interface (what GLOO_SOCKET_IFNAME names)."""
    return "lo0" if sys.platform == "darwin" else "lo"


def threads_per_rank(local_ranks: int) -> int:
    """CPU threads for each of ``local_ranks`` processes sharing this machine's cores."""
    return max(1, (os.cpu_count() or 1) // local_ranks)


@dataclasses.dataclass(frozen=True)
class GPU:
    index: int
    name: str
    memory_gib: float
    compute_capability: tuple[int, int]

    @property
    def supports_bf16(self) -> bool:
        return self.compute_capability >= (8, 0)

    @property
    def supports_fp8(self) -> bool:
        return self.compute_capability >= (8, 9)


@dataclasses.dataclass(frozen=True)
class Hardware:
    cpu_count: int
    gpus: tuple[GPU, ...] = ()
    has_mps: bool = False
    has_tpu: bool = False

    @property
    def gpu_count(self) -> int:
        return len(self.gpus)

    def describe(self) -> str:
        parts = [f"{self.cpu_count} CPU core{'s' if self.cpu_count != 1 else ''}"]
        for g in self.gpus:
            cc = ".".join(map(str, g.compute_capability))
            parts.append(f"GPU {g.index}: {g.name} ({g.memory_gib:.0f} GiB, compute {cc})")
        if self.has_mps:
            parts.append("Apple MPS")
        if self.has_tpu:
            parts.append("TPU")
        return "; ".join(parts)


def _visible_indices(count: int) -> list[int]:
    """Apply CUDA_VISIBLE_DEVICES (numeric form) to the driver's device list."""
    spec = os.environ.get("CUDA_VISIBLE_DEVICES")
    if spec is None:
        return list(range(count))
    chosen = []
    for item in spec.split(","):
        item = item.strip()
        if not item.lstrip("-").isdigit() or int(item) < 0:
            break  # the CUDA runtime stops at the first invalid entry
        if int(item) < count:
            chosen.append(int(item))
    return chosen


def _gpus_from_torch() -> tuple[GPU, ...]:
    import torch

    found = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        found.append(GPU(i, p.name, p.total_memory / 2**30, (p.major, p.minor)))
    return tuple(found)


def _gpus_from_nvidia_smi() -> tuple[GPU, ...]:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return ()
    try:
        out = subprocess.run(
            [exe, "--query-gpu=name,memory.total,compute_cap", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return ()
    rows = [r.split(",") for r in out.strip().splitlines() if r.strip()]
    visible = _visible_indices(len(rows))
    gpus = []
    for new_index, driver_index in enumerate(visible):
        name, mem_mib, cc = (x.strip() for x in rows[driver_index])
        major, _, minor = cc.partition(".")
        gpus.append(GPU(new_index, name, float(mem_mib) / 1024, (int(major), int(minor or 0))))
    return tuple(gpus)


def cuda_initialized() -> bool:
    """Whether this process already holds a CUDA context (only asks torch if it is imported)."""
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_initialized())


@functools.lru_cache(maxsize=1)
def _detect_cached() -> Hardware:
    gpus = _gpus_from_torch() if cuda_initialized() else _gpus_from_nvidia_smi()
    torch = sys.modules.get("torch")
    has_mps = bool(
        torch is not None
        and getattr(torch.backends, "mps", None)
        and torch.backends.mps.is_available()
    )
    has_tpu = xla_runtime.tpu_present()  # env and device files only, no runtime
    return Hardware(cpu_count=os.cpu_count() or 1, gpus=gpus, has_mps=has_mps, has_tpu=has_tpu)


def detect(refresh: bool = False) -> Hardware:
    """Describe this machine's devices; cached, since ``nvidia-smi`` takes a moment.

    Example::

        >>> nbaccel.core.hardware.detect().describe()      # doctest: +SKIP
        '8 CPU cores; GPU 0: NVIDIA H100 (80 GiB, compute 9.0)'
    """
    if refresh:
        _detect_cached.cache_clear()
    return _detect_cached()
