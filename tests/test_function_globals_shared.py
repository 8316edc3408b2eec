"""A large tensor that the launched function uses as a global (a notebook's function is pickled
by value, with its globals) crosses through the launch's shared-memory block, as arguments do,
instead of being pickled into every rank's job."""

from __future__ import annotations

import pytest
import torch

import nbaccel
from nbaccel.launch.options import LaunchOptions
from nbaccel.launch.plan import resolve_plan

SOURCE = "def uses_global():\n    return int(big.sum()), big.shape[0]\n"


def notebook_function(big: torch.Tensor):
    """A function as a notebook defines it: in ``__main__``, so pickled by value with ``big``."""
    namespace = {"__name__": "__main__", "big": big}
    exec(SOURCE, namespace)  # noqa: S102 - builds a __main__ function, as a notebook cell does
    return namespace["uses_global"]


def plan_for(function):
    return resolve_plan(function, (), {}, LaunchOptions(num_processes=1))


def test_a_large_global_is_not_pickled_into_the_job():
    big = torch.arange(4_000_000, dtype=torch.int64)  # 32 MB
    plan = plan_for(notebook_function(big))
    try:
        assert len(plan.specs[0].function) < 1_000_000, len(plan.specs[0].function)
    finally:
        from nbaccel.core import shared_tensors

        shared_tensors.release(plan.specs[0].transfer)


@pytest.mark.slow
def test_a_rank_sees_the_global_tensor_as_the_kernel_has_it():
    big = torch.arange(4_000_000, dtype=torch.int64)
    expected = (int(big.sum()), 4_000_000)
    assert nbaccel.notebook_launcher(notebook_function(big), num_processes=2) == expected
    assert int(big.sum()) == expected[0]  # the kernel's tensor is untouched
