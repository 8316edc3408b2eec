"""Background launches in a real ipykernel: ``notebook_launcher(..., block=False)``.

The launch trains while other cells run (one plots the metrics logged so far), its lines stay
in its own cell, the kernel's Stop button in another cell does not reach it, ``stop()`` and a
kernel shutdown leave nothing running (checked by pid, system-wide), and ``result()`` returns
rank 0's value or raises the launch's error.
"""

from __future__ import annotations

import textwrap
import threading
import time

import pytest

from tests.kernel_helpers import KernelSession
from tests.test_containment import running, wait_until_none_running

pytestmark = pytest.mark.slow  # a real kernel and real ranks


@pytest.fixture(scope="module")
def kernel():
    with KernelSession(
        env={"NBACCEL_VIEW": "text"}, startup="import nbaccel, os, time", background_shutdown=True
    ) as k:
        yield k


@pytest.fixture(autouse=True)
def no_launch_left_for_the_next_test(kernel):
    """A failing test stops the launches it left running: otherwise the next tests' checks
    of what runs in the shared kernel would find its ranks and fail too."""
    yield
    kernel.execute("[launch.stop() for launch in nbaccel.running()]")


def cell(code: str) -> str:
    return textwrap.dedent(code).strip()


# Each rank records its pid and a child's (with start times, as tests/test_containment.py
# reads them), then waits: what stop() and a kernel shutdown must leave nothing of.
RECORDING_TRAIN = """
    def train(directory):
        import pathlib, subprocess, psutil
        def record(pid):
            created = psutil.Process(pid).create_time()
            pathlib.Path(directory, f"{pid}.pid").write_text(repr(created))
        record(os.getpid())
        child = subprocess.Popen(["sleep", "1000"])
        record(child.pid)
        print("recorded", flush=True)
        time.sleep(1000)
"""


def _start_recording(kernel: KernelSession, directory, name: str) -> None:
    """Start ``RECORDING_TRAIN`` on 2 ranks in the background as ``name``; return once both
    ranks and their children are recorded."""
    started = kernel.execute(
        cell(RECORDING_TRAIN)
        + f"\n{name} = nbaccel.notebook_launcher(train, args=({str(directory)!r},), "
        "num_processes=2, block=False)"
    )
    assert started.error is None, started.error_text
    deadline = time.monotonic() + 60
    while len(list(directory.glob("*.pid"))) < 4:
        assert time.monotonic() < deadline, "the ranks did not record their pids"
        time.sleep(0.05)


def test_a_background_launch_trains_while_other_cells_run_then_returns_its_value(kernel):
    started = kernel.execute(
        cell("""
        def train(steps):
            rank = int(os.environ["RANK"])
            for step in range(steps):
                nbaccel.log({"loss": 1.0 / (step + 1)}, step=step)
                print(f"step {step}", flush=True)
                time.sleep(0.1)
            return 42 + rank

        launch = nbaccel.notebook_launcher(train, args=(60,), num_processes=2, block=False)
        print(type(launch).__name__, launch.done())
    """)
    )
    assert started.error is None, started.error_text
    # It returned at once, its banner (and the fork server it waits for) printed before:
    # printed from the launch's thread, they split the cell's print ("Launch" + banner).
    lines = started.stdout.splitlines()
    assert "Launch False" in lines, started.stdout
    before = lines[: lines.index("Launch False")]
    assert before[0].startswith("nbaccel: launching 2 processes"), started.stdout
    assert all(line.startswith("nbaccel: ") for line in before), started.stdout
    launch_cell = kernel.last_msg_id

    # Three other cells while it trains: plain work, the Stop button (in a wait for the result:
    # it ends the wait, not the launch), a plot of the metrics.
    other = kernel.execute("print(sum(range(10**6)), launch.done())")
    assert other.error is None and other.stdout == f"{sum(range(10**6))} False\n"
    interrupted = kernel.execute(
        "launch.result()", on_message=lambda m: m["msg_type"] == "execute_input" and _stop(kernel)
    )
    assert interrupted.error is not None and interrupted.error["ename"] == "KeyboardInterrupt"
    plotted = kernel.execute(
        cell("""
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        while len(launch.metrics()) < 3:
            time.sleep(0.05)
        so_far = launch.metrics()
        plt.plot([m["step"] for m in so_far], [m["loss"] for m in so_far])
        print(launch.status, len(so_far) < 60, launch.ranks)
    """)
    )
    assert plotted.error is None, plotted.error_text
    assert plotted.stdout == "running True {0: 'running', 1: 'running'}\n"
    for later in (other, interrupted, plotted):  # the ranks' lines are not the other cells'
        assert "[rank0] step" not in later.stdout + later.stderr

    result = kernel.execute("launch.result(timeout=120), launch.status")
    assert result.error is None, result.error_text
    assert result.results[-1]["text/plain"] == "(42, 'finished')"
    lines = kernel.messages_of(launch_cell).stdout  # in the launching cell's output
    assert "[rank0] step 0\n" in lines and "[rank1] step 59\n" in lines
    assert kernel.leftovers() == []


def _stop(kernel: KernelSession) -> None:
    time.sleep(0.5)  # the cell is in its sleep by now
    kernel.interrupt()


