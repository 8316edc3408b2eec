"""The one table of what this hardware can run: mixed precision x GPUs (x strategy).

The launcher's pre-check, the config panel's disabled choices and ``Accelerator`` inside a rank
all ask :func:`precision_verdict`, so the rule and its wording live here only.

>>> cpu = ()
>>> precision_verdict("bf16", cpu, torchao=False).allowed
True
>>> print(precision_verdict("fp8", cpu, torchao=True).reason)
fp8 needs a CUDA GPU of compute capability 8.9+ (Ada, Hopper) and torchao, and none is visible; use 'bf16' on CPU.
>>> t4 = (GPU(0, "Tesla T4", 15.0, (7, 5)),)
>>> print(precision_verdict("bf16", t4, torchao=False).reason)
bf16 needs compute capability 8.0+ (GPU 0 Tesla T4 has 7.5); use 'fp16' instead.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Sequence

from nbaccel.core import strategy_registry
from nbaccel.core.config import MIXED_PRECISION_CHOICES, ConfigError, check_choice
from nbaccel.core.hardware import GPU

BF16_MIN_CC = (8, 0)
FP8_MIN_CC = (8, 9)

# How to get DeepSpeed (nbaccel installs from a clone: its extra is `-e '.[deepspeed]'` there).
DEEPSPEED_INSTALL = strategy_registry.DEEPSPEED_INSTALL
_PACKAGE_NAMES = {"deepspeed": "DeepSpeed"}  # how the messages spell a package


@dataclasses.dataclass(frozen=True)
class Verdict:
    """Whether a setting can run here; ``reason`` says why not and what to choose instead."""

    allowed: bool
    reason: str = ""


def package_available(name: str) -> bool:
    """Whether package ``name`` can be imported, found without importing it (imports of torchao
    or deepspeed are slow and may initialise CUDA).

    >>> package_available("json"), package_available("no_such_package_here")
    (True, False)
    """
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def torchao_available() -> bool:
    """Whether torchao can be imported (fp8 uses its float8 training)."""
    return package_available("torchao")


def _below(gpus: Sequence[GPU], cc: tuple[int, int]) -> str:
    return ", ".join(
        f"GPU {g.index} {g.name} has {g.compute_capability[0]}.{g.compute_capability[1]}"
        for g in gpus
        if g.compute_capability < cc
    )


def precision_verdict(precision: str, gpus: Sequence[GPU], torchao: bool) -> Verdict:
    """Can ``mixed_precision=precision`` run on ``gpus`` (empty: CPU only)?"""
    check_choice("mixed_precision", precision, MIXED_PRECISION_CHOICES)
    if precision in ("no", "fp16"):
        return Verdict(True)
    if precision == "bf16":
        if any(g.compute_capability < BF16_MIN_CC for g in gpus):
            return Verdict(
                False,
                f"bf16 needs compute capability 8.0+ ({_below(gpus, BF16_MIN_CC)}); "
                "use 'fp16' instead.",
            )
        return Verdict(True)
    if not gpus:
        return Verdict(
            False,
            "fp8 needs a CUDA GPU of compute capability 8.9+ (Ada, Hopper) and torchao, and "
            "none is visible; use 'bf16' on CPU.",
        )
    if any(g.compute_capability < FP8_MIN_CC for g in gpus):
        return Verdict(
            False,
            f"fp8 needs compute capability 8.9+ ({_below(gpus, FP8_MIN_CC)}); "
            "use 'bf16' (or 'fp16' before compute capability 8.0).",
        )
    if not torchao:
        return Verdict(
            False,
            "fp8 uses torchao's float8 training, which is not installed; run "
            "`pip install torchao`, or choose 'bf16'.",
        )
    return Verdict(True)


def check_precision(precision: str, gpus: Sequence[GPU], torchao: bool | None = None) -> None:
    """Raise a :class:`ConfigError` with the reason when ``precision`` cannot run on ``gpus``."""
    verdict = precision_verdict(
        precision, gpus, torchao_available() if torchao is None else torchao
    )
    if not verdict.allowed:
        raise ConfigError(f"mixed_precision={precision!r}: {verdict.reason}")


def deepspeed_available() -> bool:
    """Whether deepspeed can be imported (``strategy="deepspeed"`` needs it)."""
    return package_available("deepspeed")


def strategy_verdict(strategy: str, precision: str, deepspeed: bool) -> Verdict:
    """Can ``strategy`` run with ``precision`` here (``deepspeed``: is the package installed)?

    Example::

        strategy_verdict("deepspeed", "bf16", deepspeed=deepspeed_available()).allowed
    """
    check_choice("strategy", strategy, strategy_registry.names())
    entry = strategy_registry.get(strategy)
    if entry.needs_package is not None and not (
        deepspeed if entry.needs_package == "deepspeed" else package_available(entry.needs_package)
    ):
        return Verdict(
            False,
            f"{_PACKAGE_NAMES.get(entry.needs_package, entry.needs_package)} is not installed in "
            f"this Python; {entry.install or f'run `pip install {entry.needs_package}`'}, "
            "or choose 'fsdp' for sharded training.",
        )
    if entry.precisions is not None and precision not in entry.precisions:
        runs = " or ".join(repr(p) for p in entry.precisions if p != "no")
        name = _PACKAGE_NAMES.get(entry.needs_package or "", strategy)
        return Verdict(False, f"{name} runs {runs} mixed precision, not {precision!r}.")
    return Verdict(True)


def check_strategy(strategy: str, precision: str, deepspeed: bool | None = None) -> None:
    """Raise a :class:`ConfigError` with the reason when ``strategy`` cannot run here."""
    installed = deepspeed_available() if deepspeed is None else deepspeed
    verdict = strategy_verdict(strategy, precision, installed)
    if not verdict.allowed:
        raise ConfigError(f"strategy={strategy!r}: {verdict.reason}")


def unrunnable_here(precision: str, strategy: str, gpus: Sequence[GPU]) -> list[str]:
    """Why a config with these settings cannot launch on this machine (empty: it can), for
    ``nbaccel config`` and ``nbaccel env``, which keep such a file (it may be meant for another
    machine) but say so.

    >>> unrunnable_here("no", "ddp", ())
    []
    >>> unrunnable_here("fp8", "ddp", ())[0].startswith("mixed_precision='fp8': fp8 needs a CUDA GPU")
    True
    """
    problems = []
    for check in (
        lambda: check_precision(precision, gpus),
        lambda: check_strategy(strategy, precision),
    ):
        try:
            check()
        except ConfigError as exc:
            problems.append(str(exc))
    return problems
