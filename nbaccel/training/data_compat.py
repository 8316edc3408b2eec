"""Accelerate's ``accelerate.data_loader`` functions over nbaccel's prepared loaders:
``prepare_data_loader`` (sharding without an Accelerator) and ``SeedableRandomSampler``.

>>> from torch.utils.data import DataLoader
>>> dl = prepare_data_loader(DataLoader(range(8), batch_size=2))   # one process: all of it
>>> [b.tolist() for b in dl]
[[0, 1], [2, 3], [4, 5], [6, 7]]
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch.utils.data import DataLoader, RandomSampler

from nbaccel.training import data
from nbaccel.training.accumulation import GradientState
from nbaccel.training.rng import check_rng_types
from nbaccel.training.sharding import SeedableRandomSampler

__all__ = ["SeedableRandomSampler", "prepare_data_loader", "seedable"]


def seedable(loader: DataLoader, data_seed: int | None) -> DataLoader:
    """``loader`` with its RandomSampler replaced by a :class:`SeedableRandomSampler`
    (``DataLoaderConfiguration(use_seedable_sampler=True)``); other loaders as they are."""
    sampler = loader.sampler
    if type(sampler) is not RandomSampler or loader.batch_size is None:
        return loader
    replaced = SeedableRandomSampler(
        data_source=sampler.data_source,
        replacement=sampler.replacement,
        num_samples=sampler._num_samples,
        generator=sampler.generator,
        data_seed=data_seed,
    )
    kwargs = {
        name: getattr(loader, name)
        for name in ("num_workers", "collate_fn", "pin_memory", "drop_last", "timeout")
    }
    kwargs.update(worker_init_fn=loader.worker_init_fn, generator=loader.generator)
    kwargs["multiprocessing_context"] = loader.multiprocessing_context
    kwargs["persistent_workers"] = loader.persistent_workers
    if loader.num_workers > 0:
        kwargs["prefetch_factor"] = loader.prefetch_factor
    return DataLoader(loader.dataset, batch_size=loader.batch_size, sampler=replaced, **kwargs)


def prepare_data_loader(
    dataloader: DataLoader,
    device: torch.device | None = None,
    num_processes: int | None = None,
    process_index: int | None = None,
    split_batches: bool = False,
    put_on_device: bool = False,
    rng_types: Any = None,
    dispatch_batches: bool | None = None,
    even_batches: bool = True,
    slice_fn_for_dispatch: Any = None,
    use_seedable_sampler: bool = False,
    data_seed: int | None = None,
    non_blocking: bool = False,
    use_stateful_dataloader: bool = False,
    torch_device_mesh: Any = None,
) -> data.PreparedDataLoader:
    """Shard ``dataloader`` over this launch's processes without an Accelerator (what
    ``accelerator.prepare`` does for a loader). ``num_processes``/``process_index`` default to
    the launch's; batches go to ``device`` (default: this process's) with ``put_on_device``.

    Example::

        dl = prepare_data_loader(DataLoader(ds, batch_size=8, shuffle=True), put_on_device=True)
    """
    from nbaccel.training.partial_state import PartialState

    if torch_device_mesh is not None:
        raise NotImplementedError(
            "prepare_data_loader(torch_device_mesh=...): nbaccel shards over all processes "
            "(data parallel); leave it out."
        )
    process = PartialState()._process
    changes = {
        name: value
        for name, value in (
            ("num_processes", num_processes),
            ("process_index", process_index),
            ("device", torch.device(device) if device is not None else None),
        )
        if value is not None
    }
    process = dataclasses.replace(process, **changes)
    if use_seedable_sampler:
        dataloader = seedable(dataloader, data_seed)
    rng = () if rng_types is None else tuple(check_rng_types(rng_types))
    return data.loader_class(dataloader, dispatch_batches)(
        dataloader,
        process,
        GradientState(),
        split_batches=split_batches,
        even_batches=even_batches,
        device_placement=put_on_device,
        data_seed=data_seed,
        sync_rng=rng,
        non_blocking=non_blocking,
    )
