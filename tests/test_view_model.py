"""The launch state the views read: rates across epochs, the run line, stragglers, stalls, and the
text the views make of it. Fast: synthetic events with explicit times, no ranks."""

from __future__ import annotations

import re
import time

import pytest

from nbaccel.core.local_traceback import Renderer, render_launch_error
from nbaccel.launch.lines import LineSplitter
from nbaccel.launch.state import LaunchInfo, LaunchState, RankState, RankStatus
from nbaccel.ui import chart, panes, summary, table
from tests.fresh_boot import fresh_boot_clock  # noqa: F401 - a fixture, used below

# Each test runs at the real clock and as on a machine booted a second ago: the view model's
# readers take ``now``, so hand-picked times mean the same whatever the machine's uptime.
pytestmark = pytest.mark.usefixtures("fresh_boot_clock")


def make_state(n: int = 2, t0: float = 1000.0) -> LaunchState:
    info = LaunchInfo(
        world_size=n,
        num_processes=n,
        node_rank=0,
        first_rank=0,
        device="cpu",
        backend="gloo",
        mixed_precision="no",
        strategy="ddp",
        gradient_accumulation_steps=1,
        master_addr="127.0.0.1",
        master_port=1234,
        start_method="forkserver",
    )
    ranks = {r: RankState(r, status=RankStatus.RUNNING, started_at=t0) for r in range(n)}
    return LaunchState(info, ranks, started_at=t0)


def run_epochs(rank: RankState, t0: float, epochs: int, steps: int, step_time: float) -> float:
    """Feed an epoch bar around per-epoch batch bars, 10 events a second; return the end time."""
    t = t0
    rank.on_progress(0, 0, epochs, "epoch", 0.0, now=t)
    for e in range(epochs):
        bar_id = e + 1
        rank.on_progress(bar_id, 0, steps, "batch", 0.0, now=t)
        for n in range(1, steps + 1):
            t += step_time
            if n % max(1, int(0.1 / step_time)) == 0 or n == steps:
                rank.on_progress(bar_id, n, steps, "batch", t - t0, unit_scale=8, now=t)
        rank.on_progress(bar_id, steps, steps, "batch", t - t0, closed=True, unit_scale=8, now=t)
        rank.on_progress(0, e + 1, epochs, "epoch", t - t0, now=t)
    return t


def test_rate_carries_over_epoch_boundaries_and_run_eta_covers_the_whole_run():
    state = make_state(1)
    rank = state.ranks[0]
    t = run_epochs(rank, 1000.0, epochs=2, steps=23, step_time=0.02)  # 0.46 s epochs
    # The third epoch's bar has just opened at 0/23: the rate is still there.
    rank.on_progress(3, 0, 23, "batch", t - 1000.0, now=t)
    rate = rank.step_rate(now=t + 0.05)
    assert rate is not None and 40 < rate < 55, rate  # 50 steps/s
    done, total, _ = rank.run_progress()
    assert (done, total) == (46, 46)  # the epoch bar says 2 epochs of 23 batches
    facts = state.run_line(now=t + 0.05)
    assert facts["steps"] == 46 and facts["epoch"] == (2, 2)
    assert facts["samples_per_s"] and 300 < facts["samples_per_s"] < 450  # 8 samples a step


def test_run_total_from_epoch_bar_times_batches():
    state = make_state(1)
    rank = state.ranks[0]
    rank.on_progress(0, 0, 10, "epoch", 0.0, now=1000.0)
    rank.on_progress(1, 0, 100, "batch", 0.0, now=1000.0)
    rank.on_progress(1, 50, 100, "batch", 1.0, now=1001.0)
    assert rank.run_progress() == (50, 1000, "steps")
    eta = rank.eta(now=1001.0)
    assert eta is not None and 17 < eta < 20  # 950 steps at 50/s
    line = summary.run_line(state, now=1001.0)
    assert "step 50/1,000" in line and "epoch 0/10" in line and "ETA" in line


def test_rate_never_blank_once_steps_arrive():
    rank = make_state(1).ranks[0]
    assert rank.step_rate(now=1000.0) is None
    rank.on_progress(0, 0, 100, None, 0.0, now=1000.0)
    rank.on_progress(0, 3, 100, None, 0.3, now=1000.3)
    for later in (1000.5, 1005.0, 1030.0):  # quiet spells of any length keep a rate
        assert rank.step_rate(now=later), later


