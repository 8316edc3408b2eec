"""Accelerate's ``accelerate.data_loader`` path: ``prepare_data_loader``,
``SeedableRandomSampler``, the prepared loaders' classes ``DataLoaderShard`` and
``DataLoaderDispatcher``, and ``skip_first_batches`` (see :mod:`nbaccel.training.data`).

>>> from nbaccel.data_loader import DataLoaderShard, prepare_data_loader
>>> from torch.utils.data import DataLoader
>>> isinstance(prepare_data_loader(DataLoader(range(4), batch_size=2)), DataLoaderShard)
True
"""

from nbaccel.training.data import DataLoaderDispatcher, DataLoaderShard, skip_first_batches
from nbaccel.training.data_compat import SeedableRandomSampler, prepare_data_loader

__all__ = [
    "DataLoaderDispatcher",
    "DataLoaderShard",
    "SeedableRandomSampler",
    "prepare_data_loader",
    "skip_first_batches",
]
