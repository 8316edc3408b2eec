"""A launch owns every process it causes: checked by pid, system-wide, from a plain process.

Ranks start subprocesses, multiprocessing children and DataLoader workers and record their pids
(with start times, so a reused pid is never mistaken for one of them); afterwards none of them
may be running anywhere on the machine, whoever they were re-parented to. Also here: root cause
first when a rank's peer left a collective, and an unpicklable return value named as such.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import psutil
import pytest

import nbaccel
from nbaccel import RankFailedError
from nbaccel.core.containment import LeftoverProcessesWarning

pytestmark = pytest.mark.slow  # real ranks


def record(directory: str, pid: int) -> None:
    """Write ``pid`` and its start time where the test will look for it."""
    created = psutil.Process(pid).create_time()
    # Written whole or not at all: a process stopped mid-write leaves no empty .pid file.
    partial = Path(directory, f"{pid}.partial")
    partial.write_text(repr(created))
    partial.replace(Path(directory, f"{pid}.pid"))


def running(directory: Path) -> list[tuple[int, str]]:
    """The recorded processes that still run (same pid and start time), anywhere."""
    alive = []
    for f in directory.glob("*.pid"):
        pid, created = int(f.stem), float(f.read_text())
        try:
            p = psutil.Process(pid)
            if abs(p.create_time() - created) < 0.01 and p.status() != psutil.STATUS_ZOMBIE:
                alive.append((pid, " ".join(p.cmdline())))
        except psutil.NoSuchProcess:
            pass
    return alive


def wait_until_none_running(directory: Path, timeout: float = 5.0) -> list[tuple[int, str]]:
    """What still runs after ``timeout`` seconds; killed, so a failure does not leak it."""
    deadline = time.monotonic() + timeout
    while (left := running(directory)) and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid, _ in left:
        try:
            psutil.Process(pid).kill()
        except psutil.Error:
            pass
    return left


def _stubborn_child(directory):
    """A non-daemon multiprocessing child that ignores SIGTERM (so SIGKILL is needed)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    record(directory, os.getpid())
    time.sleep(1000)


def start_everything(directory):
    """What a training function might leave behind: one of each kind of descendant."""
    import torch
    from torch.utils.data import DataLoader

    sleeper = subprocess.Popen(["sleep", "1000"])
    record(directory, sleeper.pid)
    detached = subprocess.Popen(["sleep", "1001"], start_new_session=True)
    record(directory, detached.pid)
    # A daemon: its own session, and its parent (sh) exits at once, so it is orphaned; the
    # rank, a subreaper, adopts it.
    daemon = subprocess.run(
        ["sh", "-c", "sleep 1002 >/dev/null 2>&1 & echo $!"],
        start_new_session=True,
        capture_output=True,
        text=True,
    )
    record(directory, int(daemon.stdout))
    child = multiprocessing.Process(target=_stubborn_child, args=(directory,))  # non-daemon
    child.start()
    loader = DataLoader(
        list(range(8)),
        num_workers=2,
        collate_fn=lambda b: torch.tensor(b),
        worker_init_fn=lambda _: record(directory, os.getpid()),
    )
    iterator = iter(loader)
    next(iterator)
    start_everything.keep = iterator  # the workers stay alive after the function returns
    while len(list(Path(directory).glob("*.pid"))) < 6:
        time.sleep(0.01)
    return int(os.environ["RANK"])


def start_everything_then(directory, how):
    start_everything(directory)
    if how == "raise":
        raise ValueError("gives up")
    if how == "kill" and os.environ["RANK"] == "1":
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(1000)


def test_processes_left_by_returning_ranks_are_stopped_and_named_once(tmp_path):
    """Success: the cell finishes (a non-daemon mp child does not hang it), one warning line
    names every process, and none runs afterwards."""
    started = time.monotonic()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = nbaccel.notebook_launcher(
            start_everything, args=(str(tmp_path),), num_processes=2, return_all=True, timeout=60
        )
    assert result == [0, 1]
    assert time.monotonic() - started < 60
    assert wait_until_none_running(tmp_path) == []
    lines = [str(w.message) for w in caught if issubclass(w.category, LeftoverProcessesWarning)]
    assert len(lines) == 1 and "\n" not in lines[0], lines
    assert lines[0].count("pid ") == 12  # 6 processes on each of 2 ranks
    assert "sleep 1000" in lines[0] and "forked from a rank" in lines[0]