def test_straggler_is_a_rank_20_percent_below_the_median():
    t0 = 1000.0
    state = make_state(3, t0)
    for r, steps, step_time in ((0, 400, 0.01), (1, 400, 0.01), (2, 200, 0.02)):
        run_epochs(state.ranks[r], t0, epochs=1, steps=steps, step_time=step_time)
    assert state.stragglers(now=t0 + 4) == {2}
    html = table.table_html(state, now=t0 + 4.5)
    assert "data-rank='2'" in html and "nbaccel-straggler" in html
    assert re.search(r"data-rank='2'[^>]*data-straggler='1'", html)
    assert "(straggler)" in summary.summary_text(state, now=t0 + 4.5)


def test_stall_after_quiet_period_asks_for_stacks_once():
    state = make_state(2)
    state.stall_after = 30
    for r in state.ranks.values():
        r.on_progress(0, 5, 10, None, 1.0, now=1001.0)
    assert state.stalled_for(now=1020.0) is None
    assert state.stalled_for(now=1032.0) == 31.0
    assert state.wants_stacks(now=1032.0) and not state.wants_stacks(now=1040.0)
    state.ranks[0].diag = (
        "Current thread 0x00007f (most recent call first):\n"
        '  File "/x/torch/distributed/distributed_c10d.py", line 2501 in all_reduce\n'
        '  File "/tmp/ipykernel_1/2.py", line 7 in train\n'
    )
    state.ranks[0].last_advance = 1001.0
    text = summary.stall_text(state, now=1032.0)
    assert "no rank has advanced" in text and "rank 0: waiting in all_reduce" in text
    assert "rank 1: no stack yet" in text


def test_effective_settings_replace_the_launch_settings_in_the_banner():
    state = make_state(1)
    state.ranks[0].effective = {"mixed_precision": "bf16", "strategy": "ddp", "device": "cpu"}
    assert "mixed_precision=bf16 (set in code)" in summary.headline(state, now=1001.0)
    assert "data-precision='bf16'" in table.header_html(state, now=1001.0)


def test_summary_cells_are_left_aligned_for_jupyterlab():
    state = make_state(2)
    state.ranks[1].status = RankStatus.STOPPED
    html = summary.summary_html(state, now=1001.0)
    assert "text-align:right" not in html
    assert all("text-align:left" in td for td in re.findall(r"<td[^>]*>", html))


def test_chart_legend_in_rank_order_and_readable_axis_labels():
    svg = chart.line_chart("loss", {1: [(0, 0.000531), (1840, 0.5)], 0: [(0, 0.2), (1840, 0.1)]})
    legend = re.findall(r"class='nbaccel-legend'>rank (\d)<", svg)
    xs = [float(x) for x in re.findall(r"x='([\d.]+)'[^>]*class='nbaccel-legend'", svg)]
    assert legend == ["0", "1"] and xs == sorted(xs)
    assert ">1.84k<" in svg and ">0.00053<" in svg and "e+03" not in svg
    # Both ends of an axis in one style: an lr axis read "9m … 0.011".
    lr = chart.line_chart("lr", {0: [(0, 0.011), (9, 0.009)]})
    assert ">0.009<" in lr and ">0.011<" in lr and "m<" not in lr


def test_memory_is_measured_at_once_and_a_zombie_does_not_read_as_0_mib():
    import os

    from nbaccel.ui.resources import MemorySampler

    state = make_state(2)
    sampler = MemorySampler()
    sampler.sample(state)  # no pids yet: nothing to measure
    child = os.fork()
    if child == 0:
        os._exit(0)  # a rank that has exited and is not reaped yet
    try:
        time.sleep(0.2)
        state.ranks[0].pid, state.ranks[1].pid = os.getpid(), child
        state.ranks[1].rss = 300 << 20  # its last real reading
        sampler.sample(state)  # within INTERVAL of the last sample, yet rank 0 is new
        assert state.ranks[0].rss and state.ranks[0].rss > 1 << 20
        assert state.ranks[1].rss == 300 << 20, "a zombie's 0 bytes replaced the reading"
    finally:
        os.waitpid(child, 0)


