"""A fork server that stops answering a rank start, while a background launch runs from it.

The hang is real: the server is stopped with SIGSTOP (``tests/test_launcher.py`` has the
Ctrl-C case of a server nothing else uses). The start that hung ends with an error that says
so; the server is set aside, not killed, so the background launch's ranks go on; when it ends
the server is stopped, and the next launch gets a fresh one. Checked by pid.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

import psutil
import pytest

import nbaccel
from nbaccel import RankFailedError
from nbaccel.core import mp_internals
from nbaccel.core.errors import LaunchError
from nbaccel.forkserver import server as forkserver
from nbaccel.launch import group, handle

pytestmark = pytest.mark.slow  # real ranks, a server stopped for seconds


def sleeps_then_returns(seconds):
    time.sleep(seconds)
    return 11


def _background_with_a_hung_start(monkeypatch, seconds):
    """A background launch running on 2 ranks, its server SIGSTOPped, and a second launch
    whose start that server never answers: returns (background launch, hung server pid, rank
    pids) once the second launch gave up, having checked what it raised."""
    monkeypatch.setattr(forkserver, "ANSWER_DEADLINE", 1.0)  # 30 s in real use
    background = nbaccel.notebook_launcher(
        sleeps_then_returns, args=(seconds,), num_processes=2, block=False, progress=False
    )
    deadline = time.monotonic() + 60
    while set(background.ranks.values()) != {"running"} and time.monotonic() < deadline:
        time.sleep(0.02)
    assert background.status == "running", background
    ranks = [s.pid for s in background.state.ranks.values()]
    hung = mp_internals.forkserver_pid()
    os.kill(hung, signal.SIGSTOP)
    try:
        with pytest.raises(LaunchError, match=f"fork server .pid {hung}. did not answer") as e:
            nbaccel.notebook_launcher(os.getpid, num_processes=2, progress=False)
    except BaseException:
        os.kill(hung, signal.SIGCONT)
        raise
    assert "goes on serving the 2 ranks already running from it" in str(e.value)
    assert mp_internals.forkserver_pid() != hung  # set aside: the next launch starts afresh
    assert all(psutil.pid_exists(pid) for pid in [hung, *ranks])  # nothing of theirs killed
    return background, hung, ranks


def _gone(pids, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = [p for p in pids if mp_internals.server_alive(p)]  # a zombie counts as gone
        if not left:
            return []
        time.sleep(0.05)
    return left


def test_a_hung_start_leaves_a_background_launch_running_to_its_result(monkeypatch):
    background, hung, ranks = _background_with_a_hung_start(monkeypatch, seconds=3)
    os.kill(hung, signal.SIGCONT)  # the server answers again: its ranks' exits get reported
    assert background.result(timeout=60) == 11
    # Its last rank reaped, the server set aside is stopped (the late fork of the start that
    # was given up with it).
    assert _gone([hung, *ranks]) == []
    assert nbaccel.notebook_launcher(lambda: 7, num_processes=2) == 7
    assert mp_internals.forkserver_pid() != hung


def test_a_rank_of_a_retired_server_that_dies_is_said_to_have_lost_its_server(monkeypatch):
    background, hung, ranks = _background_with_a_hung_start(monkeypatch, seconds=30)
    os.kill(hung, signal.SIGKILL)  # the retired server dies under its ranks
    with pytest.raises(RankFailedError, match="ended when its fork server died"):
        background.result(timeout=60)
    assert _gone([hung, *ranks]) == []


def _started_from(server: int) -> list[int]:
    """The ranks forked by ``server`` whose start the kernel has heard back about. A rank
    forked but not yet answered for is not enough: stopping the server then leaves the start
    waiting for its answer (ANSWER_DEADLINE, 30 s), another test; on a loaded machine that
    window is wide."""
    return sorted(forkserver.SERVER.live.from_server(server))


def test_a_server_that_hangs_or_dies_under_a_launch_never_traps_it(monkeypatch):
    """The server stops answering while a blocking launch runs: its ranks end, but no exit
    status can arrive. Ctrl-C must still end the launch (the hung server is killed so the
    statuses arrive) and leave nothing running. Then a server that dies while a rank start
    waits for it (the OOM killer, say): the error says so, not multiprocessing's bare
    'unexpected EOF'. Each time the next launch gets a fresh server."""
    monkeypatch.setattr(group, "KILLED_STATUS_WAIT", 1.0)  # 5 s in real use
    monkeypatch.setattr(handle, "STOP_GRACE", 0.5)  # 3 s
    nbaccel.notebook_launcher(lambda: 0, num_processes=1, progress=False)  # a warm server
    hung = mp_internals.forkserver_pid()
    pids = []

    def hang_then_interrupt():
        deadline = time.monotonic() + 60
        while len(pids) < 2 and time.monotonic() < deadline:
            pids[:] = _started_from(hung)
            time.sleep(0.02)
        os.kill(hung, signal.SIGSTOP)
        time.sleep(1.0)  # the ranks end meanwhile; their server cannot report it
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(20)  # the launch should have ended long before: free a broken one
        with contextlib.suppress(ProcessLookupError):  # the launch stopped it, as it should
            os.kill(hung, signal.SIGCONT)

    threading.Thread(target=hang_then_interrupt, daemon=True).start()
    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        nbaccel.notebook_launcher(sleeps_then_returns, args=(0.5,), num_processes=2, progress=False)
    assert time.monotonic() - started < 15, "Ctrl-C waited for the hung server"
    assert _gone([hung, *pids]) == []
    assert nbaccel.notebook_launcher(lambda: 7, num_processes=2, progress=False) == 7

    dead = mp_internals.forkserver_pid()
    os.kill(dead, signal.SIGSTOP)  # the start waits for its answer...
    threading.Timer(0.5, os.kill, (dead, signal.SIGKILL)).start()  # ...which never comes
    with pytest.raises(LaunchError, match=f"fork server .pid {dead}. died while starting rank 0"):
        nbaccel.notebook_launcher(os.getpid, num_processes=2, progress=False)
    assert nbaccel.notebook_launcher(lambda: 7, num_processes=2, progress=False) == 7


def test_ranks_that_end_under_a_hung_server_end_their_launch(monkeypatch):
    """Without Ctrl-C: ranks that return while their server no longer answers are never
    reported by it; the launch notices they are dead, stops the server, and returns."""
    monkeypatch.setattr(group, "KILLED_STATUS_WAIT", 1.0)  # 5 s in real use
    nbaccel.notebook_launcher(lambda: 0, num_processes=1, progress=False)  # a warm server
    hung = mp_internals.forkserver_pid()

    def hang():
        deadline = time.monotonic() + 60
        while len(_started_from(hung)) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        os.kill(hung, signal.SIGSTOP)
        time.sleep(20)  # the launch should have ended long before: free a broken one
        with contextlib.suppress(ProcessLookupError):  # the launch stopped it, as it should
            os.kill(hung, signal.SIGCONT)

    threading.Thread(target=hang, daemon=True).start()
    started = time.monotonic()
    assert nbaccel.notebook_launcher(sleeps_then_returns, args=(0.5,), num_processes=2) == 11
    assert time.monotonic() - started < 12, "the launch waited for the hung server"
    assert _gone([hung]) == []
