"""A kernel that launched ranks shuts down by itself, and takes nbaccel's helpers with it.

ipykernel's shutdown stops the kernel's children with SIGTERM, retried until they are gone;
multiprocessing's resource tracker (started beside the fork server) ignores SIGTERM and waits
for its pipe, whose end the kernel held: the kernel never finished its shutdown, and
jupyter_client terminated it 2.5 s later (exit status -15), so no exit hook of the kernel's ran.
"""

from __future__ import annotations

import time

import psutil
import pytest

from tests.kernel_helpers import KernelSession

pytestmark = pytest.mark.slow  # a real kernel and real ranks


def _alive(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            continue
    return alive


def test_a_kernel_that_launched_exits_by_itself_and_leaves_no_helper_running():
    session = KernelSession(env={"NBACCEL_VIEW": "text"}, startup="import nbaccel")
    with session as kernel:
        cell = kernel.execute(
            "nbaccel.notebook_launcher(print, args=('hi',), num_processes=2)\n"
            "import nbaccel.forkserver.server as _s\n"
            "print(sorted(_s.SERVER.helper_pids()))"
        )
        assert cell.error is None, cell.error_text
        helpers = eval(cell.stdout.strip().splitlines()[-1])  # a list of ints the kernel printed
        assert len(helpers) == 2  # the fork server and the resource tracker
        process = kernel.manager.provisioner.process
    assert process.returncode == 0  # it ended itself: not terminated by jupyter_client (-15)
    # The fork server ends as the kernel's end of its pipe closes, just after the kernel
    deadline = time.monotonic() + 10
    while _alive(helpers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _alive(helpers) == []
