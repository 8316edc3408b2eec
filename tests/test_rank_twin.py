"""A rank starts as the kernel's twin: tested in a real ipykernel, as a notebook user meets it.

sys.path and the working directory are the kernel's at the launch, torch's and numpy's global
RNG states too (what a fork of the kernel gives), Python's ``random`` is fresh per process,
multiprocessing's default start method is the platform's own (so DataLoader workers fork from
the rank and a Dataset class and a lambda defined in a cell just work), and ``env={"X": None}``
removes X.
"""

from __future__ import annotations

import multiprocessing
import textwrap

import pytest

from tests.kernel_helpers import KernelSession

pytestmark = pytest.mark.slow  # a real kernel


@pytest.fixture(scope="module")
def kernel():
    with KernelSession(
        env={"NBACCEL_VIEW": "text"}, startup="import nbaccel, os, sys", background_shutdown=True
    ) as k:
        yield k


@pytest.fixture(autouse=True)
def nothing_left_in_kernel(kernel):
    yield
    assert kernel.leftovers() == [], "the kernel still has rank processes"


def run(kernel, code: str):
    result = kernel.execute(textwrap.dedent(code).strip())
    assert result.error is None, result.error_text
    return eval(result.results[-1]["text/plain"])  # the cell's value, printed by the kernel


def test_dataloader_workers_fork_from_the_rank_with_cell_defined_dataset_and_lambda(kernel):
    value = run(
        kernel,
        """
        import torch
        from torch.utils.data import DataLoader, Dataset

        class Sq(Dataset):
            def __len__(self):
                return 6
            def __getitem__(self, i):
                return torch.tensor([i * i])

        def train():
            import multiprocessing
            loader = DataLoader(Sq(), batch_size=2, num_workers=2,
                                collate_fn=lambda b: torch.stack(b))
            total = sum(int(batch.sum()) for batch in loader)
            return multiprocessing.get_start_method(), total

        nbaccel.notebook_launcher(train, num_processes=2, return_all=True)
        """,
    )
    platform_default = multiprocessing.get_context()._name  # a fresh interpreter's here
    assert value == [(platform_default, 55)] * 2


def test_module_imported_after_chdir_and_the_working_directory(kernel, tmp_path):
    (tmp_path / "twin_helper_mod.py").write_text("ANSWER = 42\n")
    value = run(
        kernel,
        f"""
        os.chdir({str(tmp_path)!r})
        import twin_helper_mod

        def train():
            import twin_helper_mod
            return twin_helper_mod.ANSWER, os.getcwd()

        nbaccel.notebook_launcher(train, num_processes=2, return_all=True)
        """,
    )
    assert value == [(42, str(tmp_path))] * 2


def test_rng_states_are_the_kernels_and_random_is_fresh_per_process(kernel):
    """What a fork of the kernel gives: the same torch and numpy draws as the kernel makes next,
    on every rank; a numpy stream that moves on when the kernel's does; ``random`` differs."""
    value = run(
        kernel,
        """
        import random, numpy as np, torch
        torch.manual_seed(1234)
        np.random.seed(99)

        def train():
            import random, numpy as np, torch
            return torch.rand(1).item(), float(np.random.rand()), random.random()

        ranks = nbaccel.notebook_launcher(train, num_processes=2, return_all=True)
        kernel_next = (torch.rand(1).item(), float(np.random.rand()))
        again = nbaccel.notebook_launcher(train, num_processes=2, return_all=True)
        (ranks, kernel_next, again)
        """,
    )
    ranks, kernel_next, again = value
    assert [r[:2] for r in ranks] == [kernel_next, kernel_next]
    assert ranks[0][2] != ranks[1][2]  # Python's random is per process
    # The kernel's streams moved on (it drew once), so the next launch starts from there.
    assert again[0][:2] != ranks[0][:2] and again[0][:2] == again[1][:2]
    assert again[0][2] not in (ranks[0][2], ranks[1][2])


def test_env_none_removes_a_variable_and_values_are_set(kernel):
    value = run(
        kernel,
        """
        os.environ["TWIN_B"] = "from-kernel"
        def train():
            return os.environ.get("TWIN_B", "<unset>"), os.environ.get("TWIN_C")

        nbaccel.notebook_launcher(train, num_processes=2, return_all=True,
                                  env={"TWIN_B": None, "TWIN_C": "3"})
        """,
    )
    assert value == [("<unset>", "3")] * 2


def test_a_cells_functions_have_the_ranks_main_as_their_globals(kernel):
    """As in the kernel (and in a fork of it), a cell's function runs in ``__main__``: code in
    the rank that pickles it again by reference finds it there (plain pickle; dill, under
    ``datasets``' ``map(num_proc=2)``, else pickles every module the cell imported by value)."""
    value = run(
        kernel,
        """
        import pickle

        def double(v):
            return 2 * v

        def train():
            import sys
            main = sys.modules["__main__"]
            again = pickle.loads(pickle.dumps(double))  # by reference: __main__.double
            return globals() is vars(main), again is double, again(21)

        nbaccel.notebook_launcher(train, num_processes=2, return_all=True)
        """,
    )
    assert value == [(True, True, 42)] * 2


def test_a_function_pushed_to_persistent_ranks_sees_the_names_their_cells_assign(kernel):
    value = run(
        kernel,
        """
        def scaled(v):
            return v * scale   # `scale` exists only on the ranks

        twins = nbaccel.Ranks(num_processes=2, progress=False)
        try:
            twins.push(scaled=scaled)
            out = twins.run("scale = accelerator.process_index + 2\\nscaled(10)")
        finally:
            twins.stop()
        out
        """,
    )
    assert value == [20, 30]
