"""Cutting a model into pipeline stages: the split points (checked, or chosen by size), the
trace by ``torch.distributed.pipelining`` and the stages each rank builds from it, for
inference (:func:`nbaccel.inference.prepare_pippy`) and training
(:func:`nbaccel.prepare_pipeline`) alike.

A split point is the name of a module of the model (``"blocks.2"``): the stage it opens
starts with that module. A name that is not a module is refused here, naming the modules that
would fit, before any collective runs.

>>> import torch
>>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
>>> check_split_points(model, ["2"])
['2']
>>> balanced_split_points(model, 2)
['1']
"""

from __future__ import annotations

import difflib
import warnings
from collections.abc import Sequence
from typing import Any

import torch


def check_split_points(model: torch.nn.Module, split_points: str | Sequence[str]) -> list[str]:
    """``split_points`` as a list, each one a module of ``model``, none twice; otherwise a
    ``ValueError`` naming the value and the modules that would fit.

    >>> import torch
    >>> check_split_points(torch.nn.Sequential(torch.nn.Linear(2, 2)), ["1"])
    Traceback (most recent call last):
    ...
    ValueError: split point '1' is not a module of the model (Sequential); ...
    """
    points = [split_points] if isinstance(split_points, str) else list(split_points)
    modules = dict(model.named_modules())
    top = [name for name, _ in model.named_children()]
    for point in points:
        if not isinstance(point, str) or not point or point not in modules:
            close = difflib.get_close_matches(str(point), list(modules), n=3, cutoff=0.6)
            hint = f"did you mean {', '.join(map(repr, close))}? " if close else ""
            raise ValueError(
                f"split point {point!r} is not a module of the model ({type(model).__name__}); "
                f"{hint}a split point names the module its stage starts with, as "
                f"model.named_modules() lists them, e.g. one of its children: "
                f"{', '.join(map(repr, top[:12]))}"
            )
    repeated = sorted({p for p in points if points.count(p) > 1})
    if repeated:
        raise ValueError(f"split points name {', '.join(map(repr, repeated))} more than once")
    return points


def _size(module: torch.nn.Module) -> int:
    tensors = [*module.parameters(), *module.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


def balanced_split_points(
    model: torch.nn.Module, num_stages: int, no_split_module_classes: Sequence[str] | None = None
) -> list[str]:
    """``num_stages - 1`` split points that cut ``model`` into stages of about equal size
    (parameters and buffers, in bytes), in the order its modules are registered (the order a
    Transformer runs them). A module larger than one stage's share is opened into its
    children unless its class is in ``no_split_module_classes`` (Hugging Face models list their
    blocks in ``_no_split_modules``).

    >>> import torch
    >>> blocks = [torch.nn.Linear(8, 8) for _ in range(4)]
    >>> model = torch.nn.Sequential(torch.nn.Sequential(*blocks), torch.nn.Linear(8, 1))
    >>> balanced_split_points(model, 2)
    ['0.2']
    """
    if num_stages < 2:
        return []
    keep = set(no_split_module_classes or ())
    share = _size(model) / num_stages
    pieces: list[tuple[str, torch.nn.Module]] = list(model.named_children())
    opened = True
    while opened:  # open large containers until every piece fits a share or is kept whole
        opened = False
        result: list[tuple[str, torch.nn.Module]] = []
        for name, module in pieces:
            children = list(module.named_children())
            if _size(module) > share and children and type(module).__name__ not in keep:
                result.extend((f"{name}.{child}", sub) for child, sub in children)
                opened = True
            else:
                result.append((name, module))
        pieces = result
    if len(pieces) < num_stages:
        raise ValueError(
            f"the model has {len(pieces)} modules to cut at ({', '.join(n for n, _ in pieces)}), "
            f"too few for {num_stages} stages: pass split_points, or use fewer processes"
        )
    points: list[str] = []
    before = 0
    for index, (name, module) in enumerate(pieces):
        stage = len(points) + 1
        left = len(pieces) - index  # every later stage needs a piece of its own
        # cut before this piece where that boundary lies nearer the share than the next one
        nearer = before + _size(module) / 2 >= stage * share
        if index and stage < num_stages and (nearer or left == num_stages - stage):
            points.append(name)
        before += _size(module)
    return points


def trace(
    model: torch.nn.Module,
    split_points: Sequence[str],
    micro_args: tuple[Any, ...],
    micro_kwargs: dict[str, Any] | None,
) -> Any:
    """The model traced by ``torch.distributed.pipelining.pipeline`` on one micro-batch and cut
    before each split point (a ``Pipe``: ``build_stage(i, device, group)`` per stage)."""
    from torch.distributed.pipelining import SplitPoint, pipeline

    spec = {point: SplitPoint.BEGINNING for point in split_points}
    with warnings.catch_warnings():
        # torch's own tracer copies its tree specs through a deprecated check (torch 2.13): a
        # warning on every rank that names nothing the user wrote
        warnings.filterwarnings("ignore", r".*isinstance\(treespec, LeafSpec\)", FutureWarning)
        return pipeline(model, mb_args=tuple(micro_args), mb_kwargs=micro_kwargs, split_spec=spec)


def batch_rows(args: Sequence[Any], kwargs: dict[str, Any] | None = None) -> int | None:
    """The rows (first dimension) of the first tensor among ``args`` then ``kwargs``' values,
    looking inside lists, tuples and dicts; None if there is none.

    >>> import torch
    >>> batch_rows((None, {"x": torch.zeros(3, 2)}))
    3
    """
    for value in [*args, *(kwargs or {}).values()]:
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return int(value.shape[0])
        if isinstance(value, (list, tuple)):
            found = batch_rows(value)
        elif isinstance(value, dict):
            found = batch_rows((), value)
        else:
            continue
        if found is not None:
            return found
    return None


def rows_slice(data: Any, start: int, stop: int) -> Any:
    """``data`` with every tensor's rows ``start:stop`` (other values as they are).

    >>> import torch
    >>> rows_slice({"x": torch.arange(4), "n": 1}, 1, 3)
    {'x': tensor([1, 2]), 'n': 1}
    """
    if isinstance(data, torch.Tensor) and data.dim() > 0:
        return data[start:stop]
    if isinstance(data, (list, tuple)):
        return type(data)(rows_slice(v, start, stop) for v in data)
    if isinstance(data, dict):
        return {k: rows_slice(v, start, stop) for k, v in data.items()}
    return data
