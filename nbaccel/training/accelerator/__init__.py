"""The ``Accelerator``: Hugging Face Accelerate's API, one concept in one place.

``accelerator`` holds the class: its constructor and ``prepare``. What it does is split by what a
user does with it, one module each, mixed into the class: ``processes`` (who am I, waiting,
printing, ``split_between_processes``; ``ProcessFacts``), ``step`` (``backward``, ``autocast``,
``accumulate``, clipping, ``no_sync``), ``saving`` (``save_state``/``load_state``,
``save_model``, hooks), ``pickling`` (a pickle is a reference valid in its own process) and
``options`` (the constructor's Accelerate-compatible arguments). ``parts`` declares, typed, the
attributes and methods the mixins share, so each can be read and type-checked alone.

``Accelerator`` is loaded on first use: the parts import ``training`` modules that import this
package back.
"""

from __future__ import annotations

import importlib
from typing import Any


def __getattr__(name: str) -> Any:
    if name.startswith("__") or name in ("accelerator", "processes", "step", "saving"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = importlib.import_module(f"{__name__}.accelerator")
    try:
        return getattr(module, name)
    except AttributeError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
