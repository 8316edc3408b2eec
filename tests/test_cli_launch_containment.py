"""``nbaccel launch`` leaves nothing running: not its ranks, not what the script started.

Checked by command-line marker on every process of the machine (orphans re-parent to pid 1,
out of the test's sight otherwise), for a script whose ranks each start a child in their own
process group and one in a session of its own (out of reach of elastic's group signals):
when the script ends normally, when ``nbaccel launch`` gets SIGTERM, and when it is SIGKILLed.
"""

from __future__ import annotations

import os
import signal
import sys
import textwrap
import time
import uuid

import pytest

from tests.test_cli_support import processes_mentioning, start_cli

HANG = textwrap.dedent(
    """
    import os, subprocess, sys, time
    import nbaccel

    out, marker, mode = sys.argv[1], sys.argv[2], sys.argv[3]
    accelerator = nbaccel.Accelerator()
    sleeper = [sys.executable, "-c", "import time; time.sleep(1000)", marker]
    subprocess.Popen(sleeper)
    subprocess.Popen(sleeper, start_new_session=True)
    open(os.path.join(out, f"ready{accelerator.process_index}"), "w").close()
    if mode == "hang":
        time.sleep(1000)
    """
)


def _launch(tmp_path, mode: str):
    marker = f"nbaccel-contain-{uuid.uuid4().hex}"
    script = tmp_path / "hang.py"
    script.write_text(HANG)
    # Its own session, as `setsid nbaccel launch ... &` in a shell: only it gets our signal.
    cli = start_cli(
        "launch", "--num_processes", "2", str(script), str(tmp_path), marker, mode, cwd=tmp_path
    )
    return cli, marker


def _wait_ready(tmp_path, cli, count: int = 2, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while len(list(tmp_path.glob("ready*"))) < count:
        assert cli.poll() is None, cli.communicate()
        assert time.monotonic() < deadline, "the ranks never started their children"
        time.sleep(0.05)
    time.sleep(0.3)  # the children exist once Popen returned; give the ranks a moment more


def _assert_nothing_left(marker: str) -> None:
    left = processes_mentioning(marker, wait=5.0)
    for p in left:  # a failure must not leak them into later tests
        try:
            p.kill()
        except Exception:  # noqa: BLE001
            pass
    assert not left, f"still running 5 s later: {[(p.pid, p.cmdline()) for p in left]}"


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="subreaper/PDEATHSIG: Linux")
def test_sigkill_of_launch_stops_ranks_and_their_children(tmp_path):
    cli, marker = _launch(tmp_path, "hang")
    try:
        _wait_ready(tmp_path, cli)
        os.kill(cli.pid, signal.SIGKILL)
        cli.communicate(timeout=30)
    finally:
        if cli.poll() is None:
            cli.kill()
    _assert_nothing_left(marker)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=lambda s: s.name)
def test_signalled_launch_stops_ranks_and_their_children(tmp_path, sig):
    cli, marker = _launch(tmp_path, "hang")
    try:
        _wait_ready(tmp_path, cli)
        os.kill(cli.pid, sig)
        _, err = cli.communicate(timeout=60)
    finally:
        if cli.poll() is None:
            cli.kill()
    assert cli.returncode == 128 + sig, err
    assert f"stopped by {sig.name}" in err
    _assert_nothing_left(marker)


@pytest.mark.slow
def test_script_end_stops_what_it_left_running(tmp_path):
    cli, marker = _launch(tmp_path, "end")
    out, err = cli.communicate(timeout=120)
    assert cli.returncode == 0, out + err
    assert len(list(tmp_path.glob("ready*"))) == 2
    # The guard stopped them before elastic saw the rank end: nothing to wait for.
    left = processes_mentioning(marker, wait=0.0)
    _assert_nothing_left(marker)
    assert not left


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="subreaper/PDEATHSIG: Linux")
def test_sigkill_of_one_rank_stops_what_it_started(tmp_path):
    cli, marker = _launch(tmp_path, "hang")
    try:
        _wait_ready(tmp_path, cli)
        guards = [p for p in processes_mentioning(marker, wait=0.0) if p.ppid() == cli.pid]
        assert len(guards) == 2, [(p.pid, p.ppid(), p.cmdline()) for p in guards]
        guards[0].kill()  # the worker process torch elastic watches
        _, err = cli.communicate(timeout=120)
    finally:
        if cli.poll() is None:
            cli.kill()
    assert cli.returncode == 1, err
    assert "SIGKILL" in err
    _assert_nothing_left(marker)
