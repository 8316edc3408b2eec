"""Sharded checkpoints (FSDP's ``SHARDED_STATE_DICT``): one torch.distributed.checkpoint folder
per model or optimizer, each rank writing its own shard.

Apart from the FSDP strategy so any strategy reads them: torch.distributed.checkpoint reshards
on load, so a folder written by 2 FSDP ranks loads into 1 process, DDP, or another number of
ranks. Imported only when such a folder is met (torch.distributed.checkpoint takes seconds).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)


def save_sharded_model(module: torch.nn.Module, folder: Path) -> None:
    """Every rank writes its shards of ``module`` into ``folder`` (a collective).

    Example::

        save_sharded_model(model, Path("ckpt/model_0"))
    """
    _dcp_save({"model": get_model_state_dict(module)}, folder)


def load_sharded_model(module: torch.nn.Module, folder: Path) -> None:
    """Read a :func:`save_sharded_model` folder into ``module``, on any number of ranks.

    Example::

        load_sharded_model(model, Path("ckpt/model_0"))
    """
    state = {"model": get_model_state_dict(module)}
    _dcp_load(state, folder)
    set_model_state_dict(module, state["model"])


def save_sharded_optimizer(
    module: torch.nn.Module, optimizer: torch.optim.Optimizer, folder: Path
) -> None:
    """Every rank writes its shard of ``optimizer``'s state, keyed by ``module``'s parameter names.

    Example::

        save_sharded_optimizer(model, opt, Path("ckpt/optimizer_0"))
    """
    state = get_optimizer_state_dict(module, optimizer)
    _dcp_save({"optimizer": state}, folder)


def load_sharded_optimizer(
    module: torch.nn.Module, optimizer: torch.optim.Optimizer, folder: Path
) -> None:
    """Read a :func:`save_sharded_optimizer` folder into ``optimizer`` (paired with ``module``).

    Example::

        load_sharded_optimizer(model, opt, Path("ckpt/optimizer_0"))
    """
    state = {"optimizer": get_optimizer_state_dict(module, optimizer)}
    _dcp_load(state, folder)
    set_optimizer_state_dict(module, optimizer, state["optimizer"])


def _dcp_save(state: dict[str, Any], folder: Path) -> None:
    dcp.save(state, checkpoint_id=str(folder), no_dist=not dist.is_initialized())


def _dcp_load(state: dict[str, Any], folder: Path) -> None:
    with warnings.catch_warnings():
        # One process without a process group is a supported reader; torch warns regardless.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=str(folder), no_dist=not dist.is_initialized())
