"""``breakpoint()`` in a rank of ``nbaccel launch``: pdb on the launcher's terminal (a real pty,
driven with pexpect as a person types), one rank at a time; ``q`` stops every rank."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

pexpect = pytest.importorskip("pexpect", reason="pexpect drives the terminal (IPython needs it)")

pytestmark = pytest.mark.slow  # a launch of real ranks

SCRIPT = textwrap.dedent("""
    import os
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    print(f"pid={os.getpid()}", flush=True)
    values = [rank, 10]
    breakpoint()
    values.append(3)
    dist.barrier()
    print("done", rank, values, flush=True)
""")


def spawn(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    return pexpect.spawn(
        sys.executable,
        ["-m", "nbaccel", "launch", "--num_processes", "2", str(script)],
        encoding="utf-8",
        timeout=90,
        cwd=str(tmp_path),
    )


def gone(pids: list[int], within: float = 10) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if not [p for p in pids if psutil.pid_exists(p) and not _zombie(p)]:
            return True
        time.sleep(0.1)
    return False


def _zombie(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_each_ranks_breakpoint_gets_the_terminal_in_turn(tmp_path):
    child = spawn(tmp_path)
    served = []
    for _ in range(2):
        child.expect(r"\(Pdb rank (\d)\) ")
        rank = int(child.match.group(1))
        served.append(rank)
        child.sendline("p values")
        child.expect_exact(f"[{rank}, 10]")
        child.expect_exact(f"(Pdb rank {rank}) ")
        child.sendline("c")
    child.expect(pexpect.EOF)
    child.close()
    assert sorted(served) == [0, 1]
    assert child.exitstatus == 0, child.before
    assert "done 0 [0, 10, 3]" in child.before and "done 1 [1, 10, 3]" in child.before


def test_q_stops_every_rank(tmp_path):
    child = spawn(tmp_path)
    child.expect(r"\(Pdb rank (\d)\) ")
    seen = child.before
    child.sendline("q")
    child.expect(pexpect.EOF)
    child.close()
    pids = [int(p) for p in re.findall(r"pid=(\d+)", seen + child.before)]
    assert "all ranks were stopped" in child.before
    assert child.exitstatus != 0
    assert pids and gone(pids), "a rank outlived the launch after q"


def test_ctrl_c_at_the_prompt_stops_every_rank_as_fast_as_without_one(tmp_path):
    """Before, elastic forwarded the SIGINT to the paused rank, whose pdb took it for a Ctrl-C
    at its own prompt and asked again: the launch ended 30 s later, at elastic's SIGKILL (and a
    launcher thread inside stdin's reader at exit was a fatal error)."""
    child = spawn(tmp_path)
    child.expect(r"\(Pdb rank (\d)\) ")
    seen = child.before
    pressed = time.monotonic()
    child.sendintr()
    child.expect(pexpect.EOF, timeout=60)
    took = time.monotonic() - pressed
    child.close()
    pids = [int(p) for p in re.findall(r"pid=(\d+)", seen + child.before)]
    assert took < 15, f"Ctrl-C at the prompt took {took:.1f} s"
    assert "stopped by SIGINT; all ranks were stopped" in child.before, child.before
    assert "Fatal Python error" not in child.before, child.before
    assert pids and gone(pids), "a rank outlived the launch after Ctrl-C"


def test_end_of_input_at_the_prompt_says_so_and_stops(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    ended = subprocess.run(
        [sys.executable, "-m", "nbaccel", "launch", "--num_processes", "2", str(script)],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=str(tmp_path),
    )
    said = ended.stdout + ended.stderr
    pids = [int(p) for p in re.findall(r"pid=(\d+)", said)]
    assert "nbaccel launch: end of input on stdin at rank" in said, said
    assert said.count("end of input") == 1, said
    assert "SIGINT" not in said and "Fatal Python error" not in said, said  # nobody pressed it
    assert ended.returncode != 0
    assert pids and gone(pids), "a rank outlived the launch after the end of input"
