"""Accelerate's ``accelerate.big_modeling`` path: building models without memory, loading
checkpoints into them by device map, and running them with modules offloaded to the CPU or disk
(see :mod:`nbaccel.training.dispatch`; device maps: :mod:`nbaccel.training.device_map`).

>>> import torch
>>> from nbaccel.big_modeling import init_empty_weights
>>> with init_empty_weights():
...     model = torch.nn.Linear(4, 2)
>>> model.weight.is_meta
True
"""

from nbaccel.training.device_map import (
    check_device_map,
    compute_module_sizes,
    find_tied_parameters,
    get_balanced_memory,
    infer_auto_device_map,
)
from nbaccel.training.dispatch import (
    cpu_offload,
    disk_offload,
    dispatch_model,
    init_empty_weights,
    init_on_device,
    load_checkpoint_and_dispatch,
)
from nbaccel.training.model_files import load_checkpoint_in_model
from nbaccel.training.offload import OffloadedWeightsLoader

__all__ = [
    "OffloadedWeightsLoader",
    "check_device_map",
    "compute_module_sizes",
    "cpu_offload",
    "disk_offload",
    "dispatch_model",
    "find_tied_parameters",
    "get_balanced_memory",
    "infer_auto_device_map",
    "init_empty_weights",
    "init_on_device",
    "load_checkpoint_and_dispatch",
    "load_checkpoint_in_model",
]