@pytest.mark.parametrize("how", ["raise", "kill", "timeout"])
def test_processes_of_failed_killed_or_timed_out_ranks_are_stopped(tmp_path, how):
    expected = TimeoutError if how == "timeout" else RankFailedError
    with pytest.raises(expected), warnings.catch_warnings():
        warnings.simplefilter("ignore", LeftoverProcessesWarning)
        nbaccel.notebook_launcher(
            start_everything_then,
            args=(str(tmp_path), how),
            num_processes=2,
            timeout=10 if how == "timeout" else None,
        )
    assert len(list(tmp_path.glob("*.pid"))) >= 6
    assert wait_until_none_running(tmp_path) == []


def rank_1_dies_beside_a_forked_child(directory):
    """Rank 1 dies (SIGKILL, as the OOM killer does) while a child it forked, which holds what
    the rank held (a DataLoader worker, a multiprocessing child), lives on."""
    child = multiprocessing.get_context("fork").Process(target=_stubborn_child, args=(directory,))
    child.start()
    while not Path(directory, f"{child.pid}.pid").exists():
        time.sleep(0.01)
    if os.environ["RANK"] == "1":
        # Dies only once rank 0's child has recorded itself too: rank 1's death stops rank 0,
        # and a rank 0 stopped earlier took its child with it unrecorded (the test then found 1).
        while len(list(Path(directory).glob("*.pid"))) < 2:
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(1000)


@pytest.mark.parametrize("start_method", ["spawn", "fork"])
def test_a_rank_killed_beside_its_forked_child_is_noticed_without_a_fork_server(
    tmp_path, start_method
):
    """Before: the child kept the rank's end of multiprocessing's exit pipe (the sentinel) open,
    so the kernel never heard that rank 1 had died, and the launch waited for ever (rank 0 ran
    on). A fork server reports a rank's exit itself; without one the kernel asks the status."""
    started = time.monotonic()
    with pytest.raises(RankFailedError, match="rank 1 .*SIGKILL"), warnings.catch_warnings():
        warnings.simplefilter("ignore", LeftoverProcessesWarning)
        nbaccel.notebook_launcher(
            rank_1_dies_beside_a_forked_child,
            args=(str(tmp_path),),
            num_processes=2,
            start_method=start_method,
            timeout=20,
        )
    assert time.monotonic() - started < 15
    assert len(list(tmp_path.glob("*.pid"))) == 2
    assert wait_until_none_running(tmp_path) == []


def start_everything_then_rank_1_is_killed(directory):
    start_everything(directory)
    time.sleep(0.5)  # the kernel's looks at the descendants are 0.1 s apart
    if os.environ["RANK"] == "1":
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(1000)


@pytest.mark.parametrize("start_method", ["spawn", "fork"])
def test_a_killed_ranks_daemon_is_stopped_without_a_fork_server(tmp_path, start_method):
    """Without a fork server to adopt them, a SIGKILLed rank's descendants re-parent to pid 1:
    members of its session were swept, but a daemon (a session of its own) ran on. The
    kernel now notes them while the rank lives (one orphaned within 0.1 s of the rank's death
    can still escape)."""
    with pytest.raises(RankFailedError), warnings.catch_warnings():
        warnings.simplefilter("ignore", LeftoverProcessesWarning)
        nbaccel.notebook_launcher(
            start_everything_then_rank_1_is_killed,
            args=(str(tmp_path),),
            num_processes=2,
            start_method=start_method,
            timeout=30,
        )
    assert len(list(tmp_path.glob("*.pid"))) >= 6
    assert wait_until_none_running(tmp_path) == []


SCRIPT = """
import sys, time
sys.path.insert(0, {root!r})
import nbaccel
from tests.test_containment import start_everything_then

if __name__ == "__main__":
    nbaccel.notebook_launcher(start_everything_then, args=({d!r}, "wait"), num_processes=2)
"""


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_launching_script_killed_takes_every_descendant_with_it(tmp_path, sig):
    """The launching process dies (kernel SIGKILLed, script SIGTERMed): the fork server kills
    the ranks and everything they started, wherever it re-parented."""
    pids = tmp_path / "pids"
    pids.mkdir()
    script = tmp_path / "launch.py"
    script.write_text(SCRIPT.format(root=os.getcwd(), d=str(pids)))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    # Its own session, as a Jupyter kernel has: a killpg must not reach this test.
    driver = subprocess.Popen([sys.executable, str(script)], env=env, start_new_session=True)
    deadline = time.monotonic() + 120
    while len(list(pids.glob("*.pid"))) < 12 and time.monotonic() < deadline:
        assert driver.poll() is None, "the launching script ended early"
        time.sleep(0.05)
    for helper in psutil.Process(driver.pid).children():  # the fork server must go too
        record(str(pids), helper.pid)
    os.killpg(driver.pid, sig)  # the whole group, as Jupyter does when it restarts a kernel
    driver.wait(30)
    assert wait_until_none_running(pids) == []


