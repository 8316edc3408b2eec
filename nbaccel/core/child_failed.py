"""A failed launch is also torch elastic's ``ChildFailedError`` where code can catch that.

Accelerate's ``notebook_launcher`` runs ranks through torch elastic, so a failing rank reaches
the notebook as ``torch.distributed.elastic.multiprocessing.errors.ChildFailedError``, and code
written for it says ``except ChildFailedError``. Code that names that class has imported its
module; then :func:`rank_failed_class` gives a ``RankFailedError`` that is also a
``ChildFailedError`` (same name, same message: the rank's own exception and traceback first, not
torch's table), with ``name`` and ``failures`` filled in as torch elastic fills them. Without
that module loaded nothing here imports torch (the kernel does not load it for a launch).

>>> from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
>>> from nbaccel.core.errors import RankFailedError
>>> error = RankFailedError(1, 2, "raised ValueError: bad batch")
>>> isinstance(error, ChildFailedError), type(error).__name__, str(error)
(True, 'RankFailedError', 'rank 1 (of 2) raised ValueError: bad batch')
"""

from __future__ import annotations

import sys
from typing import Any

ELASTIC_ERRORS = "torch.distributed.elastic.multiprocessing.errors"
_classes: dict[type, type] = {}


def rank_failed_class(base: type) -> type:
    """``base`` (``RankFailedError``), or its ``ChildFailedError`` twin when torch elastic's
    errors module is loaded in this process."""
    module = sys.modules.get(ELASTIC_ERRORS)
    child_failed = getattr(module, "ChildFailedError", None)
    if child_failed is None:
        return base
    if base not in _classes:
        # ChildFailedError.__init__ (torch's table as the message) is not called: base's
        # __init__ sets the message, then fill_failures what torch's own __init__ would store.
        twin = type(base.__name__, (base, child_failed), {"__module__": base.__module__})
        twin.__qualname__ = base.__qualname__
        _classes[base] = twin
    return _classes[base]


def fill_failures(error: Any) -> None:
    """Give ``error`` (a ``RankFailedError``) the ``name`` and ``failures`` of a
    ``ChildFailedError``, when it is one: its first failed rank, with the rank's summary as the
    failure's message."""
    module = sys.modules.get(ELASTIC_ERRORS)
    child_failed = getattr(module, "ChildFailedError", None)
    if child_failed is None or not isinstance(error, child_failed):
        return
    exitcode = error.exitcode if error.exitcode is not None else 1
    failure = module.ProcessFailure(  # type: ignore[union-attr]
        local_rank=error.rank, pid=-1, exitcode=exitcode, error_file="<N/A>"
    )
    failure.message = error.summary
    error.name = "notebook_launcher"
    error.failures = {error.rank: failure}