def test_a_failing_background_launch_raises_from_result(kernel):
    started = kernel.execute(
        cell("""
        def fails():
            time.sleep(0.5)
            if os.environ["RANK"] == "1":
                raise ValueError("rank one gives up")
            time.sleep(600)

        failing = nbaccel.notebook_launcher(fails, num_processes=2, block=False)
    """)
    )
    assert started.error is None, started.error_text
    result = kernel.execute("failing.result(timeout=120)")
    assert result.error is not None and result.error["ename"] == "RankFailedError"
    assert "rank one gives up" in result.error_text
    # It reads like a blocking launch's error: no frames of the future underneath
    assert "concurrent/futures" not in result.error_text, result.error_text
    awaited = kernel.execute("await failing")  # the same error, in an async cell
    assert awaited.error is not None and awaited.error["ename"] == "RankFailedError"
    assert "concurrent/futures" not in awaited.error_text, awaited.error_text
    again = kernel.execute("failing.result()")  # not grown by the earlier raises
    assert again.error_text.count("failing.result()") == 1, again.error_text
    future = kernel.execute(
        "import concurrent.futures\n"
        "ended = []\n"
        "failing.add_done_callback(ended.append)\n"
        "isinstance(failing, concurrent.futures.Future), ended == [failing], "
        "type(failing.exception()).__name__"
    )
    assert future.results[-1]["text/plain"] == "(True, True, 'RankFailedError')"
    status = kernel.execute("failing.status, failing.done()")
    assert status.results[-1]["text/plain"] == "('failed', True)"
    assert kernel.leftovers() == []


def test_two_background_launches_started_at_once_both_end(kernel):
    """Their rank starts take turns at the fork server's mirror: two HOLDs at once lost each
    other's answers, and one launch hung in "starting" until the mirror's silence deadline."""
    result = kernel.execute(
        cell("""
        def counts():
            for i in range(20):
                nbaccel.log({"i": i})
                time.sleep(0.05)
            return "counted"

        def gives_up():
            raise ValueError("at once")

        first = nbaccel.notebook_launcher(counts, num_processes=2, block=False)
        second = nbaccel.notebook_launcher(gives_up, num_processes=2, block=False)
        try:
            second.result(timeout=60)
        except nbaccel.RankFailedError as e:
            print("second:", e.summary)
        print("first:", first.result(timeout=60))
    """)
    )
    assert result.error is None, result.error_text
    assert "second: raised ValueError: at once" in result.stdout
    assert "first: counted" in result.stdout
    assert kernel.leftovers() == []


def test_stop_leaves_nothing_running(kernel, tmp_path):
    _start_recording(kernel, tmp_path, "running_launch")
    # A preload the server lacks would restart it under the running ranks: refused.
    refused = kernel.execute(
        "nbaccel.notebook_launcher(print, num_processes=1, preload=['colorsys'])"
    )
    assert refused.error is not None and refused.error["ename"] == "LaunchError"
    assert "needs a fresh fork server" in refused.error_text
    assert len(running(tmp_path)) == 4
    # Stop in a cell that awaits the launch ends that wait, not the launch (a wrapped future
    # woke ipykernel's loop only when the launch ended: Stop did nothing for 1000 s).
    threading.Timer(0.5, kernel.interrupt).start()
    began = time.monotonic()
    awaited = kernel.execute("await running_launch", timeout=20)
    assert time.monotonic() - began < 10
    assert awaited.error is not None and awaited.error["ename"] in (
        "CancelledError",
        "KeyboardInterrupt",
    )
    assert len(running(tmp_path)) == 4
    # Where each rank is, on demand, the launch running on
    stacks = kernel.execute("print(running_launch.stacks()[1])")
    assert stacks.error is None, stacks.error_text
    assert "Cell In[" in stacks.stdout and ", in train" in stacks.stdout, stacks.stdout
    assert len(running(tmp_path)) == 4
    stopped = kernel.execute("running_launch.stop(); running_launch.status")
    assert stopped.error is None, stopped.error_text
    assert stopped.results[-1]["text/plain"] == "'interrupted'"
    assert running(tmp_path) == []  # stop() returns once nothing is left
    result = kernel.execute("running_launch.result()")
    assert result.error is not None and result.error["ename"] == "LaunchStoppedError"
    assert "all 2 ranks were stopped" in result.error_text
    assert kernel.leftovers() == []


def test_a_launch_whose_cell_was_run_again_is_found_by_running_and_stopped(kernel, tmp_path):
    # Rerunning `launch = notebook_launcher(..., block=False)` rebinds the name: the first
    # launch trained on with no handle to stop it (or to debug a rank paused in it).
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    _start_recording(kernel, first, "launch")
    _start_recording(kernel, second, "launch")  # the same cell, run again
    assert len(running(first)) == len(running(second)) == 4
    found = kernel.execute("[l is launch for l in nbaccel.running()]")
    assert found.error is None, found.error_text
    assert found.results[-1]["text/plain"] == "[False, True]"  # oldest first
    stopped = kernel.execute("nbaccel.running()[0].stop()\nlen(nbaccel.running())")
    assert stopped.error is None, stopped.error_text
    assert stopped.results[-1]["text/plain"] == "1"
    assert running(first) == [] and len(running(second)) == 4  # by pid, system-wide
    kernel.execute("launch.stop()")
    assert running(second) == []
    assert kernel.execute("nbaccel.running()").results[-1]["text/plain"] == "[]"
    assert kernel.leftovers() == []


def test_kernel_shutdown_during_a_background_launch_leaves_nothing_running(tmp_path):
    with KernelSession(env={"NBACCEL_VIEW": "text"}, startup="import nbaccel, os, time") as k:
        _start_recording(k, tmp_path, "bg")
    assert wait_until_none_running(tmp_path, timeout=15) == []
