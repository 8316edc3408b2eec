"""``nbaccel.Ranks``, the Python API under ``%ranks``: real ranks, real gloo, no kernel.

The kernel-level promises (magics, interrupt, auto mode) are in ``test_ranks_magics.py``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest

import nbaccel
from nbaccel.launch.options import LaunchOptions
from nbaccel.persistent.cell import CellError, RanksBrokenError
from nbaccel.persistent.serve import run_code
from nbaccel.persistent.start import session_plan


def _gone(pids: list[int], timeout: float = 15) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie" for p in pids):
            return True
        time.sleep(0.1)
    return False


@pytest.fixture
def ranks():
    # One session per test: ranks alive after a test would fail the leftover-process check.
    r = nbaccel.Ranks(num_processes=2, progress=False)
    pids = r.pids
    try:
        yield r
    finally:
        r.stop()
    assert _gone(pids, timeout=5)


def test_run_code_returns_the_final_expression():
    namespace: dict = {}
    assert run_code("a = 2\na * 21", namespace, "<cell>") == 42
    assert run_code("b = a", namespace, "<cell>") is None
    assert namespace["b"] == 2


@pytest.mark.slow
def test_run_keeps_each_ranks_namespace(ranks):
    assert ranks.run("x = accelerator.process_index + 1\nx") == [1, 2]
    assert ranks.run("x * 10") == [10, 20]
    assert ranks.run("x", values=False) == ["1", "2"]
    assert ranks.run("x", ranks=[1]) == [2]
    assert ranks.run("accelerator.num_processes, dist.get_backend()") == [(2, "gloo")] * 2
    # A persistent rank is a rank: the kernel side (launch, views, IPython) never loads there.
    kernel_side = ("nbaccel.launch", "nbaccel.ui", "IPython", "ipywidgets", "ipykernel")
    loaded = ranks.run(f"import sys\n[m for m in sys.modules if m.startswith({kernel_side!r})]")
    assert loaded == [[], []]


@pytest.mark.slow
def test_call_pull_push(ranks):
    assert ranks.call(lambda a, b: a + b, 1, 2) == [3, 3]
    ranks.push(weights=[1.0, 2.0])
    assert ranks.run("t = torch.tensor(weights) * accelerator.process_index\nNone") == [None] * 2
    pulled = ranks.pull("t")
    assert [p.tolist() for p in pulled] == [[0.0, 0.0], [1.0, 2.0]]
    assert ranks.names["t"] == "Tensor" and ranks.names["weights"] == "list"
    with pytest.raises(CellError, match="name 'nope' is not defined"):
        ranks.pull("nope")
    # A pulled model is a copy: the rank's own model stays where it was (and stays trainable).
    ranks.run("net = torch.nn.Linear(2, 1)\nnet.weight.data.fill_(1.0)\nNone")
    first, _ = ranks.pull("net")
    first.weight.data.fill_(5.0)
    assert ranks.run("net.weight.sum().item()") == [2.0, 2.0]
    # A final value that cannot be pickled still shows; run() gives its repr.
    assert ranks.run("(i for i in range(3))")[0].startswith("<generator object <genexpr>")


@pytest.mark.slow
def test_an_error_names_the_rank_and_keeps_the_state(ranks):
    ranks.run("kept = 5")
    with pytest.raises(CellError) as info:
        ranks.run("if accelerator.process_index == 1:\n    1 / 0")
    assert info.value.rank == 1 and "ZeroDivisionError" in str(info.value)
    assert isinstance(info.value.original, ZeroDivisionError)
    assert "1 / 0" in info.value.remote_traceback
    assert ranks.run("kept") == [5, 5]
    with pytest.raises(RuntimeError, match="already running"):
        ranks.start()


@pytest.mark.slow
def test_killed_rank_breaks_the_group_and_stop_leaves_nothing():
    ranks = nbaccel.Ranks(num_processes=2, mixed_precision="bf16", progress=False)
    pids = ranks.pids
    try:
        assert ranks.run("import time\naccelerator.mixed_precision") == ["bf16", "bf16"]
        os.kill(pids[1], signal.SIGKILL)
        with pytest.raises(RanksBrokenError, match="rank 1 was killed by signal SIGKILL"):
            ranks.run("time.sleep(20)")
        assert _gone(pids)
        with pytest.raises(RanksBrokenError, match="%ranks start"):
            ranks.run("1")
        ranks.start()  # a broken session starts again with the same settings
        assert ranks.run("accelerator.process_index") == [0, 1]
        pids = ranks.pids
    finally:
        ranks.stop()
    assert _gone(pids, timeout=5)
    assert not ranks.started and ranks.status().rows[0]["state"] == "not running"


def test_gpus_map_ranks_to_the_listed_devices_in_the_plan():
    plan = session_plan(LaunchOptions(strategy="ddp"), [2, 3], "/tmp/nbaccel-test-socket")
    assert [s.rank for s in plan.specs] == [0, 1]
    assert all(s.env["CUDA_VISIBLE_DEVICES"] == "2,3" for s in plan.specs)
    assert plan.info.strategy == "ddp"


def test_bad_timeout_is_refused_before_anything_starts():
    with pytest.raises(ValueError, match="timeout must be a positive number"):
        nbaccel.Ranks(num_processes=2, timeout=-1)


def _interrupt_once_ranks_exist(parent: int, stop: threading.Event, seen: list[int]) -> None:
    """Send this process SIGINT as soon as its rank processes exist (while start() runs)."""
    while not stop.is_set():
        ranks = [p.pid for p in psutil.Process(parent).children(recursive=True) if _is_rank(p)]
        if ranks:
            seen.extend(ranks)
            os.kill(parent, signal.SIGINT)
            return
        time.sleep(0.005)


def _is_rank(process: psutil.Process) -> bool:
    """A child that came and went (a zombie helper has no command line) is no rank: the
    watcher's thread died of psutil.ZombieProcess, never pressed Ctrl-C, and the test failed
    with 'DID NOT RAISE' (twice in 20 runs on this machine)."""
    try:
        return "nbaccel rank" in " ".join(process.cmdline())
    except psutil.Error:
        return False


@pytest.mark.parametrize("delay", [0.0, 0.05])
def test_interrupting_start_stops_the_ranks_and_says_so(delay):
    stop, seen = threading.Event(), []
    watcher = threading.Thread(
        target=lambda: (time.sleep(delay), _interrupt_once_ranks_exist(os.getpid(), stop, seen))
    )
    watcher.start()
    try:
        # An interrupt inside the setup's init_process_group leaves it half-done on one rank
        # (RanksBrokenError says so); anywhere else the start says it was interrupted. Either
        # way the message is true: the ranks were stopped, none lives on.
        with pytest.raises((KeyboardInterrupt, RanksBrokenError)) as raised:
            nbaccel.Ranks(num_processes=2, progress=False)
    finally:
        stop.set()
        watcher.join()
    text = str(raised.value)
    assert "stopped" in text and "alive" not in text, text
    assert seen and _gone(seen, timeout=5)


def test_a_script_that_used_ranks_exits_without_a_finaliser_error(tmp_path):
    # The garbage collector finalised a stopped session at interpreter exit, after the modules
    # were cleared, and printed "Exception ignored in: <function Ranks.__del__ ...>".
    script = tmp_path / "uses_ranks.py"
    script.write_text(
        "import nbaccel\n"
        "with nbaccel.Ranks(num_processes=2, progress=False) as ranks:\n"
        "    ranks.run('x = torch.ones(2) * (accelerator.process_index + 1)')\n"
        "    print(ranks.run('dist.all_reduce(x); x'))\n"
    )
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith("[tensor([3., 3.]), tensor([3., 3.])]"), done.stdout
    assert "Exception ignored" not in done.stderr, done.stderr
