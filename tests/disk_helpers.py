"""A small tmpfs to fill: how the tests get a full disk (or a full /dev/shm stand-in) without
touching the machine's real ones."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def small_tmpfs(path: Path, size: str) -> Iterator[Path]:
    """Mount a ``size`` tmpfs (``"1m"``) on ``path`` for the block, or skip the test saying why
    (mounting needs root and a container that allows it)."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("filling a disk needs a small tmpfs: `mount -t tmpfs` needs root")
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0777", "tmpfs", str(path)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        pytest.skip(f"`mount -t tmpfs` is not permitted here: {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def hidden_leftovers(folder: Path) -> list[str]:
    """Staging folders and temporary files a save left in ``folder`` (recursively)."""
    return sorted(
        str(p.relative_to(folder))
        for p in folder.rglob("*")
        if p.name.startswith(".") or p.name.endswith((".tmp", ".partial"))
    )
