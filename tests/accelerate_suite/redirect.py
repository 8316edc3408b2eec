"""Load one of Accelerate's own test scripts from the installed (pinned, test-only) accelerate
wheel, with its ``accelerate`` imports answered by nbaccel.

The script's source is read from ``accelerate/test_utils/scripts/`` at run time and executed as
a fresh module whose ``__import__`` maps Accelerate's module paths onto nbaccel's public ones
(:data:`ALIASES`). ``accelerate.test_utils`` (fixtures such as ``RegressionModel``,
``RegressionDataset``) stays Accelerate's, as the issue allows, except the fixtures that read
Accelerate's own process state (:data:`STAND_INS`). Nothing outside that module is changed: the
rest of the process imports the real packages.

>>> module = load_script("test_ops.py", "nbaccel")
>>> module.gather.__module__
'nbaccel.training.ops'
"""

from __future__ import annotations

import builtins
import importlib
import pathlib
import types
from typing import Any

# Accelerate's module path -> the nbaccel modules that answer it, searched in order.
ALIASES: dict[str, tuple[str, ...]] = {
    "accelerate": ("nbaccel",),
    "accelerate.accelerator": ("nbaccel", "nbaccel.utils"),
    "accelerate.state": ("nbaccel.state",),
    "accelerate.data_loader": ("nbaccel.data_loader",),
    "accelerate.logging": ("nbaccel.logging",),
    "accelerate.tracking": ("nbaccel.tracking",),
    "accelerate.utils": ("nbaccel.utils",),
    "accelerate.utils.operations": ("nbaccel.utils",),
    "accelerate.utils.dataclasses": ("nbaccel.utils",),
    "accelerate.utils.random": ("nbaccel.utils",),
}
KEPT = "accelerate.test_utils"  # Accelerate's fixtures, imported as they are


def scripts_dir() -> pathlib.Path:
    """Where the installed accelerate keeps its multi-process test scripts."""
    import accelerate.test_utils.scripts as scripts

    return pathlib.Path(scripts.__file__).parent


class _Alias(types.ModuleType):
    """An ``accelerate...`` module whose names are nbaccel's."""

    def __init__(self, name: str, targets: tuple[str, ...]) -> None:
        super().__init__(name)
        self._targets = targets

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        for target in self._targets:
            module = importlib.import_module(target)
            if hasattr(module, attr):
                return getattr(module, attr)
        raise AttributeError(
            f"nbaccel has no counterpart of {self.__name__}.{attr} (looked in "
            f"{', '.join(self._targets)})"
        )


def _redirecting_import(aliases: dict[str, _Alias]):
    real = builtins.__import__

    def importer(name, globals=None, locals=None, fromlist=(), level=0):  # noqa: A002
        if level or not (name == "accelerate" or name.startswith("accelerate.")):
            return real(name, globals, locals, fromlist, level)
        if name == KEPT or name.startswith(KEPT + "."):
            return real(name, globals, locals, fromlist, level)
        if name not in ALIASES:
            raise ImportError(f"{name}: Accelerate's module has no nbaccel counterpart")
        alias = aliases.setdefault(name, _Alias(name, ALIASES[name]))
        if fromlist:
            return alias
        return aliases.setdefault("accelerate", _Alias("accelerate", ALIASES["accelerate"]))

    return importer


def same_on_every_rank(tensor: Any) -> bool:
    """nbaccel's stand-in for ``accelerate.test_utils.are_the_same_tensors``, which reads
    Accelerate's own process state (unset when nbaccel runs): every rank holds ``tensor``."""
    import torch

    from nbaccel.utils import gather

    every = gather(tensor.detach()[None].clone()).cpu()
    return all(torch.equal(row, tensor.detach().cpu()) for row in every)


# Fixtures of accelerate.test_utils that read Accelerate's state, replaced for nbaccel.
STAND_INS = {"are_the_same_tensors": same_on_every_rank}


def load_script(relative: str, lib: str) -> types.ModuleType:
    """Execute ``accelerate/test_utils/scripts/<relative>`` as a new module (not registered in
    ``sys.modules``, so cloudpickle sends its functions by value); with ``lib="nbaccel"`` its
    ``accelerate`` imports resolve to nbaccel, with ``"accelerate"`` it is the script as is."""
    path = scripts_dir() / relative
    name = "accelerate_suite_" + relative.replace("/", "_").removesuffix(".py")
    module = types.ModuleType(name)
    module.__file__ = str(path)
    if lib == "nbaccel":
        module.__builtins__ = {**vars(builtins), "__import__": _redirecting_import({})}
    elif lib != "accelerate":
        raise ValueError(f"lib must be 'nbaccel' or 'accelerate', got {lib!r}")
    exec(compile(path.read_text(), str(path), "exec"), module.__dict__)  # noqa: S102
    if lib == "nbaccel":
        for name, stand_in in STAND_INS.items():
            if name in module.__dict__:
                module.__dict__[name] = stand_in
    return module
