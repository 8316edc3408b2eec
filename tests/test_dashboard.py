"""The widget dashboard in a real kernel: what the frontend receives, and how much of it."""

from __future__ import annotations

import datetime
import re

import pytest

from tests.kernel_helpers import Cell, KernelSession

pytestmark = pytest.mark.slow  # a real kernel

WIDGET_MESSAGES = ("comm_msg", "display_data", "update_display_data")


@pytest.fixture(scope="module")
def kernel():
    with KernelSession(env={"NBACCEL_VIEW": "widgets"}, background_shutdown=True) as k:
        yield k


def widget_states(cell: Cell) -> dict[str, dict]:
    """Each widget's last state, rebuilt from comm_open and comm_msg updates as a frontend would."""
    states: dict[str, dict] = {}
    for m in cell.messages:
        content = m["content"]
        if m["msg_type"] == "comm_open":
            states[content["comm_id"]] = dict(content["data"].get("state", {}))
        elif m["msg_type"] == "comm_msg" and content["data"].get("method") == "update":
            states.setdefault(content["comm_id"], {}).update(content["data"]["state"])
    return states


def rank_rows(markup: str) -> dict[int, dict[str, str]]:
    rows = {}
    for tag in re.findall(r"<tr class='nbaccel-rank'[^>]*>", markup):
        attrs = dict(re.findall(r"data-(\w+)='([^']*)'", tag))
        rows[int(attrs["rank"])] = attrs
    return rows


def sent_at(msg: dict) -> float:
    date = msg["header"]["date"]
    if isinstance(date, str):
        date = datetime.datetime.fromisoformat(date)
    return date.timestamp()


TRAIN = """
import time
import nbaccel

def train(steps):
    for i in nbaccel.progress(range(steps), desc="train"):
        if i % 250 == 0:
            nbaccel.log({"loss": 1.0 / (i + 1)}, step=i)
        time.sleep(0.0003)  # stands in for a fast training step
    print("done")
    return steps

result = nbaccel.notebook_launcher(train, args=(5000,), num_processes=2)
print("result", result)
"""


def test_two_rank_launch_ends_finished_and_stays_within_message_budget(kernel):
    cell = kernel.execute(TRAIN)
    assert cell.error is None, cell.error_text
    assert "result 5000" in cell.stdout

    live = [
        s["value"]
        for s in widget_states(cell).values()
        if "nbaccel-live" in str(s.get("value", ""))
    ]
    assert len(live) == 1, "one live table widget"
    rows = rank_rows(live[0])
    assert sorted(rows) == [0, 1]
    for attrs in rows.values():
        assert attrs["status"] == "finished"
        assert attrs["n"] == attrs["total"] == "5000"
    panes = [
        s["value"]
        for s in widget_states(cell).values()
        if "nbaccel-pane" in str(s.get("value", ""))
    ]
    assert len(panes) == 2 and all("done" in p for p in panes)
    charts = [
        s["value"]
        for s in widget_states(cell).values()
        if "nbaccel-chart" in str(s.get("value", ""))
    ]
    assert charts and "polyline" in charts[0]

    # In place of the widget, a static summary that a saved notebook keeps.
    final = cell.of_type("update_display_data")[-1]["content"]["data"]
    assert rank_rows(final["text/html"]) and all(
        a["status"] == "finished" for a in rank_rows(final["text/html"]).values()
    )
    assert "finished" in final["text/plain"] and "5000/5000" in final["text/plain"]

    sent = [m for m in cell.messages if m["msg_type"] in WIDGET_MESSAGES]
    duration = sent_at(sent[-1]) - sent_at(sent[0])
    print(f"widget messages: {len(sent)} in {duration:.2f} s")
    # ~20 a second at most, plus the display at start and the final flush.
    assert len(sent) <= 20 * max(duration, 1.0) + 10, (len(sent), duration)
    assert duration > 1.0, "the loop should run long enough to exercise the throttle"
    # In any one second: the budget (14 + a burst of 4), the display, and the final flush.
    times = [sent_at(m) for m in sent]
    busiest = max(sum(1 for u in times if t <= u < t + 1.0) for t in times)
    assert busiest <= 25, busiest
    assert not kernel.leftovers()


