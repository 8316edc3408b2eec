"""Accelerate's ``accelerate.optimizer`` path: ``AcceleratedOptimizer``, the class of what
``accelerator.prepare`` returns for an optimizer (nbaccel's
:class:`~nbaccel.training.strategies.prepared.PreparedOptimizer`), for ported
``isinstance`` checks.

>>> from nbaccel.optimizer import AcceleratedOptimizer
>>> AcceleratedOptimizer.__name__
'PreparedOptimizer'
"""

from nbaccel.training.strategies.prepared import PreparedOptimizer as AcceleratedOptimizer

__all__ = ["AcceleratedOptimizer"]
