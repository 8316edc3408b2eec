"""Bad input to notebook_launcher, as a notebook shows it: one clear message naming the
argument, not pages of nbaccel's validation frames (real kernel, IPython's own traceback)."""

from __future__ import annotations

import re
import threading

import pytest

from tests.kernel_helpers import KernelSession

pytestmark = pytest.mark.slow  # a real kernel


@pytest.fixture(scope="module")
def kernel():
    with KernelSession(env={"NBACCEL_VIEW": "text"}, background_shutdown=True) as k:
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


def test_stop_while_ranks_start_shows_no_nbaccel_source(tmp_path):
    # The fork server imports a slow preload module, so the launch is still starting ranks
    # (waiting for the server) when the user presses Stop.
    (tmp_path / "nbaccel_slow_preload.py").write_text("import time\ntime.sleep(8)\n")
    with KernelSession(
        env={"NBACCEL_VIEW": "text", "PYTHONPATH": str(tmp_path)}, background_shutdown=True
    ) as k:
        timers = []

        def stop_soon(msg):
            if msg["msg_type"] == "stream" and "go" in msg["content"]["text"] and not timers:
                timers.append(threading.Timer(2.0, k.interrupt))
                timers[0].start()

        cell = k.execute(
            "import nbaccel\n"
            "def f():\n    return 1\n"
            "print('go', flush=True)\n"
            "nbaccel.notebook_launcher(f, num_processes=1, preload=('nbaccel_slow_preload',))",
            on_message=stop_soon,
        )
    assert cell.error is not None and cell.error["ename"] == "KeyboardInterrupt", cell.error_text
    text = cell.error_text
    assert "launch interrupted" in text, text
    assert "group.py" not in text and len(nbaccel_frames(text)) <= 1, text
