"""The plain-text view with real ranks: unfinished lines after a second of quiet, no doubled
torch prefix, a run line, and a stall notice that says where each rank waits."""

from __future__ import annotations

import re
import time

import pytest

import nbaccel

pytestmark = pytest.mark.slow  # real ranks


def progress_with_a_pause():
    import sys

    print("\rstep 5", end="", flush=True)
    time.sleep(2.0)  # a quiet second with an unfinished line on screen
    print("\rstep 6", flush=True)
    sys.stderr.write("[rank0]:W1201 12:00:00.000 a torch-style warning\n")
    for _ in nbaccel.progress(range(30), desc="batch"):
        time.sleep(0.1)
    return 0


def test_unfinished_line_shows_after_a_second_and_prefixes_are_not_doubled(capfd):
    nbaccel.notebook_launcher(progress_with_a_pause, num_processes=1, progress="text")
    captured = capfd.readouterr()
    lines = captured.out.splitlines()
    assert "[rank0] step 5" in lines  # shown while the rank was quiet, before "step 6"
    assert lines.index("[rank0] step 5") < lines.index("[rank0] step 6")
    assert "[rank0] W1201 12:00:00.000 a torch-style warning" in captured.err
    assert "[rank0]:" not in captured.err
    assert any(re.match(r"nbaccel run: step \d+/30 · [\d.]+ it/s", line) for line in lines)
    assert "run: step 30/30" in captured.out  # in the final summary


def wait_in_barrier():
    import torch.distributed as dist

    acc = nbaccel.Accelerator()
    if acc.process_index == 0:
        time.sleep(6)
    dist.barrier()
    return 0


def test_stall_notice_in_text(capfd, monkeypatch):
    monkeypatch.setenv("NBACCEL_STALL_AFTER", "2")
    nbaccel.notebook_launcher(wait_in_barrier, num_processes=2, progress="text")
    out = capfd.readouterr().out
    assert "nbaccel: stalled? no rank has advanced for" in out
    assert "rank 1: waiting in barrier" in out
    assert "stalled for up to" in out  # the final summary keeps it
    # Once when the stack arrives, again when the stall doubled: not every 2 s for 4 s.
    assert out.count("nbaccel: stalled?") <= 3, out


def partial_lines_then_exit():
    import sys

    sys.stdout.write("loading...")
    sys.stdout.flush()
    time.sleep(1.6)  # shown after a second of quiet
    print(" done", flush=True)
    sys.stderr.write("no newline at end")
    sys.stderr.flush()
    time.sleep(1.6)
    return 0


def test_unfinished_line_is_shown_once_and_then_only_its_rest(capfd):
    nbaccel.notebook_launcher(partial_lines_then_exit, num_processes=1, progress="text")
    captured = capfd.readouterr()
    out, err = captured.out.splitlines(), captured.err.splitlines()
    assert captured.out.count("loading...") == 1, captured.out
    assert out.index("[rank0] loading...") + 1 == out.index("[rank0] … done")
    assert captured.err.count("no newline at end") == 1, captured.err
    assert "[rank0] no newline at end" in err


def precision_set_in_code():
    acc = nbaccel.Accelerator(mixed_precision="bf16")
    time.sleep(0.5)  # the kernel sees the rank's settings while it runs
    return acc.mixed_precision


def test_settings_set_in_code_are_said_even_without_progress(capfd):
    # The opening line gives the launch's settings as defaults; the function's Accelerator
    # may set its own, and the user is told once, also with progress=False (no summary).
    nbaccel.notebook_launcher(precision_set_in_code, num_processes=1, progress=False)
    out = capfd.readouterr().out
    assert "mixed_precision=no, strategy=ddp (unless set in code)," in out
    assert out.count("nbaccel: the ranks run mixed_precision=bf16 (set in code)") == 1, out
