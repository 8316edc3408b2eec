"""Pipeline-parallel TRAINING on ``torch.distributed.pipelining`` schedules (GPipe, 1F1B,
interleaved 1F1B), combined with data parallelism: nbaccel's own API. (Accelerate trains
pipelines only through DeepSpeed or Megatron-LM; its ``prepare_pippy`` is for inference, and
nbaccel has it too: :func:`nbaccel.inference.prepare_pippy`.)

Inside a launched function::

    pipe = nbaccel.prepare_pipeline(model, ["blocks.2"], example_batch=(x,),
                                    loss_fn=F.cross_entropy, num_microbatches=4)
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-3)
    for x, y in batches:                 # the global batch, the same on every rank
        loss = pipe.train_step(x, target=y)
        optimizer.step(); optimizer.zero_grad()

The ranks form ``data_parallel × pipeline`` groups: with S stages (split points + 1) and
``stages_per_rank`` V, a pipeline spans S / V ranks and the N processes hold N / (S / V)
copies of it, each training on its own rows of the global batch (rank r is stage
``r % (S / V)`` of copy ``r // (S / V)``). In one process the stages run one after another
here, without ``torch.distributed``: the same function gives the reference numbers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from nbaccel.training import ops, pipeline_stages

# Accepted schedule names (any case; '-' and '_' ignored) -> the torch class name.
SCHEDULES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved1f1b": "ScheduleInterleaved1F1B",
    "interleaved": "ScheduleInterleaved1F1B",
}
_MULTI_STAGE = {"ScheduleInterleaved1F1B"}


def schedule_class_name(schedule: str, stages_per_rank: int) -> str:
    """The ``torch.distributed.pipelining`` class a schedule name means, checked against
    ``stages_per_rank`` (interleaved schedules hold several stages per rank, the others one).

    >>> schedule_class_name("1F1B", 1), schedule_class_name("interleaved", 2)
    ('Schedule1F1B', 'ScheduleInterleaved1F1B')
    """
    key = schedule.lower().replace("-", "").replace("_", "").removeprefix("schedule")
    name = SCHEDULES.get(key)
    if name is None:
        raise ValueError(
            f"schedule={schedule!r} is not a pipeline schedule; choose one of "
            "'GPipe', '1F1B', 'Interleaved1F1B'"
        )
    if stages_per_rank > 1 and name not in _MULTI_STAGE:
        raise ValueError(
            f"schedule={schedule!r} runs one stage per rank, but stages_per_rank="
            f"{stages_per_rank}: use schedule='Interleaved1F1B', or stages_per_rank=1"
        )
    if stages_per_rank == 1 and name in _MULTI_STAGE:
        raise ValueError(
            f"schedule={schedule!r} interleaves several stages per rank: pass "
            "stages_per_rank=2 (or more) with one more split point per extra stage, or use "
            "schedule='1F1B'"
        )
    return name


def check_interleaved_rounds(num_microbatches: int, pipeline_ranks: int) -> None:
    """torch's interleaved schedule runs the micro-batches in ``max(1, m // ranks)`` rounds,
    which must divide them; a ``ValueError`` naming counts that work otherwise.

    >>> check_interleaved_rounds(4, 2)
    >>> check_interleaved_rounds(5, 2)
    Traceback (most recent call last):
    ...
    ValueError: an interleaved schedule on 2 pipeline ranks runs 5 micro-batches in 2 rounds, ...
    """
    rounds = max(1, num_microbatches // pipeline_ranks)
    if num_microbatches % rounds:
        raise ValueError(
            f"an interleaved schedule on {pipeline_ranks} pipeline ranks runs "
            f"{num_microbatches} micro-batches in {rounds} rounds, which must divide them: use "
            f"up to {pipeline_ranks}, or a multiple of {pipeline_ranks} such as "
            f"{pipeline_ranks * rounds} or {pipeline_ranks * (rounds + 1)}"
        )


def pipeline_layout(num_stages: int, stages_per_rank: int, world_size: int) -> tuple[int, int]:
    """``(pipeline ranks, data-parallel copies)`` for ``num_stages`` stages on ``world_size``
    processes; a ``ValueError`` naming the values and what would fit otherwise.

    >>> pipeline_layout(num_stages=2, stages_per_rank=1, world_size=4)
    (2, 2)
    """
    if stages_per_rank < 1 or num_stages % stages_per_rank:
        raise ValueError(
            f"{num_stages} stages cannot be dealt {stages_per_rank} per rank: pass split points "
            f"that make a multiple of stages_per_rank={stages_per_rank} stages"
        )
    ranks = num_stages // stages_per_rank
    if ranks > world_size or world_size % ranks:
        fits = [n * stages_per_rank for n in range(1, world_size + 1) if world_size % n == 0]
        raise ValueError(
            f"{num_stages} stages ({num_stages - 1} split points) at {stages_per_rank} per rank "
            f"need {ranks} ranks per pipeline, which {world_size} processes cannot hold "
            f"{'(more stages than ranks)' if ranks > world_size else 'a whole number of times'}"
            f": on {world_size} processes use {', '.join(map(str, fits))} stages, or raise "
            "stages_per_rank (an interleaved schedule)"
        )
    return ranks, world_size // ranks


def micro_batch_rows(rows: int, data_parallel: int, num_microbatches: int) -> int:
    """Rows per micro-batch for a global batch of ``rows`` over ``data_parallel`` copies; a
    ``ValueError`` naming the values and the batch sizes that fit otherwise.

    >>> micro_batch_rows(16, data_parallel=2, num_microbatches=4)
    2
    >>> micro_batch_rows(10, data_parallel=2, num_microbatches=4)
    Traceback (most recent call last):
    ...
    ValueError: a batch of 10 rows cannot be cut into 2 data-parallel parts of 4 micro-batches ...
    """
    per = data_parallel * num_microbatches
    if rows < per or rows % per:
        raise ValueError(
            f"a batch of {rows} rows cannot be cut into {data_parallel} data-parallel parts of "
            f"{num_microbatches} micro-batches each: its rows must be a multiple of {per}, "
            f"e.g. {max(per, rows // per * per)} or {(rows // per + 1) * per}, or change "
            "num_microbatches"
        )
    return rows // per


class PipelineModel:
    """The stages of a model this rank holds, and a training step through a pipeline
    schedule. Made by :func:`prepare_pipeline`.

    ``train_step(*inputs, target=...)`` takes the global batch (the same on every rank), runs
    forward and backward through the schedule on this copy's rows, averages the gradients over
    the data-parallel copies, and returns the batch's mean loss on every rank (computed on the
    last stage). ``parameters()``/``named_parameters()``/``state_dict()`` are this rank's
    stages', under the model's own names.

    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 1))
    >>> pipe = prepare_pipeline(model, ["1"], example_batch=(torch.ones(4, 3),),
    ...                         loss_fn=torch.nn.functional.mse_loss, num_microbatches=2)
    >>> loss = pipe.train_step(torch.ones(4, 3), target=torch.zeros(4, 1))
    >>> (pipe.pipeline_size, pipe.data_parallel_size, [n for n, _ in pipe.named_parameters()])
    (1, 1, ['0.weight', '0.bias', '1.weight', '1.bias'])
    """

    def __init__(
        self,
        modules: list[torch.nn.Module],
        schedule: Any,
        *,
        loss_fn: Callable[..., torch.Tensor],
        num_microbatches: int,
        micro_rows: int,
        is_first: bool,
        is_last: bool,
        pipeline_rank: int,
        pipeline_size: int,
        data_parallel_rank: int,
        data_parallel_size: int,
        data_parallel_group: Any = None,
    ) -> None:
        self.modules = modules
        self.schedule = schedule
        self.loss_fn = loss_fn
        self.num_microbatches = num_microbatches
        self.micro_rows = micro_rows
        self.is_first_stage = is_first
        self.is_last_stage = is_last
        self.pipeline_rank = pipeline_rank
        self.pipeline_size = pipeline_size
        self.data_parallel_rank = data_parallel_rank
        self.data_parallel_size = data_parallel_size
        self._dp_group = data_parallel_group

    def named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        """This rank's parameters under the model's own names (``"blocks.2.fc.weight"``)."""
        for module in self.modules:
            yield from module.named_parameters()

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        """This rank's parameters: what its optimizer steps."""
        for _, parameter in self.named_parameters():
            yield parameter

    def state_dict(self) -> dict[str, Any]:
        """This rank's stages' state, under the model's own names."""
        state: dict[str, Any] = {}
        for module in self.modules:
            state.update(module.state_dict())
        return state

    def train(self, mode: bool = True) -> PipelineModel:
        """Training (or evaluation) mode for this rank's stages, as ``Module.train``."""
        for module in self.modules:
            module.train(mode)
        return self

    def __repr__(self) -> str:
        return (
            f"PipelineModel(stage {self.pipeline_rank} of {self.pipeline_size}, data-parallel "
            f"copy {self.data_parallel_rank} of {self.data_parallel_size}, "
            f"{self.num_microbatches} micro-batches of {self.micro_rows} rows)"
        )

    def train_step(self, *inputs: Any, target: Any) -> torch.Tensor:
        """Forward and backward of the global batch ``inputs``/``target`` (the same on every
        rank); returns its mean loss on every rank. The gradients are in ``.grad`` for the
        optimizer to step."""
        rows = pipeline_stages.batch_rows(inputs)
        if rows is None:
            raise ValueError("train_step found no tensor with a batch dimension in its inputs")
        micro = micro_batch_rows(rows, self.data_parallel_size, self.num_microbatches)
        if micro != self.micro_rows:
            raise ValueError(
                f"a batch of {rows} rows makes micro-batches of {micro} rows, but the pipeline "
                f"was traced with micro-batches of {self.micro_rows} rows (its example_batch "
                f"had {self.micro_rows * self.num_microbatches * self.data_parallel_size}): "
                "pass batches of that size, or prepare a pipeline for this one"
            )
        part = rows // self.data_parallel_size
        start = self.data_parallel_rank * part
        mine = pipeline_stages.rows_slice(inputs, start, start + part)
        mine_target = pipeline_stages.rows_slice(target, start, start + part)
        if self.schedule is None:  # one process: the model stays where the user put it
            return self._run_here(mine, mine_target)
        device = _device()  # the stages' (build_stage put them there); the batch may be on CPU
        mine, mine_target = ops.send_to_device((mine, mine_target), device)
        losses: list[torch.Tensor] = []
        args = mine if self.is_first_stage else ()
        extra = {"target": mine_target, "losses": losses} if self.is_last_stage else {}
        self.schedule.step(*args, **extra)
        self._average_gradients()
        # The last stage of each copy knows its rows' mean loss; one sum over every rank
        # (the other ranks add zero) divided by the copies is the global batch's mean.
        loss = torch.stack([x.detach().float() for x in losses]).mean() if losses else None
        # on the stages' device: NCCL reduces only GPU tensors
        total = torch.zeros((), device=device) if loss is None else loss.to(device)
        dist.all_reduce(total)
        return total / self.data_parallel_size

    def _run_here(self, inputs: tuple[Any, ...], target: Any) -> torch.Tensor:
        """One process: the micro-batches through the whole model in turn, each loss scaled as
        the schedules scale theirs (by the number of micro-batches)."""
        losses = []
        for index in range(self.num_microbatches):
            start = index * self.micro_rows
            stop = start + self.micro_rows
            output = self.modules[0](*pipeline_stages.rows_slice(inputs, start, stop))
            loss = self.loss_fn(output, pipeline_stages.rows_slice(target, start, stop))
            (loss / self.num_microbatches).backward()
            losses.append(loss.detach().float())
        return torch.stack(losses).mean()

    def _average_gradients(self) -> None:
        if self.data_parallel_size == 1:
            return
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])  # one collective, not one per tensor
        dist.all_reduce(flat, group=self._dp_group)
        flat /= self.data_parallel_size
        offset = 0
        for grad in grads:
            grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
            offset += grad.numel()


