"""Accelerate's ``accelerate.scheduler`` path: ``AcceleratedScheduler``, the class of what
``accelerator.prepare`` returns for a learning-rate scheduler (nbaccel's
:class:`~nbaccel.training.strategies.prepared.PreparedScheduler`), for ported ``isinstance``
checks.

>>> from nbaccel.scheduler import AcceleratedScheduler
>>> AcceleratedScheduler.__name__
'PreparedScheduler'
"""

from nbaccel.training.strategies.prepared import PreparedScheduler as AcceleratedScheduler

__all__ = ["AcceleratedScheduler"]
