"""What ``import nbaccel`` prepares in a kernel, so the first launch paints at once.

In a notebook kernel the import starts the fork server and then, in a background thread, imports
the kernel's side of a launch (launcher, views, ipywidgets): without it the first launch cell
spent 0.6-0.9 s importing them (2 loaded cores) before its view could show. Scripts and ranks
get neither.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from tests.kernel_helpers import KernelSession

LAUNCH = "def train():\n    return 1\nnbaccel.notebook_launcher(train, num_processes=2)"
WARMED = ("nbaccel.launchers", "nbaccel.ui.text", "ipywidgets", "nbaccel.ui.dashboard")
# s from the request to the view's first display once the warm-up is done: 0.03-0.08 s measured
# (load average 4); 0.13-0.64 s before the warm-up imported the kernel side.
FIRST_PAINT = 0.2


@pytest.mark.slow
def test_the_kernel_side_is_imported_after_import_and_the_first_launch_paints_at_once():
    with KernelSession(env={"NBACCEL_VIEW": "widgets"}, background_shutdown=True) as kernel:
        assert kernel.execute("import nbaccel").error is None
        cell = kernel.execute(
            "import sys, time\n"
            f"_want = {WARMED!r}\n"
            "_end = time.monotonic() + 30\n"
            "while time.monotonic() < _end and not all(m in sys.modules for m in _want):\n"
            "    time.sleep(0.05)\n"
            "print([m for m in _want if m not in sys.modules])"
        )
        assert cell.stdout.strip() == "[]", f"not imported by the warm-up: {cell.stdout}"
        sent = time.monotonic()
        cell = kernel.execute(LAUNCH)
        assert cell.error is None, cell.error_text
        shown = cell.of_type("display_data")
        assert shown, "the launch never showed its view"
        waited = shown[0]["received_at"] - sent
        assert waited < FIRST_PAINT, f"the first display came {waited:.2f} s after the request"


def test_a_script_imports_none_of_the_kernel_side():
    code = (
        "import sys, time, nbaccel; time.sleep(0.2)\n"
        f"print([m for m in {WARMED!r} if m in sys.modules])"
    )
    env = {k: v for k, v in os.environ.items() if k != "NBACCEL_NO_WARMUP"}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", f"a script imported the kernel side: {done.stdout}"
