"""Accelerate's ``accelerate.tracking`` path: the tracker classes, ``GeneralTracker`` to write
your own, and ``on_main_process`` for its methods (see :mod:`nbaccel.training.trackers`).

>>> from nbaccel.tracking import GeneralTracker, on_main_process
>>> GeneralTracker.main_process_only
True
"""

from nbaccel.training.kwargs_handlers import LoggerType
from nbaccel.training.trackers import (
    AimTracker,
    ClearMLTracker,
    CometMLTracker,
    DVCLiveTracker,
    GeneralTracker,
    MLflowTracker,
    TensorBoardTracker,
    WandBTracker,
    filter_trackers,
    on_main_process,
)

__all__ = [
    "AimTracker",
    "ClearMLTracker",
    "CometMLTracker",
    "DVCLiveTracker",
    "GeneralTracker",
    "LoggerType",
    "MLflowTracker",
    "TensorBoardTracker",
    "WandBTracker",
    "filter_trackers",
    "on_main_process",
]