def test_metrics_status_and_rate_columns_wrap_the_others_do_not():
    state = make_state(2)
    for r in state.ranks.values():
        r.metrics = {"loss": 2.37, "lr": 0.01, "grad_norm": 1.5, "tokens": 512.0}
        r.ended_at = r.started_at + 42  # elapsed "42.0 s"
    live, final = table.table_html(state, now=1050.0), summary.summary_html(state, now=1050.0)
    for html in (live, final):
        cells = re.findall(r"<td style='([^']*)'>[^<]*loss=", html)
        assert cells and all("white-space:normal" in c for c in cells), html
        elapsed = re.findall(r"<td style='([^']*)'>42.0 s</td>", html)
        assert elapsed and all("white-space:nowrap" in c for c in elapsed), html


def test_pane_keeps_the_last_lines_and_counts_dropped_ones():
    buf = panes.PaneBuffer()
    buf.extend("stdout", [f"line {i}" for i in range(1500)])
    assert buf.dropped == 500 and buf.lines()[0] == "line 500"
    view = panes.PaneView(0, lambda cls, **traits: cls(**traits))
    changes = view.changes(buf)
    text = "".join(str(v) for _, name, v in changes if name == "value")
    assert "500 earlier lines dropped" in text
    assert "line 1499" in text and "line 499<" not in text
    children = next(v for w, name, v in changes if name == "children")
    assert len(children) == 1000 // panes.BLOCK_LINES
    assert view.box.layout.flex_flow == "column-reverse"  # the box stays at the newest line


def test_pane_update_sends_only_the_blocks_that_changed():
    buf = panes.PaneBuffer()
    made = []
    view = panes.PaneView(0, lambda cls, **traits: made.append(cls(**traits)) or made[-1])

    def update() -> list[str]:
        """Apply the changes as the dashboard does; the values that were new."""
        sent = []
        del made[:]
        for widget, name, value in view.changes(buf):
            if getattr(widget, name) != value:
                setattr(widget, name, value)
                sent.append(value)
        return sent

    buf.extend("stdout", [f"line {i}" for i in range(2000)])
    assert len(update()) == 2 and len(made) == 1000 // panes.BLOCK_LINES  # blocks, with text
    buf.extend("stdout", ["one more"])
    sent = update()  # the new newest block, children (one block scrolled out), the note
    assert len(sent) == 3 and not made  # a block scrolled out is reused for the new one
    assert "one more" in sent[0] and "line 1999" not in sent[0]
    buf.extend("stdout", ["and another"])
    (block,) = update()  # just the newest block: the oldest shown block stays whole
    assert "one more" in block and "and another" in block and len(block) < 500


def test_line_splitter_shows_partial_lines_and_drops_torch_rank_prefix():
    s = LineSplitter()
    assert s.feed(b"\rstep 1") == [] and s.pending == "step 1"
    assert s.feed(b"\rstep 2") == [] and s.pending == "step 2"
    assert s.feed(b"\n[rank0]:W1201 12:00:00 warning\n") == ["step 2", "W1201 12:00:00 warning"]
    assert s.pending == ""


def test_rank_traceback_renders_as_cells_without_nbaccel_frames():
    import linecache

    from nbaccel.core.errors import RankFailedError

    cell_file = "/tmp/ipykernel_4242/123456.py"
    source = "def boom():\n    x = 1\n    raise ValueError('bad batch')\n"
    linecache.cache[cell_file] = (len(source), None, source.splitlines(True), cell_file)
    nbaccel_file = Renderer.__module__.replace(".", "/")  # any file inside the package
    import nbaccel

    pkg = nbaccel.__path__[0]
    remote = (
        "Traceback (most recent call last):\n"
        f'  File "{pkg}/rank/entry.py", line 50, in _run\n'
        "    result = fn()\n"
        f'  File "{cell_file}", line 3, in boom\n'
        "    raise ValueError('bad batch')\n"
        "ValueError: bad batch\n"
    )
    err = RankFailedError(1, 2, "raised ValueError: bad batch", remote, "builtins.ValueError")
    labels = {cell_file: "Cell In[7]"}
    r = Renderer(colour=False, label_for=labels.get)
    text = "\n".join(r.traceback_text(remote))
    assert "Cell In[7], line 3, in boom()" in text
    assert "----> 3     raise ValueError('bad batch')" in text
    assert "entry.py" not in text and nbaccel_file not in text
    plain = "\n".join(render_launch_error(err, colour=False))
    assert plain.endswith("RankFailedError: rank 1 (of 2) raised ValueError: bad batch")
    assert "\x1b[" not in plain and "\x1b[" in "\n".join(render_launch_error(err, colour=True))
    assert err.rank == 1 and err.remote_traceback == remote  # attributes unchanged


