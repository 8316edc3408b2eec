"""``nbaccel env``: a plain-text report of versions, devices and the config, for bug reports.

Every line is gathered defensively: a missing package or a broken config file is reported in
its line rather than stopping the report, since the report is most needed when things are broken.

>>> print(report())                 # doctest: +SKIP
nbaccel environment (paste this into the bug report)
- nbaccel: 0.1.0
...
"""

from __future__ import annotations

import os
import platform
import sys
from importlib import metadata
from pathlib import Path

PACKAGES = ("torch", "ipykernel", "ipywidgets", "cloudpickle", "nbformat", "numpy")


def _version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


def _devices() -> list[str]:
    from nbaccel.core import hardware

    lines = [f"- hardware: {hardware.detect().describe()}"]
    try:
        import torch

        lines.append(f"- torch CUDA build: {torch.version.cuda or 'none (CPU build)'}")
        lines.append(
            "- torch.distributed: "
            + ("available" if torch.distributed.is_available() else "not available")
            + f"; gloo {'yes' if torch.distributed.is_gloo_available() else 'no'}"
            + f", nccl {'yes' if torch.distributed.is_nccl_available() else 'no'}"
        )
    except Exception as exc:  # noqa: BLE001 - report the problem, keep reporting the rest
        lines.append(f"- torch: cannot be imported ({type(exc).__name__}: {exc})")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        lines.append(f"- CUDA_VISIBLE_DEVICES: {visible!r}")
    return lines


def _config(config_file: str | None) -> list[str]:
    from nbaccel.core.config import ConfigError, LaunchConfig, default_config_path

    path = Path(config_file) if config_file else default_config_path()
    if not path.exists():
        return [f"- config file: {path} (not present; defaults apply)"]
    lines = [f"- config file: {path}"]
    try:
        cfg = LaunchConfig.load(path)
    except ConfigError as exc:
        lines.append(f"  (invalid: {exc})")
    else:
        from nbaccel.core import capabilities, hardware

        gpus = hardware.detect().gpus
        for problem in capabilities.unrunnable_here(cfg.mixed_precision, cfg.strategy, gpus):
            lines.append(f"  (this machine cannot launch it: {problem})")
    text = path.read_text(encoding="utf-8", errors="replace")
    lines += ["  " + line for line in text.splitlines() if line.strip()]
    return lines


def report(config_file: str | None = None) -> str:
    """The report text: versions, platform, devices, launcher-related variables, the config.

    Example::

        >>> "nbaccel:" in report()
        True
    """
    from nbaccel import __version__

    lines = [
        "nbaccel environment (paste this into the bug report)",
        f"- nbaccel: {__version__}",
        f"- Python: {platform.python_version()} ({sys.executable})",
        f"- platform: {platform.platform()}",
    ]
    lines += [f"- {name}: {_version(name)}" for name in PACKAGES]
    lines += _devices()
    launcher_vars = sorted(
        k
        for k in os.environ
        if k.startswith(("NBACCEL_", "TORCHELASTIC_")) or k in ("OMP_NUM_THREADS", "MASTER_ADDR")
    )
    for key in launcher_vars:
        lines.append(f"- ${key}={os.environ[key]}")
    lines += _config(config_file)
    return "\n".join(lines)
