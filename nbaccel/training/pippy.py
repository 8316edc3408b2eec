"""Accelerate's ``prepare_pippy``: pipeline-parallel inference on ``torch.distributed.pipelining``
(GPipe), one stage per process, the batch cut into ``num_chunks`` micro-batches.

What a call returns, as Accelerate's: the last process gets the model's output, the others
None (all of them with ``gather_output=True``); a batch smaller than the traced one is padded
with zero rows as Accelerate pads it (the output keeps those rows). nbaccel also refuses, on the
first process and before anything is sent, a batch whose micro-batches would not have the
traced rows (torch's stages would abort on a size mismatch), and split points that are not
modules of the model. ``split_points="auto"`` cuts the model into stages of equal size
(:func:`~nbaccel.training.pipeline_stages.balanced_split_points`).
"""

from __future__ import annotations

from types import MethodType
from typing import Any

import torch

from nbaccel.training import ops, pipeline_stages
from nbaccel.training.partial_state import PartialState


def _pad_rows(data: Any, rows: int) -> Any:
    """Every batch tensor of ``data`` padded with zero rows up to ``rows`` (Accelerate pads
    with zeros too)."""

    def pad(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.dim() == 0 or tensor.shape[0] >= rows:
            return tensor
        padded = tensor.new_zeros((rows, *tensor.shape[1:]))
        padded[: tensor.shape[0]] = tensor
        return padded

    return ops.recursively_apply(pad, data)


def _pippy_forward(
    schedule: Any, num_chunks: int, micro_rows: int, gather_output: bool, *args: Any, **kwargs: Any
) -> Any:
    state = PartialState()
    output = None
    if state.is_main_process:
        rows = pipeline_stages.batch_rows(args, kwargs)
        if rows is None:
            raise ValueError("Could not find batch size from args or kwargs")
        wanted = num_chunks * micro_rows
        if rows > wanted:
            raise ValueError(
                f"a batch of {rows} rows makes {num_chunks} micro-batches of "
                f"{-(-rows // num_chunks)} rows, but the pipeline was traced on example inputs "
                f"of {micro_rows} row(s): pass batches of {wanted} rows (or fewer: they are "
                f"padded), or prepare with example inputs of {-(-rows // num_chunks)} rows"
            )
        if rows < wanted:
            args, kwargs = _pad_rows(args, wanted), _pad_rows(kwargs, wanted)
        schedule.step(*args, **kwargs)
    elif state.is_last_process:
        output = schedule.step()
    else:
        schedule.step()
    if gather_output:
        output = ops.broadcast_object_list([output], from_process=state.num_processes - 1)[0]
    return output


def prepare_pippy(
    model: torch.nn.Module,
    split_points: str | list[str] | None = "auto",
    no_split_module_classes: list[str] | None = None,
    example_args: tuple[Any, ...] | None = (),
    example_kwargs: dict[str, Any] | None = None,
    num_chunks: int | None = None,
    gather_output: bool | None = False,
) -> torch.nn.Module:
    """Wrap ``model`` for pipeline-parallel inference, as Accelerate's ``prepare_pippy``: each
    process holds one stage (``split_points``: module names, or ``"auto"`` for stages of equal
    size, keeping ``no_split_module_classes`` whole); ``model(batch)`` then runs the batch as
    ``num_chunks`` micro-batches (default: one per process) and returns the output on the last
    process, None on the others (``gather_output=True``: on every process).
    ``example_args``/``example_kwargs`` are one micro-batch of inputs, for tracing.

    In one process the model runs as it is (Accelerate's meaning too).

    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    >>> model = prepare_pippy(model, example_args=(torch.ones(1, 4),))
    >>> with torch.no_grad():
    ...     model(torch.ones(1, 4)).shape
    torch.Size([1, 2])
    """
    state = PartialState()
    example_args = ops.send_to_device(example_args or (), "cpu")
    example_kwargs = ops.send_to_device(example_kwargs, "cpu") if example_kwargs else None
    if num_chunks is None:
        num_chunks = state.num_processes
    stages = state.num_processes
    if split_points == "auto" or split_points is None:
        points = pipeline_stages.balanced_split_points(model, stages, no_split_module_classes)
    else:
        points = pipeline_stages.check_split_points(model, split_points)
    model.hf_split_points = points  # type: ignore[assignment]  # Accelerate's attribute
    if stages == 1:  # the model as it is, whatever the split points (one process: no stages)
        return model
    if len(points) + 1 != stages:
        raise ValueError(
            f"{len(points)} split points ({', '.join(map(repr, points)) or 'none'}) make "
            f"{len(points) + 1} stages, but prepare_pippy runs one stage per process and there "
            f"are {stages}: pass {stages - 1} split points, or split_points='auto'"
        )
    from torch.distributed.pipelining import ScheduleGPipe

    micro_rows = pipeline_stages.batch_rows(example_args, example_kwargs)
    if micro_rows is None:
        raise ValueError("prepare_pippy needs example_args or example_kwargs holding a batch")
    pipe = pipeline_stages.trace(model, points, tuple(example_args), example_kwargs)
    stage = pipe.build_stage(state.process_index, device=state.device)
    schedule = ScheduleGPipe(stage, num_chunks)
    model._original_forward = model.forward  # type: ignore[assignment]
    model._original_call = model.__call__  # type: ignore[assignment]
    model.pippy_stage = schedule  # type: ignore[assignment]

    def forward(*args: Any, **kwargs: Any) -> Any:
        return _pippy_forward(
            schedule, num_chunks, micro_rows, bool(gather_output), *args, **kwargs
        )

    # Accelerate's shape, for code that reads it: a plain function whose __wrapped__ is the
    # wrapper bound to the model.
    forward.__wrapped__ = MethodType(forward, model)  # type: ignore[attr-defined]
    model.forward = forward
    return model