def prepare_pipeline(
    model: torch.nn.Module,
    split_points: Sequence[str],
    *,
    example_batch: tuple[Any, ...],
    loss_fn: Callable[..., torch.Tensor],
    num_microbatches: int,
    schedule: str = "1F1B",
    stages_per_rank: int = 1,
) -> PipelineModel:
    """Cut ``model`` before each of ``split_points`` (module names) into stages, deal them to
    the launch's ranks and return this rank's :class:`PipelineModel` for training. nbaccel's
    own API: Accelerate has no pipeline training of its own.

    - ``example_batch``: the positional inputs of one global batch as ``train_step`` will get
      them (the pipeline is traced on one micro-batch of it: every batch must have its rows).
    - ``loss_fn(output, target)``: the mean loss of a micro-batch, run on the last stage.
    - ``num_microbatches``: micro-batches per data-parallel copy's part of each batch.
    - ``schedule``: ``"GPipe"``, ``"1F1B"`` or ``"Interleaved1F1B"`` (with
      ``stages_per_rank`` ≥ 2: rank r then holds stages r, r + P, ... of a P-rank pipeline).

    The processes that are left over form data-parallel copies of the pipeline (dp 2 × pp 2
    on 4 processes with one split point). Bad split points, more stages than ranks and
    batches the micro-batches do not divide are refused here, naming the values.

    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 1))
    >>> prepare_pipeline(model, ["2"], example_batch=(torch.ones(4, 3),),
    ...                  loss_fn=torch.nn.functional.mse_loss, num_microbatches=2)
    Traceback (most recent call last):
    ...
    ValueError: split point '2' is not a module of the model (Sequential); ...
    """
    points = pipeline_stages.check_split_points(model, split_points)
    class_name = schedule_class_name(schedule, stages_per_rank)
    if not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise ValueError(f"num_microbatches={num_microbatches!r}: pass a whole number ≥ 1")
    world = _state().num_processes  # forms the process group in a launched rank
    num_stages = len(points) + 1
    rows = pipeline_stages.batch_rows(example_batch)
    if rows is None:
        raise ValueError("example_batch holds no tensor with a batch dimension")
    if world == 1:  # every stage here, one after another: the one-process reference
        micro = micro_batch_rows(rows, 1, num_microbatches)
        return PipelineModel(
            [model], None, loss_fn=loss_fn, num_microbatches=num_microbatches,
            micro_rows=micro, is_first=True, is_last=True, pipeline_rank=0, pipeline_size=1,
            data_parallel_rank=0, data_parallel_size=1,
        )  # fmt: skip
    pp, dp = pipeline_layout(num_stages, stages_per_rank, world)
    micro = micro_batch_rows(rows, dp, num_microbatches)
    if class_name in _MULTI_STAGE:
        check_interleaved_rounds(num_microbatches, pp)
    import torch.distributed.pipelining as pipelining

    rank = dist.get_rank()
    pp_rank, dp_rank = rank % pp, rank // pp
    pp_group, dp_group = _groups(pp, dp, rank)
    pipe = pipeline_stages.trace(
        model, points, pipeline_stages.rows_slice(tuple(example_batch), 0, micro), None
    )
    device = _device()
    stages = [
        pipe.build_stage(pp_rank + i * pp, device, group=pp_group) for i in range(stages_per_rank)
    ]
    schedule_class = getattr(pipelining, class_name)
    runner = schedule_class(
        stages if class_name in _MULTI_STAGE else stages[0], num_microbatches, loss_fn=loss_fn
    )
    return PipelineModel(
        [stage.submod for stage in stages], runner, loss_fn=loss_fn,
        num_microbatches=num_microbatches, micro_rows=micro,
        is_first=any(stage.is_first for stage in stages),
        is_last=any(stage.is_last for stage in stages), pipeline_rank=pp_rank,
        pipeline_size=pp, data_parallel_rank=dp_rank, data_parallel_size=dp,
        data_parallel_group=dp_group,
    )  # fmt: skip


def _state() -> Any:
    from nbaccel.training.partial_state import PartialState

    return PartialState()


def _device() -> torch.device:
    return _state().device


def _groups(pp: int, dp: int, rank: int) -> tuple[Any, Any]:
    """This rank's pipeline group (ranks ``c*pp .. c*pp+pp-1``) and data-parallel group
    (ranks ``s, s+pp, ...``); every rank creates every group, as ``new_group`` requires."""
    if dp == 1:
        return dist.group.WORLD, None
    pp_group = dp_group = None
    for copy in range(dp):
        group = dist.new_group(list(range(copy * pp, copy * pp + pp)))
        if rank // pp == copy:
            pp_group = group
    for stage in range(pp):
        group = dist.new_group(list(range(stage, pp * dp, pp)))
        if rank % pp == stage:
            dp_group = group
    return pp_group, dp_group
