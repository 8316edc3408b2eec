"""Every public function and class of ``nbaccel`` shows a short example that runs.

The style asks for one on every user-facing docstring, run by pytest's ``--doctest-modules``
and asserting something; ``Example::`` blocks were never run. (Its own module: resolving every
public name imports the kernel side, and ``test_public_names``' functions are unpickled in
ranks, which must not load it.)
"""

from __future__ import annotations

import inspect

import pytest

import nbaccel

FUNCTIONS_AND_CLASSES = sorted(
    name
    for name in nbaccel.__all__
    if inspect.isfunction(getattr(nbaccel, name)) or inspect.isclass(getattr(nbaccel, name))
)


@pytest.mark.parametrize("name", FUNCTIONS_AND_CLASSES)
def test_every_public_function_and_class_has_an_example_that_runs(name):
    # The style: a short example on every user-facing docstring that runs (pytest's
    # --doctest-modules runs it) and asserts something. 'Example::' blocks were never run.
    assert ">>> " in (inspect.getdoc(getattr(nbaccel, name)) or ""), (
        f"nbaccel.{name}'s docstring has no doctest example"
    )
