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
from typing import Any

import torch

from nbaccel.training import ops


class ProcessControl:
    """Mixed into :class:`nbaccel.Accelerator`; relies on its ``state`` and gradient state."""

    # -- collectives ----------------------------------------------------------------------

    gather = staticmethod(ops.gather)
    gather_object = staticmethod(ops.gather_object)
    pad_across_processes = staticmethod(ops.pad_across_processes)

    def reduce(self, tensor: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
        """Sum (default) or average tensors over the ranks.

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

    def gather_for_metrics(self, input_data: Any) -> Any:
        """Gather, then drop samples that were duplicated to even out the last batch, so metrics
        over N ranks equal metrics over the whole dataset.

        Example::

            for x, y in eval_loader:
                predictions = accelerator.gather_for_metrics(model(x).argmax(1))
                labels = accelerator.gather_for_metrics(y)
        """
        tensors = []
        ops.recursively_apply(tensors.append, input_data)
        gathered = ops.gather(input_data) if tensors else ops.gather_object(input_data)
        keep = self._gs.remainder if self._gs.at_loader_end else None
        if keep is None:
            return gathered
        if not tensors:
            return gathered[:keep]
        return ops.recursively_apply(lambda t: t[:keep], gathered)

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

    def on_main_process(self, function: Callable[..., Any]) -> Callable[..., Any]:
        """Decorator: the function only runs on the main process (returns None elsewhere).

        Example::

            @accelerator.on_main_process
            def report(metrics): print(metrics)
        """

        @functools.wraps(function)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            return function(*args, **kwargs) if self.is_main_process else None

        return wrapper

    @contextlib.contextmanager
    def split_between_processes(self, inputs: Any, apply_padding: bool = False) -> Iterator[Any]:
        """Yield this rank's contiguous share of a list/tuple/tensor/dict of equal-length values.

        Shares differ by at most one item; ``apply_padding`` repeats the last item so every
        rank gets as many (then gather and cut to the input's length).

        Example::

            with accelerator.split_between_processes(prompts) as mine:
                outputs = [generate(p) for p in mine]
        """
        yield _split(inputs, self.num_processes, self.process_index, apply_padding)

    def end_training(self) -> None:
        """Wait for every rank at the end of training.

        Example::

            accelerator.end_training()
        """
        ops.barrier()


def _split(inputs: Any, world: int, rank: int, pad: bool) -> Any:
    if isinstance(inputs, dict):
        return {k: _split(v, world, rank, pad) for k, v in inputs.items()}
    n = len(inputs)
    base, extra = divmod(n, world)
    start = rank * base + min(rank, extra)
    part = inputs[start : start + base + (1 if rank < extra else 0)]
    if pad and extra and rank >= extra and n:
        last = inputs[-1:]
        part = torch.cat([part, last]) if isinstance(part, torch.Tensor) else part + last
    return part
