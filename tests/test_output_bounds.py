"""What bounds rank output on its way to the notebook, piece by piece (fast, no ranks): the text
view's budget, a pane's size, and the log files that keep everything. The whole path, with real
ranks and kernels in both views, is ``tests/test_output_flood.py``."""

from __future__ import annotations

import os

from nbaccel.launch import output_logs
from nbaccel.launch.lines import LineSplitter
from nbaccel.launch.state import LaunchState, RankState
from nbaccel.ui import panes
from nbaccel.ui.text import TextView


def test_text_view_prints_a_flood_within_its_budget_then_the_last_lines(capfd, tmp_path):
    state = LaunchState(None, {0: RankState(0)}, log_folder=str(tmp_path))
    view = TextView(show_progress=False)
    view._state = state  # as start() leaves it, without the banner (no LaunchInfo here)
    view._label = lambda rank: f"[rank{rank}] "
    lines = [f"line {i}" for i in range(200_000)]
    for i in range(0, len(lines), 1000):  # as the relay hands them over, a read at a time
        view.output(0, "stdout", lines[i : i + 1000])
    view.finish()
    out = capfd.readouterr().out
    assert len(out) < 400_000, len(out)  # 2.2 MB of lines
    printed = [line for line in out.splitlines() if line.startswith("[rank0] line ")]
    assert printed[0] == "[rank0] line 0" and printed[-1] == "[rank0] line 199999"
    note = f"lines not shown here (too much output); every line is in {tmp_path}/rank0.stdout.log"
    assert note in out and out.rstrip().splitlines()[-21].endswith("; the last 20:")


def test_text_view_prints_everything_of_a_normal_launch(capfd):
    view = TextView(show_progress=False)
    view._label = lambda rank: f"[rank{rank}] "
    view.output(1, "stderr", [f"warning {i}" for i in range(2000)])
    view.finish()
    assert capfd.readouterr().err.count("[rank1] warning") == 2000


def test_pane_holds_a_bounded_number_of_characters_and_keeps_a_cut_lines_note():
    buf = panes.PaneBuffer()
    cut = LineSplitter(limit=1 << 16).feed(b"y" * 1_000_000 + b"\n")[0]
    buf.extend("stdout", ["x" * 5000] * 100 + [cut])
    view = panes.PaneView(0, lambda cls, **traits: cls(**traits))
    html = "".join(
        str(v) for _, name, v in view.changes(buf, "/logs/rank0.*.log") if name == "value"
    )
    assert len(html) < 100_000, len(html)
    assert "more bytes not shown" in html and "earlier lines dropped" in html
    assert "every line is in /logs/rank0.*.log" in html


def test_logs_keep_every_byte_and_the_newest_folders(tmp_path, monkeypatch):
    monkeypatch.setenv("NBACCEL_LOG_DIR", str(tmp_path))
    (tmp_path / "notes").mkdir()  # not a launch folder: never removed
    for i in range(output_logs.KEEP + 5):
        old = tmp_path / f"20200101-0000{i:02d}-1-1"
        old.mkdir()
        os.utime(old, (1_600_000_000 + i, 1_600_000_000 + i))
    state = LaunchState(None, {})
    log = output_logs.LaunchLogs(state).file(3, "stderr")
    for _ in range(3):
        log.write(b"z" * 100_000)
    assert open(state.log_path(3, "stderr"), "rb").read() == b"z" * 300_000
    kept = sorted(p.name for p in tmp_path.iterdir())
    assert len(kept) == output_logs.KEEP + 1 and "notes" in kept
    assert "20200101-000000-1-1" not in kept and "20200101-000024-1-1" in kept


def test_a_full_disk_stops_the_log_and_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv("NBACCEL_LOG_DIR", str(tmp_path))
    state = LaunchState(None, {})
    logs = output_logs.LaunchLogs(state)
    logs.made_folder()
    os.symlink("/dev/full", state.log_path(0, "stdout"))  # every write: ENOSPC
    splitter = LineSplitter(sink=logs.file(0, "stdout"))
    assert splitter.feed(b"still shown\n") == ["still shown"]
    assert "rank0.stdout.log stopped: No space left on device" in state.log_problem
    from nbaccel.ui.summary import logs_line

    assert "(incomplete: " in logs_line(state)
