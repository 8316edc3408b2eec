"""Each rank's memory, measured from the kernel by pid: RSS (psutil) and, on CUDA, GPU memory.

Measured kernel-side so a rank pays nothing for it; the views call :func:`sample` from their
update, and it does the work at most every ``INTERVAL`` seconds. GPU memory comes from
``nvidia-smi`` (per-process use), so the kernel never initialises CUDA itself.

Example::

    sampler = MemorySampler()
    sampler.sample(state)      # fills state.ranks[r].rss / .gpu_memory
"""

from __future__ import annotations

import shutil
import subprocess
import time

from nbaccel.launch.state import LaunchState

INTERVAL = 2.0  # seconds between samples
GPU_INTERVAL = 5.0  # nvidia-smi is a process start: less often


class MemorySampler:
    def __init__(self) -> None:
        self._at = 0.0
        self._gpu_at = 0.0

    def sample(self, state: LaunchState, force: bool = False) -> None:
        """Every ``INTERVAL`` seconds (or ``force``); a rank not measured yet at once, so a
        short launch's summary shows its memory too."""
        now = time.monotonic()
        unmeasured = any(
            r.rss is None and r.pid is not None and not r.done for r in state.ranks.values()
        )
        if not force and not unmeasured and now - self._at < INTERVAL:
            return
        self._at = now
        import psutil

        for rank in state.ranks.values():
            if rank.pid is None or rank.done:
                continue
            try:
                rss = psutil.Process(rank.pid).memory_info().rss
            except (psutil.Error, OSError):
                continue
            # A rank that exited but is not reaped yet is a zombie: it reads as 0 bytes
            # (a summary once said "RSS 0 MiB"); keep the last real reading.
            if rss:
                rank.rss = rss
        if state.info.device == "cuda" and (force or now - self._gpu_at >= GPU_INTERVAL):
            self._gpu_at = now
            used = gpu_memory_by_pid()
            for rank in state.ranks.values():
                if rank.pid in used:
                    rank.gpu_memory = used[rank.pid]


def gpu_memory_by_pid(timeout: float = 2.0) -> dict[int, int]:
    """Bytes of GPU memory each process uses, from ``nvidia-smi``; {} where it is missing."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return {}
    try:
        out = subprocess.run(
            [exe, "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    used: dict[int, int] = {}
    for line in out.splitlines():
        try:
            pid, mib = (int(x.strip()) for x in line.split(","))
        except ValueError:
            continue
        used[pid] = used.get(pid, 0) + mib * (1 << 20)
    return used
