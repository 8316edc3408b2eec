"""The Accelerator's collectives and process control: the methods that talk across ranks.

Kept apart from the training-step machinery in ``accelerator.py``; every method works unchanged
in a single process (no process group), where collectives return their input.
"""

from __future__ import annotations

import builtins
import contextlib
import functools
import sys
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from nbaccel.training import ops
from nbaccel.training.accumulation import GradientState

if TYPE_CHECKING:
    from nbaccel.training.distributed import DistributedType


class ProcessFacts:
    """What the process-control methods read: the facts of this rank. ``PartialState`` and the
    ``Accelerator`` both provide them."""

    _gs: GradientState  # the accumulation state; PartialState has one of its own
    flag_tensor: torch.Tensor | None  # set_trigger/check_trigger

    def _data_parallel_ranks(self) -> list[int] | None:
        """The ranks whose gathered samples count (None: all); an Accelerator with a
        tensor-parallel mesh counts one rank per group (``accelerator.mesh``)."""
        return None

    if TYPE_CHECKING:

        @property
        def state(self) -> ProcessFacts: ...
        @property
        def distributed(self) -> bool: ...
        @property
        def distributed_type(self) -> DistributedType: ...
        @property
        def device(self) -> torch.device: ...
        @property
        def process_index(self) -> int: ...
        @property
        def local_process_index(self) -> int: ...
        @property
        def num_processes(self) -> int: ...
        @property
        def is_main_process(self) -> bool: ...
        @property
        def is_local_main_process(self) -> bool: ...


