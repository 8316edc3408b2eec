"""Accelerate's ``accelerate.local_sgd`` path: ``from nbaccel.local_sgd import LocalSGD``.

>>> from nbaccel.local_sgd import LocalSGD
>>> LocalSGD.__name__
'LocalSGD'
"""

from nbaccel.training.local_sgd import LocalSGD

__all__ = ["LocalSGD"]
