"""DeepSpeed ZeRO-3 offload to NVMe (``offload_param``/``offload_optimizer`` with
``"device": "nvme"`` and an ``nvme_path`` folder): what it needs, checked when the Accelerator
is made, before any engine starts. DeepSpeed swaps tensors to files there through its
``async_io`` op, which it compiles on first use against libaio (Debian's ``libaio-dev``, which
``scripts/test.sh`` installs where it may) with a C++ compiler and ninja. A missing piece is
named with what to do; so is a path that is not a writable folder, and ZeRO below stage 3.

>>> nvme_sections({"zero_optimization": {"offload_param": {"device": "cpu"}}})
{}
>>> check_nvme_offload({"zero_optimization": {"stage": 2,
...     "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"}}})
Traceback (most recent call last):
ValueError: NVMe offload cannot run: offload_optimizer to "nvme" needs ZeRO stage 3 (zero_stage=3), not 2.
"""

from __future__ import annotations

import ctypes.util
import os
from pathlib import Path
from typing import Any

SECTIONS = ("offload_param", "offload_optimizer")


def nvme_sections(config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The ZeRO offload sections of a DeepSpeed config that go to NVMe, by name."""
    zero = config.get("zero_optimization", {})
    return {
        name: zero[name]
        for name in SECTIONS
        if isinstance(zero.get(name), dict) and zero[name].get("device") == "nvme"
    }


def _folder_problem(name: str, path: Any) -> str | None:
    field = f"{name}_nvme_path"
    if path in (None, "", "none"):
        return (
            f'{name} to "nvme" needs a folder to swap to: DeepSpeedPlugin({field}="/local_nvme/'
            'ds") (nvme_path in the config), on the fastest local disk.'
        )
    folder = Path(path)
    if folder.exists() and not folder.is_dir():
        return f"{field}={str(path)!r} is a file; pass a folder."
    existing = folder
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        return f"{field}={str(path)!r} cannot be written ({existing} is not writable); pass a folder you can write to."
    return None


def aio_op_problem() -> str | None:
    """Why DeepSpeed's ``async_io`` op cannot run here, or ``None`` once it is built (it is
    compiled on first use and cached: minutes the first time on a small machine)."""
    if ctypes.util.find_library("aio") is None:
        return (
            "libaio is not installed: DeepSpeed's async_io op needs it (Debian/Ubuntu: "
            "`apt-get install libaio-dev`; `bash scripts/test.sh` installs it when run as root), "
            'or offload to "cpu" instead.'
        )
    try:
        from deepspeed.accelerator import get_accelerator

        builder = get_accelerator().create_op_builder("AsyncIOBuilder")
    except Exception as exc:  # noqa: BLE001 - the reason goes into the refusal
        return f"DeepSpeed's async_io op is not available with this DeepSpeed ({exc})."
    if builder is None or not builder.is_compatible(verbose=False):
        return (
            "DeepSpeed's async_io op cannot be built here: it needs libaio's headers "
            '(`apt-get install libaio-dev`) and a C++ compiler; or offload to "cpu" instead.'
        )
    try:
        builder.load(verbose=False)
    except Exception as exc:  # noqa: BLE001
        return (
            f"DeepSpeed's async_io op failed to build ({type(exc).__name__}: {exc}); it needs "
            'g++, ninja and libaio-dev. Or offload to "cpu" instead.'
        )
    return None


def check_nvme_offload(config: dict[str, Any]) -> None:
    """Refuse a DeepSpeed config whose NVMe offload cannot run here, naming every missing piece
    (ZeRO stage, folder, libaio, DeepSpeed's op); nothing otherwise. The folders are made."""
    sections = nvme_sections(config)
    if not sections:
        return
    stage = config.get("zero_optimization", {}).get("stage", 0)
    problems = [
        f'{name} to "nvme" needs ZeRO stage 3 (zero_stage=3), not {stage}.'
        for name in sections
        if stage != 3
    ]
    problems += [
        p for name, s in sections.items() if (p := _folder_problem(name, s.get("nvme_path")))
    ]
    if not problems:
        problem = aio_op_problem()
        problems += [problem] if problem else []
    if problems:
        raise ValueError("NVMe offload cannot run: " + " ".join(problems))
    for section in sections.values():
        Path(section["nvme_path"]).mkdir(parents=True, exist_ok=True)
