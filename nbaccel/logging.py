"""Accelerate's ``accelerate.logging`` path: ``from nbaccel.logging import get_logger``.

The logger emits from the main process only unless told otherwise (``main_process_only=False``,
``in_order=True``); see :mod:`nbaccel.training.multiprocess_logging`.

>>> from nbaccel.logging import get_logger
>>> get_logger("train").logger.name
'train'
"""

from nbaccel.training.multiprocess_logging import MultiProcessAdapter, get_logger

__all__ = ["MultiProcessAdapter", "get_logger"]