def test_table_shows_the_metrics_sample_the_charts_were_drawn_from():
    state = make_state(1)
    rank = state.ranks[0]
    rank.on_metrics(10, {"loss": 0.5}, now=1001.0)
    svg = chart.metrics_charts({0: rank.history})
    snapshot = {0: dict(rank.metrics)}
    rank.on_metrics(20, {"loss": 0.25}, now=1002.0)  # arrives after the charts were drawn
    html = table.table_html(state, 1002.0, svg, snapshot)
    assert "loss=0.5" in html and "loss=0.25" not in html
    assert "loss=0.25" in table.table_html(state, now=1002.0)  # without a chart: the latest


def test_text_view_repeats_a_stall_notice_only_when_it_doubles_or_moves(capsys):
    from nbaccel.ui.text import TextView

    now = time.monotonic()
    state = make_state(1, t0=now - 31)  # quiet for 31 s already (stall_after is 30)
    state.stall_after = 30.0
    view = TextView(progress_interval=0)
    view.start(state)
    for _ in range(4):  # four updates, the seconds in the notice changing in between
        view.update()
        time.sleep(0.15)
    assert capsys.readouterr().out.count("nbaccel: stalled?") == 1
    # where it waits is now known (a faulthandler dump arrived)
    state.ranks[
        0
    ].diag = 'Current thread 0x1 (most recent call first):\n  File "x.py", line 3 in barrier\n'
    view.update()
    view.update()
    assert capsys.readouterr().out.count("nbaccel: stalled?") == 1
    state.ranks[0].started_at = now - 70  # the stall has more than doubled
    view.update()
    assert capsys.readouterr().out.count("nbaccel: stalled?") == 1


def test_a_ranks_cell_ends_with_a_status_line_only_when_it_ran_long(capsys):
    from nbaccel.persistent.cell_view import CellView

    for took, shown in ((0.5, False), (12.0, True)):
        state = make_state(2)
        state.ranks[0].status = RankStatus.FINISHED  # an earlier cell's rank: not this cell's
        view = CellView()
        view.start(state)
        state.ranks[1].status, state.ranks[1].rss = RankStatus.FINISHED, 300 << 20
        state.ended_at = state.started_at + took
        view.finish()
        out = capsys.readouterr().out
        assert out == ("nbaccel: rank 1 finished in 12.0 s · RSS 300 MiB\n" if shown else ""), out


def test_header_says_what_the_launch_waits_for_and_its_clock_ticks():
    state = make_state(2)
    state.waiting_for, state.waiting_since = "fork server: importing torch._dynamo", 1000.0
    first, later = table.header_html(state, now=1001.4), table.header_html(state, now=1002.9)
    assert "waiting for fork server: importing torch._dynamo (1.4 s)" in first
    assert "(2.9 s)" in later and "elapsed <b>2.9 s</b>" in later  # the clock ticks
    assert "data-outcome='waiting'" in first
    state.waiting_since = 1000.5  # waited 30 s and more: still not a stall
    assert summary.stall_text(state, now=1040.0) == ""
    state.waiting_for = None  # the ranks are starting
    assert "waiting" not in table.header_html(state, now=1003.0)


def test_text_view_says_what_it_waits_for_once_per_change_and_when_the_wait_doubles(capsys):
    from nbaccel.ui.text import TextView

    state = make_state(2, t0=time.monotonic())
    view = TextView(progress_interval=0.0)
    view.start(state)
    capsys.readouterr()
    state.waiting_for, state.waiting_since = "fork server: importing torch", time.monotonic() - 1.4
    for _ in range(5):  # updates every 0.25 s or faster while waiting
        view.update()
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 1 and re.fullmatch(
        r"nbaccel: waiting for fork server: importing torch \(1\.[45] s\)", out[0]
    ), out
    state.waiting_for = "fork server: importing torch._dynamo"
    view.update()
    view.update()
    assert capsys.readouterr().out.count("importing torch._dynamo (") == 1
    state.waiting_since -= 10.0  # the same wait went on: said again once it doubled
    view.update()
    view.update()
    assert capsys.readouterr().out.count("importing torch._dynamo (11.") == 1


