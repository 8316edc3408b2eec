"""Seeding and capturing every random number generator a training run draws from.

``set_seed`` makes a run repeatable; ``capture_rng_state``/``restore_rng_state`` let a checkpoint
carry the generators so a resumed run draws exactly what the uninterrupted one would have.

>>> set_seed(0)
>>> import torch; a = torch.rand(1); set_seed(0); bool(torch.rand(1) == a)
True
"""

from __future__ import annotations

import random as _py_random
from typing import Any

import torch

from nbaccel.training.distributed import env_int

_np: Any
try:
    import numpy as _np
except ImportError:  # numpy is optional for torch; seed it only where it exists
    _np = None

RNG_TYPES = ("torch", "cuda", "python", "numpy", "generator")


def set_seed(seed: int, device_specific: bool = False, deterministic: bool = False) -> None:
    """Seed Python's ``random``, NumPy, torch and CUDA.

    ``device_specific=True`` adds the process index, so ranks draw different numbers (useful for
    data augmentation) while the run stays repeatable. ``deterministic=True`` also makes torch
    use only deterministic algorithms (``torch.use_deterministic_algorithms``), which raises on
    an operation that has none.

    >>> import nbaccel, torch
    >>> def draw(device_specific):
    ...     set_seed(42, device_specific=device_specific)
    ...     return torch.randint(1000, (1,)).item()
    >>> same = nbaccel.notebook_launcher(  # the same model init on every rank
    ...     draw, args=(False,), num_processes=2, return_all=True, progress=False
    ... )  # doctest: +ELLIPSIS
    nbaccel: launching 2 processes...
    >>> own = nbaccel.notebook_launcher(  # rank 1 uses 43: its own augmentations
    ...     draw, args=(True,), num_processes=2, return_all=True, progress=False
    ... )  # doctest: +ELLIPSIS
    nbaccel: launching 2 processes...
    >>> same[0] == same[1] == own[0] != own[1]
    True
    """
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an integer, got {seed!r}.")
    if device_specific:
        seed += env_int("RANK", 0)
    _py_random.seed(seed)
    if _np is not None:
        _np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds every CUDA device, lazily
    if deterministic:
        torch.use_deterministic_algorithms(True)


def check_rng_types(rng_types: Any) -> list[str]:
    """Validate ``Accelerator(rng_types=...)``; ``None`` means ``["generator"]``."""
    if rng_types is None:
        return ["generator"]
    if isinstance(rng_types, str):
        rng_types = [rng_types]
    chosen = list(rng_types)
    for name in chosen:
        if name not in RNG_TYPES:
            raise ValueError(
                f"rng_types contains {name!r}; choose from {', '.join(map(repr, RNG_TYPES))}."
            )
    return chosen


def capture_rng_state() -> dict[str, Any]:
    """Every generator's state, as plain tensors and lists (loadable with ``weights_only``)."""
    py_version, py_internal, py_gauss = _py_random.getstate()
    state: dict[str, Any] = {
        "python": [py_version, list(py_internal), py_gauss],
        "torch": torch.get_rng_state(),
    }
    if _np is not None:
        kind, keys, pos, has_gauss, gauss = _np.random.get_state()
        state["numpy"] = [kind, torch.from_numpy(keys.astype("int64")), pos, has_gauss, gauss]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Put back what :func:`capture_rng_state` returned."""
    version, internal, gauss = state["python"]
    _py_random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(state["torch"])
    if _np is not None and "numpy" in state:
        kind, keys, pos, has_gauss, gauss = state["numpy"]
        _np.random.set_state((kind, keys.numpy().astype("uint32"), pos, has_gauss, gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def rng_states_file(step: int) -> dict[str, Any]:
    """This process's generators as Accelerate writes them to ``random_states_<rank>.pkl``
    (its key names and Python/NumPy/torch state types), with the accumulation ``step``; CUDA's
    only where this process already uses CUDA.

    >>> sorted(rng_states_file(3))[:3]
    ['numpy_random_seed', 'random_state', 'step']
    """
    states: dict[str, Any] = {"step": step, "random_state": _py_random.getstate()}
    if _np is not None:
        states["numpy_random_seed"] = _np.random.get_state()
    states["torch_manual_seed"] = torch.get_rng_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["torch_cuda_manual_seed"] = torch.cuda.get_rng_state_all()
    return states


def restore_rng_states_file(states: dict[str, Any]) -> int | None:
    """Put back the generators of a ``random_states_<rank>.pkl`` (Accelerate's or nbaccel's);
    returns its accumulation ``step``, if it has one."""
    _py_random.setstate(states["random_state"])
    if _np is not None and "numpy_random_seed" in states:
        _np.random.set_state(states["numpy_random_seed"])
    torch.set_rng_state(states["torch_manual_seed"])
    if "torch_cuda_manual_seed" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["torch_cuda_manual_seed"])
    return states.get("step")


def synchronize_rng_states(rng_types: Any, generator: torch.Generator | None = None) -> None:
    """Give every rank the main process's ``torch``/``cuda``/``python``/``numpy`` generators,
    and with ``"generator"`` the state of ``generator`` (a DataLoader's, for instance).

    Prepared DataLoaders need no ``"generator"``: they already shuffle with a seed shared by all
    ranks, and call this at the start of each epoch for the ``Accelerator(rng_types=...)`` they
    were given.

    ``synchronize_rng_states(["generator"], generator=loader.generator)`` shares a loader's.

    >>> import nbaccel, os, torch
    >>> def draw():
    ...     nbaccel.Accelerator()  # forms the process group
    ...     torch.manual_seed(int(os.environ["RANK"]))  # each rank its own state...
    ...     synchronize_rng_states(["torch"])  # ...until rank 0's is given to every rank
    ...     return torch.randint(1000, (1,)).item()
    >>> drawn = nbaccel.notebook_launcher(
    ...     draw, num_processes=2, return_all=True, progress=False
    ... )  # doctest: +ELLIPSIS
    nbaccel: launching 2 processes...
    >>> drawn[0] == drawn[1]
    True
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    if "generator" in rng_types and generator is not None:
        shared = [generator.get_state()]
        dist.broadcast_object_list(shared, src=0)
        generator.set_state(shared[0])
    wanted = [t for t in rng_types if t != "generator"]
    if not wanted:
        return
    payload = [capture_rng_state()]
    dist.broadcast_object_list(payload, src=0)
    state = payload[0]
    if "torch" in wanted:
        torch.set_rng_state(state["torch"])
    if "cuda" in wanted and "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "python" in wanted:
        version, internal, gauss = state["python"]
        _py_random.setstate((version, tuple(internal), gauss))
    if "numpy" in wanted and _np is not None and "numpy" in state:
        kind, keys, pos, has_gauss, gauss = state["numpy"]
        _np.random.set_state((kind, keys.numpy().astype("uint32"), pos, has_gauss, gauss))
