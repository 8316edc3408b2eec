"""Make tqdm bars inside a rank report as that rank's progress, without code changes; count the
optimizer's steps where the loop reports nothing; tell the kernel when ``torch.compile`` compiles.

Each module is hooked only when the rank imports it (an import hook; at once if it is imported
already), so ranks that never use it pay nothing; ``tqdm.notebook``/``tqdm.autonotebook`` are
served as the plain bar, so a rank never imports IPython or draws widgets. ``NBACCEL_TQDM=0``
turns the tqdm part off.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import math
import os
import sys
from collections.abc import Callable
from typing import Any

from nbaccel.rank import reporting
from nbaccel.rank.reporting import ProgressBar


class _NullFile:
    """Where a hooked tqdm bar draws: its progress goes to the dashboard instead."""

    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        pass


def _patch_tqdm_class(cls: Any) -> None:
    """Make every ``tqdm.std.tqdm`` (and so every subclass) report as a :class:`ProgressBar`."""
    if cls.__dict__.get("_nbaccel_patched"):
        return
    original_init, original_update, original_close = cls.__init__, cls.update, cls.close

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        if len(args) > 4:
            args = (*args[:4], _NullFile(), *args[5:])  # ``file`` is tqdm's 5th parameter
        else:
            kwargs["file"] = _NullFile()
        original_init(self, *args, **kwargs)
        if not getattr(self, "disable", False):
            desc = (getattr(self, "desc", "") or "").removesuffix(": ") or None
            self._nbaccel_bar = ProgressBar(total=self.total, desc=desc)

    def update(self: Any, n: float = 1) -> Any:
        result = original_update(self, n)
        bar = self.__dict__.get("_nbaccel_bar")
        if bar is not None and bar.due():
            _sync(self, bar)
            bar.report()
        return result

    def close(self: Any) -> Any:
        bar = self.__dict__.pop("_nbaccel_bar", None)
        if bar is not None:
            _sync(self, bar)
            bar.close()
        return original_close(self)

    cls.__init__, cls.update, cls.close = __init__, update, close
    cls._nbaccel_patched = True


def _sync(tq: Any, bar: ProgressBar) -> None:
    bar.n = int(tq.n)
    bar.total = int(tq.total) if tq.total is not None and math.isfinite(tq.total) else None
    bar.desc = (tq.desc or "").removesuffix(": ") or None


def _patch_tqdm_module(module: Any) -> None:
    _patch_tqdm_class(module.tqdm)


class _TqdmHook(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Run each of ``after_import`` (module name -> what to do with it) when the rank first
    imports that module; with ``tqdm``, serve ``tqdm.notebook`` and ``tqdm.autonotebook`` as the
    plain bar, so a rank never imports IPython or draws widgets."""

    _SUBSTITUTES = ("tqdm.notebook", "tqdm.autonotebook")

    def __init__(self, after_import: dict[str, Callable[[Any], None]], tqdm: bool) -> None:
        self._after_import, self._tqdm = after_import, tqdm

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if self._tqdm and name in self._SUBSTITUTES:
            return importlib.util.spec_from_loader(name, self)
        then = self._after_import.get(name)
        if then is not None:
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            if spec is not None and spec.loader is not None:
                spec.loader = _PatchingLoader(spec.loader, then)
            return spec
        return None

    def create_module(self, spec: Any) -> None:
        return None

    def exec_module(self, module: Any) -> None:
        from tqdm.std import tqdm, trange

        module.tqdm = module.tqdm_notebook = tqdm
        module.trange = module.tnrange = trange
        module.__all__ = ["tqdm", "trange"]


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader: Any, then: Callable[[Any], None]) -> None:
        self._loader, self._then = loader, then

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._loader.exec_module(module)
        self._then(module)


def install_worker_hooks() -> None:
    """Make tqdm bars in this rank report as its progress (unless ``NBACCEL_TQDM=0``), count
    its optimizer's steps while its loop reports nothing, and report ``torch.compile``'s
    compiling (``nbaccel.rank.reporting``).

    Called by the rank's entry point right after the event channel is installed. Each module is
    only hooked when the rank imports it (or now, if it was preloaded), so ranks that never use
    it pay nothing.
    """
    if any(isinstance(f, _TqdmHook) for f in sys.meta_path):
        return
    tqdm = os.environ.get("NBACCEL_TQDM", "1").strip().lower() not in ("0", "false", "no", "off")
    after_import: dict[str, Callable[[Any], None]] = {
        "torch.optim.optimizer": reporting.count_optimizer_steps,
        "torch._dynamo.callback": reporting.report_compiles,
    }
    if tqdm:
        after_import["tqdm.std"] = _patch_tqdm_module
    for name, then in after_import.items():
        if name in sys.modules:
            then(sys.modules[name])
    if tqdm:
        _serve_plain_tqdm()
    sys.meta_path.insert(0, _TqdmHook(after_import, tqdm))


def _serve_plain_tqdm() -> None:
    """Preloaded (fork start method) notebook bars: point them at the plain bar too."""
    for name in _TqdmHook._SUBSTITUTES:
        module: Any = sys.modules.get(name)
        if module is not None and getattr(module, "tqdm", None) is not None:
            # Preloaded (fork start method): point it at the plain bar too.
            from tqdm.std import tqdm, trange

            module.tqdm, module.trange = tqdm, trange
    if "tqdm.std" in sys.modules:
        auto: Any = sys.modules.get("tqdm.auto")
        if auto is not None and any(c.__module__ == "tqdm.notebook" for c in auto.tqdm.__mro__):
            auto.tqdm = sys.modules["tqdm.std"].tqdm
