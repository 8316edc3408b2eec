"""Bad input to notebook_launcher, as a notebook shows it: one clear message naming the
argument, not pages of nbaccel's validation frames (real kernel, IPython's own traceback)."""

from __future__ import annotations

import re

import pytest

from tests.kernel_helpers import KernelSession

pytestmark = pytest.mark.slow  # a real kernel


@pytest.fixture(scope="module")
def kernel():
    with KernelSession(env={"NBACCEL_VIEW": "text"}) as k:
        k.execute("import threading, nbaccel\ndef f(*a, **k):\n    return 1")
        yield k


def nbaccel_frames(text: str) -> list[str]:
    """Frames of nbaccel's own files in a traceback as IPython prints it."""
    return re.findall(r"File [^\n]*nbaccel/[\w/]+\.py", text)


@pytest.mark.parametrize(
    ("call", "ename", "says"),
    [
        (
            "nbaccel.notebook_launcher(f, args=(threading.Lock(),), num_processes=1)",
            "TypeError",
            r"args\[0\] \(lock\) cannot be sent to the ranks: TypeError: cannot pickle",
        ),
        (
            "nbaccel.notebook_launcher(f, kwargs=[1], num_processes=1)",
            "TypeError",
            r"kwargs must be a dict of keyword arguments",
        ),
        (
            'nbaccel.notebook_launcher(f, num_processes=1, master_addr="no.such.host.invalid")',
            "ValueError",
            r"master_addr='no.such.host.invalid' cannot be used",
        ),
        (
            'nbaccel.notebook_launcher(f, num_processes=1, mixed_precision="fp4")',
            "ConfigError",
            r"'fp4'",
        ),
    ],
)
def test_input_errors_show_no_nbaccel_frames(kernel, call, ename, says):
    cell = kernel.execute(call)
    assert cell.error is not None and cell.error["ename"] == ename, cell.error_text
    text = cell.error_text
    assert re.search(says, text), text
    # IPython never hides the innermost frame: one short nbaccel frame (the re-raise) remains.
    assert len(nbaccel_frames(text)) <= 1, text
    assert "During handling" not in text and "direct cause" not in text, text
    assert len(text.splitlines()) < 15, text
