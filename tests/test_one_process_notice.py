"""num_processes=1 runs the function in a worker (the kernel never touches CUDA), where
Accelerate's launcher calls it in the kernel: a function that fills a notebook list in place is
told, before anything starts, that the change stays in the worker (issue 33)."""

from __future__ import annotations

import warnings

import pytest

from nbaccel.launch.options import LaunchOptions
from nbaccel.launch.plan import resolve_plan

results: list[float] = []
history: dict[str, float] = {}


def fills_the_notebooks_list():
    results.append(0.5)  # Accelerate's distributed-inference tutorial collects results so


def stores_into_the_notebooks_dict(key):
    history[key] = 1.0


def returns_its_values():
    return list(results)


def _plan(function, args=(), processes=1):
    return resolve_plan(function, args, {}, LaunchOptions(num_processes=processes, cpu=True))


def test_a_one_process_launch_that_fills_a_notebook_list_says_where_the_change_stays():
    with pytest.warns(UserWarning) as caught:
        _plan(fills_the_notebooks_list)
    (message,) = [str(w.message) for w in caught]
    assert "fills_the_notebooks_list changes `results` in place" in message
    assert "worker process" in message and "Return the values instead" in message


def test_an_item_assignment_counts_too():
    with pytest.warns(UserWarning, match="`history` in place"):
        _plan(stores_into_the_notebooks_dict, ("loss",))


@pytest.mark.parametrize(
    ("function", "processes"),
    [(returns_its_values, 1), (fills_the_notebooks_list, 2)],
    ids=["reads-only", "two-ranks"],
)
def test_nothing_is_said_where_nothing_would_be_lost(function, processes):
    # Two ranks never ran in the kernel under any launcher: a list filled there is the user's
    # known multi-process pattern, not a surprise of nbaccel's.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _plan(function, processes=processes)


def test_the_notices_name_the_callers_line_not_nbaccels():
    # Warned from deep inside notebook_launcher: a fixed stacklevel named nbaccel's own
    # launcher.py line ("plan = resolve_plan(...)") under the notice, in the cell's output.
    import nbaccel

    with pytest.warns(UserWarning) as caught:
        nbaccel.notebook_launcher(fills_the_notebooks_list, progress=False)
    assert {w.filename for w in caught} == {__file__}
    assert any("no GPU is visible" in str(w.message) for w in caught)
