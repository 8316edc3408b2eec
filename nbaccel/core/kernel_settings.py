"""The kernel's process-wide settings that a fork of the kernel would carry into its ranks.

A notebook's first cells often quiet things down for the whole session:
``warnings.filterwarnings("ignore")``, ``transformers.logging.set_verbosity_error()``,
``logging.getLogger("x").setLevel(...)``, ``datasets.disable_progress_bar()``. Under Accelerate's
launcher the ranks are forks of the kernel and keep all of it; nbaccel's ranks fork from the fork
server, which imported those packages afresh, so without this they printed what the notebook had
silenced (every rank's warnings, Transformers' info lines). :func:`capture` reads the settings in
the kernel at the launch; :func:`apply` sets them in a rank. Both sides, so both live here.

What travels: the warnings filters (in order; a filter whose category cannot be pickled, e.g. a
class defined in a cell, stays behind), every logger's explicitly set level and ``disabled``
flag, ``logging.disable``'s level, and whether the Hugging Face libraries' progress bars were
turned off. Other state of an imported module (an attribute you set on it) is the server's, as
docs/launcher.md says.

Example::

    settings = capture()      # in the kernel, as the plan is made
    apply(settings)           # in each rank, before the function runs
"""

from __future__ import annotations

import importlib
import logging
import pickle
import sys
import warnings
from collections.abc import Callable
from typing import Any

# Library progress-bar switches: module -> (its check, whether the check answers "off" (else
# "on"), the function that turns them off). Read only where the kernel has the module loaded;
# turned off in a rank only where the kernel had them off.
PROGRESS_SWITCHES: dict[str, tuple[str, bool, str]] = {
    "huggingface_hub.utils": ("are_progress_bars_disabled", True, "disable_progress_bars"),
    "datasets.utils.tqdm": ("are_progress_bars_disabled", True, "disable_progress_bars"),
    "transformers.utils.logging": ("is_progress_bar_enabled", False, "disable_progress_bar"),
    "diffusers.utils.logging": ("is_progress_bar_enabled", False, "disable_progress_bar"),
}


def capture(stays: Callable[[str], bool] = lambda module: False) -> dict[str, Any]:
    """This process's warnings filters, logger levels and progress-bar switches, picklable.

    ``stays(module)``: whether a filter whose warning category is defined in ``module`` stays
    behind. A rank unpickling the category would import its module: the kernel's side
    (IPython's completer registers one) must not be loaded in a rank.

    >>> sorted(capture())
    ['bars_off', 'loggers', 'logging_disable', 'warnings']
    >>> with warnings.catch_warnings():
    ...     warnings.simplefilter("ignore", ResourceWarning)
    ...     everything = capture()["warnings"]
    ...     without = capture(stays=lambda module: module == "builtins")["warnings"]
    >>> [ResourceWarning in [entry[2] for entry in kept] for kept in (everything, without)]
    [True, False]
    """
    filters = [f for f in warnings.filters if not stays(getattr(f[2], "__module__", ""))]
    return {
        "warnings": _picklable(filters),
        "loggers": _logger_settings(),
        "logging_disable": logging.root.manager.disable,
        "bars_off": [name for name in PROGRESS_SWITCHES if _bars_off(name)],
    }


def apply(settings: dict[str, Any]) -> None:
    """Make this process's settings the kernel's (``settings`` from :func:`capture`).

    Warnings filters this process added that the kernel lacks (a package imported here but not
    there) stay, ahead of the kernel's, as if the package had been imported after a fork.

    >>> with warnings.catch_warnings():
    ...     apply({"warnings": [("ignore", None, UserWarning, None, 0)]})
    ...     warnings.filters[-1]
    ('ignore', None, <class 'UserWarning'>, None, 0)
    """
    if "warnings" in settings:
        kernel = settings["warnings"]
        own = [f for f in warnings.filters if f not in kernel]
        if own + kernel != warnings.filters:
            _set_filters(own + kernel)
    for name, (level, disabled) in settings.get("loggers", {}).items():
        logger = logging.getLogger(name or None)
        if logger.level != level:
            logger.setLevel(level)
        logger.disabled = disabled
    disable = settings.get("logging_disable")
    if disable is not None and disable != logging.root.manager.disable:
        logging.disable(disable)
    for name in settings.get("bars_off", ()):
        _turn_bars_off(name)


def _set_filters(filters: list[tuple]) -> None:
    warnings.resetwarnings()
    for action, message, category, module, lineno in filters:
        warnings.filterwarnings(
            action,
            message=_pattern(message),
            category=category,
            module=_pattern(module),
            lineno=lineno,
            append=True,
        )


def _pattern(regex: Any) -> str:
    """A filter's message or module as ``filterwarnings`` takes it (compiled, a string, None)."""
    return "" if regex is None else getattr(regex, "pattern", regex)


def _picklable(filters: list[tuple]) -> list[tuple]:
    kept = []
    for entry in filters:
        try:
            pickle.dumps(entry)
        except Exception:  # noqa: BLE001 - a cell's own category class: it stays in the kernel
            continue
        kept.append(entry)
    return kept


def _logger_settings() -> dict[str, tuple[int, bool]]:
    """name -> (level, disabled) for the root logger and every logger whose level or disabled
    flag was set ('' is the root)."""
    out = {"": (logging.root.level, logging.root.disabled)}
    for name, logger in list(logging.root.manager.loggerDict.items()):
        if isinstance(logger, logging.Logger) and (logger.level or logger.disabled):
            out[name] = (logger.level, logger.disabled)
    return out


def _bars_off(name: str) -> bool:
    check, answers_off, _ = PROGRESS_SWITCHES[name]
    function = getattr(sys.modules.get(name), check, None)
    if function is None:
        return False
    try:
        return bool(function()) == answers_off
    except Exception:  # noqa: BLE001 - a library's own check failing is not a launch's problem
        return False


def _turn_bars_off(name: str) -> None:
    disable = PROGRESS_SWITCHES[name][2]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # e.g. datasets: "cannot disable: env var set"
            getattr(importlib.import_module(name), disable)()
    except Exception as exc:  # noqa: BLE001 - never let a setting stop the training
        print(f"nbaccel: could not turn {name}'s progress bars off: {exc}", file=sys.stderr)
