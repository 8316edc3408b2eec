"""Accelerate's ``accelerate.state`` path: ``PartialState``, ``AcceleratorState`` and
``DistributedType`` (see :mod:`nbaccel.training.partial_state`), and ``GradientState``: each
Accelerator has its own, ``accelerator.gradient_state``.

>>> from nbaccel.state import DistributedType, PartialState
>>> DistributedType.MULTI_CPU.value
'MULTI_CPU'
"""

from nbaccel.training.accumulation import GradientState
from nbaccel.training.distributed import DistributedType
from nbaccel.training.partial_state import AcceleratorState, PartialState

__all__ = ["AcceleratorState", "DistributedType", "GradientState", "PartialState"]
