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
    with KernelSession(env={"NBACCEL_VIEW": "widgets"}) as k:
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