class ProcessControl(ProcessFacts):
    """Mixed into :class:`nbaccel.Accelerator`; relies on its ``state`` and gradient state."""

    # -- collectives ----------------------------------------------------------------------

    def gather(self, tensor: Any) -> Any:
        """Concatenate every rank's tensors along the first dimension (on every rank).

        Example::

            preds = accelerator.gather(logits.argmax(-1))    # shape [world * batch]
        """
        return ops.gather(tensor)

    gather_object = staticmethod(ops.gather_object)

    def pad_across_processes(
        self, tensor: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False
    ) -> Any:
        """Pad tensors along ``dim`` to the largest size over the ranks, so they can be gathered.

        Example::

            tokens = accelerator.pad_across_processes(tokens, dim=1, pad_index=pad_id)
        """
        return ops.pad_across_processes(tensor, dim, pad_index, pad_first)

    def reduce(self, tensor: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
        """Sum (default), average ("mean") or maximum ("max") of tensors over the ranks.

        Example::

            mean_loss = accelerator.reduce(loss.detach(), "mean")
        """
        return ops.reduce(tensor, reduction, scale)

    def broadcast(self, tensor: Any, from_process: int = 0) -> Any:
        """Every rank gets ``from_process``'s tensors.

        Example::

            seed = accelerator.broadcast(torch.randint(0, 2**31, (1,)))   # rank 0's draw
        """
        return ops.broadcast(tensor, from_process)

    def gather_for_metrics(self, input_data: Any, use_gather_object: bool = False) -> Any:
        """Gather, then drop samples that were duplicated to even out the last batch, so metrics
        over N ranks equal metrics over the whole dataset. ``use_gather_object=True`` (or data
        that is not all tensors) gathers picklable objects into one list, as ``gather_object``
        does.

        Example::

            for x, y in eval_loader:
                predictions = accelerator.gather_for_metrics(model(x).argmax(1))
                labels = accelerator.gather_for_metrics(y)
        """
        try:  # Accelerate's test: tensors only, in nested lists, tuples and dicts
            ops.recursively_apply(lambda t: t, input_data, error_on_other_type=True)
            as_objects = use_gather_object
        except TypeError:
            as_objects = True
        # With tensor parallelism the ranks of a group hold the same samples: count them once.
        counted = self._data_parallel_ranks()
        if counted is None:
            gathered = ops.gather_object(input_data) if as_objects else ops.gather(input_data)
        elif as_objects:
            gathered = ops.gather_object(input_data if self.process_index in counted else [])
        else:
            world = self.num_processes
            gathered = ops.recursively_apply(
                lambda t: torch.cat([t.chunk(world)[i] for i in counted]), ops.gather(input_data)
            )
        keep = self._gs.remainder if self._gs.end_of_dataloader else -1
        if keep <= 0:  # not the last step, or nothing padded (Accelerate's -1, 0)
            return gathered
        try:
            if as_objects:
                return gathered[:keep]
            return ops.recursively_apply(lambda t: t[:keep], gathered)
        except Exception:  # what cannot be cut comes back whole, as in Accelerate
            return gathered

    def set_trigger(self) -> None:
        """Raise a flag on this rank that :meth:`check_trigger` sees on every rank (e.g. to
        stop early when one rank's loss turns NaN).

        Example::

            if torch.isnan(loss):
                accelerator.set_trigger()
            if accelerator.check_trigger():
                break
        """
        self.flag_tensor = torch.tensor(1, device=self.device)

    def check_trigger(self) -> bool:
        """True on every rank if any rank called :meth:`set_trigger` since the last check
        (a collective: call it on every rank); the flag is then lowered.

        Example::

            if accelerator.check_trigger():
                break
        """
        flag = getattr(self, "flag_tensor", None)
        if flag is None:
            flag = torch.tensor(0, device=self.device)
        if ops.reduce(flag, "sum").item() >= 1:
            self.flag_tensor = torch.tensor(0, device=self.device)
            return True
        return False

    # -- process control ------------------------------------------------------------------

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on the main process only, through ``sys.stdout``.

        Example::

            accelerator.print(f"epoch {epoch}: loss {loss.item():.3f}")   # once, not N times
        """
        if self.is_main_process:
            kwargs.setdefault("file", sys.stdout)
            builtins.print(*args, **kwargs)

    def wait_for_everyone(self) -> None:
        """Block until every rank reaches this line.

        Example::

            accelerator.wait_for_everyone()   # e.g. before rank 0 reads files others wrote
        """
        ops.barrier()

    @contextlib.contextmanager
    def main_process_first(self) -> Iterator[None]:
        """Run the block on the main process first (e.g. to download), then on the others.

        Example::

            with accelerator.main_process_first():
                dataset = build_or_load_cache("data/")
        """
        if not self.is_main_process:
            ops.barrier()
        yield
        if self.is_main_process:
            ops.barrier()

    @contextlib.contextmanager
    def local_main_process_first(self) -> Iterator[None]:
        """Run the block on each machine's first process first, then on the machine's others.

        Example::

            with accelerator.local_main_process_first():
                dataset = load_or_build_cache("/local/scratch")
        """
        if not self.is_local_main_process:
            ops.barrier()
        yield
        if self.is_local_main_process:
            ops.barrier()

    def on_process(
        self, function: Callable[..., Any] | None = None, process_index: int | None = None
    ) -> Any:
        """Decorator: the function only runs on process ``process_index`` (None elsewhere).

        Example::

            @accelerator.on_process(process_index=1)
            def report(metrics): print(metrics)
        """
        if function is None:
            return functools.partial(self.on_process, process_index=process_index)
        return _only_if(function, lambda: self.process_index == process_index)

    def on_local_process(
        self, function: Callable[..., Any] | None = None, local_process_index: int | None = None
    ) -> Any:
        """Decorator: runs only on local process ``local_process_index`` of each machine.

        Example::

            @accelerator.on_local_process(local_process_index=0)
            def unpack(): ...
        """
        if function is None:
            return functools.partial(self.on_local_process, local_process_index=local_process_index)
        return _only_if(function, lambda: self.local_process_index == local_process_index)

    def on_main_process(self, function: Callable[..., Any] | None = None) -> Any:
        """Decorator: the function only runs on the main process (returns None elsewhere).

        Example::

            @accelerator.on_main_process
            def report(metrics): print(metrics)
        """
        return _only_if(function, lambda: self.is_main_process)

    def on_local_main_process(self, function: Callable[..., Any] | None = None) -> Any:
        """Decorator: runs only on the first process of each machine.

        Example::

            @accelerator.on_local_main_process
            def download(): ...
        """
        return _only_if(function, lambda: self.is_local_main_process)

    def on_last_process(self, function: Callable[..., Any]) -> Any:
        """Decorator: runs only on the last process (``num_processes - 1``).

        Example::

            @accelerator.on_last_process
            def report(metrics): print(metrics)
        """
        return _only_if(function, lambda: self.process_index == self.num_processes - 1)

    @contextlib.contextmanager
    def split_between_processes(self, inputs: Any, apply_padding: bool = False) -> Iterator[Any]:
        """Yield this rank's contiguous share of a list/tuple/tensor/dict of equal-length values
        (or of a Hugging Face ``datasets.Dataset``, as a smaller Dataset), as Accelerate does:
        a dict is cut in place, and one process gets ``inputs`` itself.

        Shares differ by at most one item; ``apply_padding`` repeats the last item so every
        rank gets as many (then gather and cut to the input's length).

        Example::

            with accelerator.split_between_processes(prompts) as mine:
                outputs = [generate(p) for p in mine]
        """
        yield _split(inputs, self.num_processes, self.process_index, apply_padding)


def _only_if(function: Callable[..., Any] | None, allowed: Callable[[], bool]) -> Any:
    if function is None:
        raise ValueError(
            "this decorator needs a function: write @accelerator.on_main_process above a def "
            "(on_process/on_local_process take process_index=... first)."
        )

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return function(*args, **kwargs) if allowed() else None

    return wrapper


def _split(inputs: Any, world: int, rank: int, pad: bool) -> Any:
    """Rank ``rank``'s share of ``inputs``, cut as Accelerate cuts it: one process keeps the
    object itself; a dict is cut value by value in place (and is what comes back), by the
    length of its first value; values that are not lists, tuples, tensors, dicts or datasets
    (a string, a number) stay whole."""
    if world == 1:
        return inputs
    length = len(inputs)
    if isinstance(inputs, dict) and inputs:
        length = len(next(iter(inputs.values())))
        if not all(len(v) == length for v in inputs.values()):
            raise ValueError("All values in the dictionary must have the same length")
    base, extra = divmod(length, world)
    start = rank * base + min(rank, extra)
    stop = start + base + (1 if rank < extra else 0)
    return _cut(inputs, start, stop, base + (1 if extra else 0) if pad else 0)


def _cut(value: Any, start: int, stop: int, size: int) -> Any:
    """``value[start:stop]`` padded with its last item to ``size`` items (0: no padding)."""
    if isinstance(value, dict):
        for key in value:
            value[key] = _cut(value[key], start, stop, size)
        return value
    if hasattr(value, "select") and hasattr(value, "column_names"):
        # A Hugging Face datasets.Dataset: slicing gives a dict of columns, select() a Dataset.
        n = len(value)
        chosen = list(range(min(start, n), min(stop, n)))
        return value.select(chosen + [n - 1] * max(0, size - len(chosen)) if n else chosen)
    if isinstance(value, torch.Tensor):
        part = value[start:stop]
        missing = size - len(part)
        if missing > 0 and len(value):
            return torch.cat([part, value[-1:].expand(missing, *value.shape[1:])])
        return part
    if not isinstance(value, (list, tuple)):
        return value
    items: Any = value[start:stop]  # a list or a tuple, as given
    missing = size - len(items)
    return items + value[-1:] * missing if missing > 0 and value else items
