"""Small free functions Accelerate has in ``accelerate.utils``: unwrap a model, wait for ranks.

>>> import torch
>>> extract_model_from_parallel(torch.nn.Linear(1, 1)).__class__.__name__
'Linear'
"""

from __future__ import annotations

from typing import Any

import torch

from nbaccel.training import ops
from nbaccel.training.precision import Precision


def extract_model_from_parallel(
    model: torch.nn.Module,
    keep_fp32_wrapper: bool = True,
    keep_torch_compile: bool = True,
    recursive: bool = False,
) -> torch.nn.Module:
    """The module inside DDP (and torch.compile, unless ``keep_torch_compile``); with
    ``recursive=True`` also DDP wrappers nested among its submodules.

    Example::

        plain = extract_model_from_parallel(ddp_model)
    """
    from torch.nn.parallel import DistributedDataParallel

    compiled = getattr(model, "_orig_mod", None)
    inner: Any = compiled if compiled is not None else model
    while isinstance(inner, DistributedDataParallel):
        inner = inner.module
    if not keep_fp32_wrapper:
        Precision.remove_autocast_forward(inner)
    if recursive:
        for parent in inner.modules():
            for name, child in list(parent.named_children()):
                if isinstance(child, DistributedDataParallel):
                    setattr(parent, name, extract_model_from_parallel(child, keep_fp32_wrapper))
    if compiled is not None and keep_torch_compile and inner is compiled:
        return model
    return inner


def wait_for_everyone() -> None:
    """Block until every rank reaches this line (nothing to wait for in one process).

    Example::

        wait_for_everyone()
    """
    ops.barrier()
