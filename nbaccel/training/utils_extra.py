"""Small free functions Accelerate has in ``accelerate.utils``: unwrap a model, wait for ranks,
save on the main process, a main-process progress bar, a patched environment, concatenation,
a basic config file.

>>> import torch
>>> extract_model_from_parallel(torch.nn.Linear(1, 1)).__class__.__name__
'Linear'
>>> concatenate([{"x": torch.ones(1)}, {"x": torch.zeros(2)}])["x"]
tensor([1., 0., 0.])
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from nbaccel.core.config import LaunchConfig, default_config_path
from nbaccel.training import checkpoint, model_files, ops
from nbaccel.training.precision import Precision
from nbaccel.training.state import env_int


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


def save(
    obj: Any,
    f: str | os.PathLike[str],
    save_on_each_node: bool = False,
    safe_serialization: bool = False,
) -> None:
    """``torch.save`` (or safetensors with ``safe_serialization``) on the main process only
    (the main process of each machine with ``save_on_each_node``), written atomically.

    Example::

        save(model.state_dict(), "out/model.pt")     # rank 0 writes; the others skip
    """
    if env_int("LOCAL_RANK" if save_on_each_node else "RANK", 0) == 0:
        write(obj, f, safe_serialization)


def write(obj: Any, f: str | os.PathLike[str], safe_serialization: bool) -> None:
    """Write ``obj`` atomically: safetensors (a dict of tensors) or ``torch.save``."""
    if safe_serialization:
        model_files.save_safetensors(obj, f)
    else:
        checkpoint.atomic_save(obj, f)


def tqdm(*args: Any, main_process_only: bool = True, **kwargs: Any) -> Any:
    """``tqdm.auto.tqdm``, shown by the local main process only (with ``main_process_only``);
    in a rank it is reported to the launch's dashboard like any tqdm bar.

    Example::

        for batch in tqdm(loader, desc="train"):   # one bar per machine, not per rank
            ...
    """
    if args and isinstance(args[0], bool):
        raise ValueError(
            "tqdm's first argument is the iterable; to show the bar on every rank pass "
            "main_process_only=False (Accelerate's older tqdm(True, ...) form is not supported)."
        )
    from tqdm.auto import tqdm as bar

    if main_process_only:
        kwargs["disable"] = kwargs.get("disable", False) or env_int("LOCAL_RANK", 0) != 0
    return bar(*args, **kwargs)


@contextlib.contextmanager
def patch_environment(**kwargs: Any) -> Iterator[None]:
    """Set environment variables (names upper-cased, values as strings) inside the block, then
    put back what was there before.

    >>> with patch_environment(nbaccel_example="1"):
    ...     os.environ["NBACCEL_EXAMPLE"]
    '1'
    >>> "NBACCEL_EXAMPLE" in os.environ
    False
    """
    before = {key.upper(): os.environ.get(key.upper()) for key in kwargs}
    os.environ.update({key.upper(): str(value) for key, value in kwargs.items()})
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def concatenate(data: list[Any], dim: int = 0) -> Any:
    """Concatenate a list of same-shaped nested structures (lists, tuples, dicts) of tensors
    tensor by tensor along ``dim``.

    Example::

        concatenate([{"logits": a}, {"logits": b}])   # {"logits": torch.cat([a, b])}
    """
    if not isinstance(data, (list, tuple)) or not data:
        raise TypeError(f"concatenate needs a non-empty list, got {type(data).__name__}.")
    first = data[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(list(data), dim=dim)
    if isinstance(first, tuple) and hasattr(first, "_fields"):  # namedtuple
        return type(first)(*(concatenate([d[i] for d in data], dim) for i in range(len(first))))
    if isinstance(first, (list, tuple)):
        return type(first)(concatenate([d[i] for d in data], dim) for i in range(len(first)))
    if isinstance(first, Mapping):
        return type(first)({k: concatenate([d[k] for d in data], dim) for k in first})
    raise TypeError(
        f"concatenate can only join tensors (in nested lists, tuples, dicts), got "
        f"{type(first).__name__}."
    )


def write_basic_config(
    mixed_precision: str = "no", save_location: str | os.PathLike[str] | None = None
) -> Path | bool:
    """Write nbaccel's default config file (shared by ``notebook_launcher``, the config panel and
    ``nbaccel launch``) with ``mixed_precision`` and every visible GPU as a process, unless the
    file already exists: then return False and leave it as it is.

    Example::

        write_basic_config(mixed_precision="bf16")   # ~/.config/nbaccel/default_config.yaml
    """
    path = Path(save_location) if save_location is not None else default_config_path()
    if path.exists():
        print(f"nbaccel: a config file already exists at {path}; it was left as it is.")
        return False
    return LaunchConfig(mixed_precision=mixed_precision).save(path)