def test_failed_rank_row_is_red_with_error_line(kernel):
    cell = kernel.execute(
        """
import nbaccel
def boom():
    import os
    if os.environ["RANK"] == "1":
        raise ValueError("bad batch")
    return 1
try:
    nbaccel.notebook_launcher(boom, num_processes=2)
except Exception as exc:
    print("raised", type(exc).__name__)
"""
    )
    assert cell.error is None, cell.error_text
    assert "raised RankFailedError" in cell.stdout
    final = cell.of_type("update_display_data")[-1]["content"]["data"]["text/html"]
    assert rank_rows(final)[1]["status"] == "failed"
    live = next(
        s["value"]
        for s in widget_states(cell).values()
        if "nbaccel-live" in str(s.get("value", ""))
    )
    assert rank_rows(live)[1]["status"] == "failed"
    assert "class='nbaccel-error' data-rank='1'" in live and "ValueError: bad batch" in live
    assert "rgba(207,34,46" in live  # the red row
    assert not kernel.leftovers()


def live_tables(cell: Cell) -> list[str]:
    """Every value the live table widget had, in order (what the frontend showed over time)."""
    values = []
    for m in cell.messages:
        content = m["content"]
        state = None
        if m["msg_type"] == "comm_open":
            state = content["data"].get("state", {})
        elif m["msg_type"] == "comm_msg" and content["data"].get("method") == "update":
            state = content["data"]["state"]
        if state and "nbaccel-live" in str(state.get("value", "")):
            values.append((m["received_at"], state["value"]))
    return values


def test_failed_rank_traceback_reads_like_a_local_one(kernel):
    cell = kernel.execute(
        """
import nbaccel

def broken_step(batch):
    scale = 2
    return batch["missing"] * scale

def train():
    import os
    if os.environ["RANK"] == "1":
        broken_step({"x": 1})
    return 0

nbaccel.notebook_launcher(train, num_processes=2)
"""
    )
    assert cell.error is not None and cell.error["ename"] == "RankFailedError"
    text = cell.error_text
    n = cell.reply["execution_count"]
    # IPython drops the cell's leading blank line, so line numbers count from "import nbaccel".
    assert f"Cell In[{n}], line 13" in text  # the launching line, as IPython shows it
    assert (
        f"Cell In[{n}], line 10, in train()" in text
        and f"Cell In[{n}], line 5, in broken_step()" in text
    )
    assert '----> 5     return batch["missing"] * scale' in text
    assert "KeyError: 'missing'" in text
    for plumbing in (
        "relay.py",
        "launcher.py",
        "entry.py",
        "ipykernel_",
        "except KeyboardInterrupt",
    ):
        assert plumbing not in text, plumbing
    assert "\x1b[" in "\n".join(cell.error["traceback"])  # coloured in Jupyter
    assert not kernel.leftovers()


def test_live_view_run_line_rates_partial_lines_and_effective_precision(kernel):
    cell = kernel.execute(
        """
import time
import nbaccel

def train():
    import os
    acc = nbaccel.Accelerator(mixed_precision="bf16")
    rank = acc.process_index
    for epoch in nbaccel.progress(range(4), desc="epoch"):
        for i in nbaccel.progress(range(20), desc="batch", unit_scale=4):
            time.sleep(0.03 if rank == 1 else 0.01)  # rank 1 is the straggler
        print(f"\\rcheckpoint {epoch}", end="", flush=True)
        time.sleep(1.3)  # a pause with an unfinished line on screen
    print()
    print("[rank%d]:W1201 a torch-style warning" % rank)
    return 0

nbaccel.notebook_launcher(train, num_processes=2)
"""
    )
    assert cell.error is None, cell.error_text
    tables = live_tables(cell)
    t0 = tables[0][0]
    late = [v for t, v in tables if t - t0 > 1.5]
    assert late, "the launch should have lasted more than 1.5 s"
    assert all("class='nbaccel-run'" in v for v in late)
    run_lines = re.findall(r"class='nbaccel-run'[^>]*>([^<]*)<", "".join(late))
    assert any(
        "/80 · epoch" in line and "samples/s" in line and "ETA" in line for line in run_lines
    )
    for v in late:  # after the first second, every running rank shows a rate
        for attrs in rank_rows(v).values():
            if attrs["status"] == "running":
                assert attrs["rate"] != "-", attrs
    assert any(rank_rows(v)[1]["straggler"] == "1" for v in late)
    assert all("data-precision='bf16'" in v for v in late)

    panes = [
        s.get("value", "")
        for m in cell.of_type("comm_msg", "comm_open")
        for s in [m["content"]["data"].get("state", {})]
        if "nbaccel-pane" in str(s.get("value", ""))
    ]
    assert any("nbaccel-partial" in p and "checkpoint 0" in p for p in panes)
    final = [p for p in panes if "a torch-style warning" in p]
    assert final and all("[rank0]:" not in p and "[rank1]:" not in p for p in final)
    summary = cell.of_type("update_display_data")[-1]["content"]["data"]["text/plain"]
    assert "mixed_precision=bf16 (set in code)" in summary and "run: step 80/80" in summary
    assert not kernel.leftovers()


