"""Accelerate's ``accelerate.parallelism_config`` path: ``ParallelismConfig`` (see
:mod:`nbaccel.training.parallelism_config`).

>>> from nbaccel.parallelism_config import ParallelismConfig
>>> ParallelismConfig(tp_size=2).tp_enabled
True
"""

from nbaccel.training.parallelism_config import ParallelismConfig

__all__ = ["ParallelismConfig"]