# -- what the error says -------------------------------------------------------------------------


def leave_rank_zero_in_a_barrier():
    import torch.distributed as dist

    dist.init_process_group("gloo")
    dist.barrier()
    if dist.get_rank() == 1:
        sys.exit(0)
    dist.barrier()  # rank 1 is gone: gloo says "Connection closed by peer"


def die_while_the_peer_waits_in_a_barrier():
    import torch.distributed as dist

    dist.init_process_group("gloo")
    dist.barrier()
    if dist.get_rank() == 0:
        os.kill(os.getpid(), signal.SIGKILL)  # as the OOM killer would
    dist.barrier()  # rank 0 is gone: gloo says "Connection reset (or closed) by peer"


def test_a_rank_killed_by_a_signal_is_named_before_the_connection_error_it_caused():
    """Rank 1's error event often arrives before rank 0's exit status, and the stop it starts
    reached rank 0 first: rank 0 used to read as stopped by nbaccel, its peer's reset as the
    failure (2 of 3 launches here). Each launch is a fresh chance for that race."""
    for _ in range(5):
        with pytest.raises(RankFailedError) as info:
            nbaccel.notebook_launcher(die_while_the_peer_waits_in_a_barrier, num_processes=2)
        first = str(info.value).splitlines()[0]
        assert first.startswith("rank 0 (of 2) was killed by signal SIGKILL"), str(info.value)
        assert info.value.rank == 0 and info.value.exitcode == -signal.SIGKILL


def test_a_rank_that_left_early_is_named_before_the_connection_error_it_caused():
    with pytest.raises(RankFailedError) as info:
        nbaccel.notebook_launcher(leave_rank_zero_in_a_barrier, num_processes=2)
    text = str(info.value)
    first = text.splitlines()[0]
    assert first.startswith("rank 1 exited (code 0) while rank 0 was still in a collective; "), text
    assert "rank 0 (of 2) then raised" in first


def return_a_generator():
    return (i for i in range(3))


def test_an_unpicklable_return_value_is_named_with_its_type_and_what_to_do():
    with pytest.raises(RankFailedError) as info:
        nbaccel.notebook_launcher(return_a_generator, num_processes=1)
    text = str(info.value)
    assert "rank 0 returned a builtins.generator that cannot be sent to the kernel" in text
    assert "return_all" in text and "state_dict" in text
    assert "cloudpickle" not in text  # no pickling frames, only what the user needs


def leaves_a_pool_open(directory: str) -> int:
    """A notebook habit: a Pool kept on a global, never closed or joined."""
    import multiprocessing

    leaves_a_pool_open.pool = multiprocessing.Pool(2)
    for child in multiprocessing.active_children():
        record(directory, child.pid)
    return sum(leaves_a_pool_open.pool.map(abs, range(-3, 3)))


def test_a_pool_left_open_ends_with_the_rank_and_its_workers_are_gone(tmp_path):
    # Killing its workers first left Pool's exit step waiting forever on their queue's lock.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LeftoverProcessesWarning)
        result = nbaccel.notebook_launcher(
            leaves_a_pool_open, args=(str(tmp_path),), num_processes=2, timeout=30
        )
    assert result == 9
    assert len(list(tmp_path.glob("*.pid"))) == 4
    assert wait_until_none_running(tmp_path) == []


def exit_hook_never_returns() -> str:
    import atexit
    import threading

    atexit.register(threading.Event().wait)  # waits forever
    return "reported"


def test_a_rank_whose_exit_hook_hangs_ends_at_the_exit_deadline(capfd):
    result = nbaccel.notebook_launcher(
        exit_hook_never_returns, num_processes=2, env={"NBACCEL_EXIT_DEADLINE": "2"}, timeout=30
    )
    assert result == "reported"
    err = capfd.readouterr().err
    assert "exit hooks are still waiting" in err and "threading.py" in err