def test_stall_notice_shows_where_each_rank_waits(kernel):
    cell = kernel.execute(
        """
import os, time
import nbaccel
os.environ["NBACCEL_STALL_AFTER"] = "2"

def train():
    import torch.distributed as dist
    acc = nbaccel.Accelerator()
    if acc.process_index == 0:
        time.sleep(7)  # rank 1 waits in the barrier meanwhile
    dist.barrier()
    return 0

try:
    nbaccel.notebook_launcher(train, num_processes=2)
finally:
    del os.environ["NBACCEL_STALL_AFTER"]
"""
    )
    assert cell.error is None, cell.error_text
    stalls = [
        re.search(r"<pre class='nbaccel-stall'[^>]*>(.*?)</pre>", v, re.S)
        for _, v in live_tables(cell)
    ]
    texts = [m.group(1) for m in stalls if m]
    assert texts and "no rank has advanced" in texts[-1]
    assert any("rank 1: waiting in barrier" in t for t in texts), texts[-1]
    summary = cell.of_type("update_display_data")[-1]["content"]["data"]["text/plain"]
    assert "stalled for up to" in summary
    assert not kernel.leftovers()


def test_frontend_detection_in_a_kernel(kernel):
    cell = kernel.execute(
        """
import os
from nbaccel.ui import frontend, widget_frontend
seen = [frontend()]
for var, value in [("VSCODE_PID", "1"), ("KAGGLE_KERNEL_RUN_TYPE", "Interactive"),
                   ("COLAB_RELEASE_TAG", "release-colab")]:
    os.environ[var] = value
    seen.append(frontend())
for var in ("VSCODE_PID", "KAGGLE_KERNEL_RUN_TYPE", "COLAB_RELEASE_TAG"):
    del os.environ[var]
os.environ["JPY_SESSION_NAME"] = "x.ipynb"
seen.append(frontend())
del os.environ["JPY_SESSION_NAME"]
print(seen)
"""
    )
    assert cell.error is None, cell.error_text
    # A kernel started by jupyter_client alone (like nbclient) is not a widget frontend.
    assert cell.stdout.strip() == "['terminal', 'vscode', 'kaggle', 'colab', 'jupyter']"


def test_launches_leave_no_widget_models_open(kernel):
    # A launch's widgets, and the Layout/Style models ipywidgets makes for them, are kept for
    # the next launch with the same ranks or closed: a run of launches does not add models
    # (they once stayed open: 26 more comms in the kernel per launch).
    cell = kernel.execute(
        """
import nbaccel
from ipywidgets.widgets import widget as _w

def _open_models():
    return len(getattr(_w, "_instances", None) or _w.Widget.widgets)

def quick():
    print("hi")
    return 1

counts = [_open_models()]
for _ in range(3):
    nbaccel.notebook_launcher(quick, num_processes=1)
    counts.append(_open_models())
print("counts", counts)
"""
    )
    assert cell.error is None, cell.error_text
    counts = [int(n) for n in re.search(r"counts \[([\d, ]+)\]", cell.stdout).group(1).split(",")]
    assert len(counts) == 4 and len(set(counts[1:])) == 1, counts  # the same after each launch


def test_a_relaunch_shows_the_same_widgets_again_without_opening_comms(kernel):
    # Opening and closing ~59 comms cost ~25 ms of each two-rank relaunch (issue 34).
    code = """
import nbaccel

def quick(n):
    print("run", n)
    return n

nbaccel.notebook_launcher(quick, args=({n},), num_processes=2)
"""
    first = kernel.execute(code.replace("{n}", "1"))
    assert first.error is None, first.error_text
    again = kernel.execute(code.replace("{n}", "2"))
    assert again.error is None, again.error_text
    assert again.of_type("display_data"), "the relaunch shows its dashboard"
    assert not again.of_type("comm_open") and not again.of_type("comm_close")
    panes = [s.get("value", "") for s in widget_states(again).values()]
    assert any("run 2" in str(p) for p in panes) and not any("run 1" in str(p) for p in panes)
    final = again.of_type("update_display_data")[-1]["content"]["data"]["text/html"]
    assert "[rank1] run 2" in final and "run 1" not in final
