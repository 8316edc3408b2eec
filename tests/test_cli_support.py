"""Helpers for the command-line tests (no tests here): run the real `python -m nbaccel`."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parent.parent


def cli_env(**extra: str) -> dict[str, str]:
    """The environment for a CLI subprocess: no shared config file, no warm-up."""
    env = dict(os.environ)
    env.pop("NBACCEL_CONFIG_FILE", None)
    env.update(NBACCEL_NO_WARMUP="1", PYTHONUNBUFFERED="1", XDG_CONFIG_HOME="/nonexistent")
    env.update(extra)
    return env


def run_cli(
    *args: str, cwd: Path, timeout: float = 120, stdin: str | None = None, **env: str
) -> subprocess.CompletedProcess:
    """Run ``python -m nbaccel ARGS`` to completion and return its result (text)."""
    return subprocess.run(
        [sys.executable, "-m", "nbaccel", *args],
        cwd=cwd,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=cli_env(**env),
    )


def start_cli(*args: str, cwd: Path, **env: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "nbaccel", *args],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=cli_env(**env),
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def processes_mentioning(marker: str, wait: float = 5.0) -> list[psutil.Process]:
    """Processes (anywhere, e.g. re-parented ranks) whose command line contains ``marker``,
    after giving them ``wait`` seconds to go away."""
    deadline = time.monotonic() + wait
    while True:
        found = []
        for p in psutil.process_iter(["cmdline", "status"]):
            try:
                if p.info["status"] == psutil.STATUS_ZOMBIE:
                    continue
                if any(marker in part for part in p.info["cmdline"] or ()):
                    found.append(p)
            except psutil.Error:
                continue
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


TORCHRUN_SHIM = Path(__file__).with_name("torchrun_shim.py")


def run_torchrun(script: Path, *args: str, nprocs: int = 2) -> subprocess.CompletedProcess:
    """``script ARGS`` on ``nprocs`` ranks under plain torch.distributed.run: no nbaccel settings
    in the environment, 1 thread per rank (see torchrun_shim.py for how the workers end)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("NBACCEL_")}
    env.update(OMP_NUM_THREADS="1", NBACCEL_NO_WARMUP="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nprocs)]
    cmd += ["--master_addr", "127.0.0.1", "--master_port", str(free_port())]
    cmd += [str(TORCHRUN_SHIM), str(script), *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