def test_text_view_without_progress_does_not_say_what_it_waits_for(capsys):
    # progress=False shows the headline and the ranks' lines only; the waiting lines leaked
    # through it (and, in a background launch, into whatever the caller printed next).
    from nbaccel.ui.text import TextView

    state = make_state(2, t0=time.monotonic())
    view = TextView(show_progress=False, progress_interval=0.0)
    view.start(state)
    assert capsys.readouterr().out.startswith("nbaccel: launching")
    state.waiting_for, state.waiting_since = "fork server: importing torch", time.monotonic() - 3
    view.update()
    view.output(0, "stdout", ["hello"])
    view.finish()
    assert capsys.readouterr().out.splitlines() == [f"{state.info.label(0)}hello"]


def test_text_view_prints_an_unchanged_run_line_once(capsys):
    from nbaccel.ui.text import TextView

    state = make_state(1, t0=time.monotonic())
    view = TextView(progress_interval=0.0)
    view.start(state)
    state.ranks[0].on_progress(0, 0, 50, "train", 0.0)  # the first step is slow (compiling)
    for _ in range(4):
        view.update()
        time.sleep(0.01)
    out = capsys.readouterr().out
    assert out.count("nbaccel run: step 0/50") == 1, out
    state.ranks[0].on_progress(0, 1, 50, "train", 3.0)
    view.update()
    assert capsys.readouterr().out.count("nbaccel run: step 1/50") == 1


def test_eta_holds_still_while_a_step_takes_long():
    rank = make_state(1).ranks[0]
    rank.on_progress(0, 0, 100, None, 0.0, now=1000.0)
    for n in range(1, 21):  # 20 steps at 10 a second
        rank.on_progress(0, n, 100, None, n / 10, now=1000.0 + n / 10)
    at_last_step = rank.eta(now=1002.0)
    assert at_last_step is not None and 7.5 < at_last_step < 8.5  # 80 steps at 10/s
    assert rank.eta(now=1020.0) == at_last_step  # 18 s into a long step: not 20 s more
    rank.on_progress(0, 21, 100, None, 20.0, now=1020.0)  # the long step ended: measured again
    assert rank.eta(now=1020.0) != at_last_step


def test_no_stall_while_a_rank_compiles_and_the_row_says_it_compiles():
    state = make_state(2)
    state.stall_after = 30
    state.ranks[0].on_compiling(True, now=1001.0)  # rank 1 waits for it in a collective
    assert summary.stall_text(state, now=1100.0) == ""
    assert "</span> (compiling 1:39)" in table.table_html(state, now=1100.0)
    assert "running (compiling 1:39)" in summary.summary_text(state, now=1100.0)
    state.ranks[0].on_compiling(False, now=1120.0)
    assert summary.stall_text(state, now=1140.0) == ""  # quiet counts from the compile's end
    assert "no rank has advanced for 30.0 s" in summary.stall_text(state, now=1150.0)


def test_a_ranks_cell_keeps_each_ranks_burst_of_lines_together(capsys):
    from nbaccel.persistent.cell_view import BURST_QUIET, CellView

    state = make_state(2, t0=time.monotonic())
    view = CellView()
    view.start(state)
    for i in range(3):  # both ranks print a three-line block at once; their lines arrive mixed
        view.output(0, "stdout", [f"rank 0 line {i}"])
        view.output(1, "stdout", [f"rank 1 line {i}"])
        view.update()
    assert capsys.readouterr().out == ""  # the bursts are still coming
    time.sleep(BURST_QUIET + 0.05)
    view.update()
    out = capsys.readouterr().out.splitlines()
    assert out == [f"[rank{r}] rank {r} line {i}" for r in (0, 1) for i in range(3)], out
    view.output(1, "stdout", ["last words"])
    view.finish()  # the cell ended: nothing is held back
    assert capsys.readouterr().out == "[rank1] last words\n"


def test_a_short_ranks_cell_that_stepped_an_optimizer_shows_no_table_or_summary(capsys):
    """Notebook 05's ``%%ranks`` cell with one ``opt.step()`` showed, in JupyterLab, a table
    "optimizer steps: 0" and "finished in 0.0 s", which docs/ranks.md promises only for cells
    that report progress or ran 10 s or more."""
    from nbaccel.persistent.cell_view import CellView
    from nbaccel.rank.reporting import STEP_BAR_DESC

    state = make_state(2, t0=time.monotonic())
    view = CellView(widgets=True)
    view.start(state)
    for rank in (0, 1):
        state.ranks[rank].on_progress(1, 1, None, STEP_BAR_DESC, 0.0)
        state.ranks[rank].status = RankStatus.FINISHED
    view.update()
    state.ended_at = time.monotonic()
    view.finish()
    assert view._dashboard is None
    assert capsys.readouterr().out == ""
