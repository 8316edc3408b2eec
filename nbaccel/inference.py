"""Accelerate's ``accelerate.inference`` path: ``prepare_pippy``, pipeline-parallel inference
(see :mod:`nbaccel.training.pippy`).

>>> from nbaccel.inference import prepare_pippy
>>> prepare_pippy.__module__
'nbaccel.training.pippy'
"""

from nbaccel.training.pippy import prepare_pippy

__all__ = ["prepare_pippy"]
