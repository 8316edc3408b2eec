"""A flood of rank output in a real kernel, in both views: one 50 MB line, and 500k short lines.

What "bounded" means here, checked for each:
- the cell ends soon after the rank has printed (the views do not slow the launch down);
- what the kernel sends on iopub for the cell is bounded (counted as the JSON of every message
  received), whatever the rank printed;
- the kernel keeps answering: its control channel replies within a second at every moment of the
  flood, and a ``1+1`` sent during the flood on a second client is answered within a second of
  the flood cell's end; an endless flood ends within seconds of an interrupt. (ipykernel runs
  one cell at a time on the shell channel, so while the launch cell runs a ``1+1`` can only
  wait its turn; what it must not do is wait behind a backlog of gigabytes of queued output,
  as it did.);
- the long line reaches the view cut, with the number of bytes dropped, and the end of the
  500k lines is shown;
- the rank's log file has every byte.
"""

from __future__ import annotations

import json
import queue
import threading
import time
import uuid

import pytest

from tests.kernel_helpers import KernelSession

pytestmark = pytest.mark.slow  # real kernels, 50 MB through them

LINE = 50_000_000  # characters in the long line
LINES = 500_000

LONG_LINE = f"""
import sys, nbaccel
def flood():
    sys.stdout.write("S" + "x" * ({LINE} - 2) + "E\\n")
    print("after the long line")
nbaccel.notebook_launcher(flood, num_processes=1)
"""

MANY_LINES = f"""
import nbaccel
def flood():
    for i in range({LINES}):
        print(f"line {{i}}")
    print("the end")
nbaccel.notebook_launcher(flood, num_processes=1)
"""


@pytest.fixture(scope="module", params=["text", "widgets"])
def kernel(request, tmp_path_factory):
    logs = tmp_path_factory.mktemp(f"logs-{request.param}")
    env = {"NBACCEL_VIEW": request.param, "NBACCEL_LOG_DIR": str(logs)}
    with KernelSession(env=env, startup="import nbaccel", background_shutdown=True) as k:
        k.view, k.logs = request.param, logs
        yield k


class Prober(threading.Thread):
    """A second client: sends ``1+1`` at once (it waits behind the running cell), then asks the
    control channel for kernel_info every 0.25 s, timing each answer, until told to stop."""

    def __init__(self, kernel: KernelSession) -> None:
        super().__init__(daemon=True)
        self.client = kernel.manager.client()
        # Its own session id: the socket identity the kernel routes replies by (a clone of the
        # manager's session would take the first client's replies).
        self.client.session.session = uuid.uuid4().hex
        self.client.start_channels(iopub=False, stdin=False, hb=False)
        self.control_waits: list[float] = []
        self.answered_at: float | None = None
        self.result = None
        self.done = threading.Event()

    def run(self) -> None:
        msg_id = self.client.execute("1+1")
        while self.answered_at is None or not self.done.is_set():
            sent = time.monotonic()
            request = self.client.session.msg("kernel_info_request")
            self.client.control_channel.send(request)
            while True:
                reply = self.client.control_channel.get_msg(timeout=30)
                if reply["parent_header"].get("msg_id") == request["header"]["msg_id"]:
                    break
            self.control_waits.append(time.monotonic() - sent)
            try:
                reply = self.client.get_shell_msg(timeout=0.25)
            except queue.Empty:
                continue
            if reply["parent_header"].get("msg_id") == msg_id:
                self.answered_at = time.monotonic()
                self.result = reply["content"]["status"]

    def stop(self) -> None:
        self.done.set()
        self.join(timeout=60)
        self.client.stop_channels()


def sent_bytes(messages: list[dict]) -> int:
    return sum(len(json.dumps(m["content"], default=str)) for m in messages)


def shown_text(kernel: KernelSession, cell) -> str:
    """What the notebook shows of the cell: streams, and the dashboard's final summary."""
    if kernel.view == "text":
        return cell.stdout
    return cell.of_type("update_display_data")[-1]["content"]["data"]["text/plain"]


ENDLESS = """
import nbaccel
def flood():
    i = 0
    while True:
        print(f"line {i}")
        i += 1
nbaccel.notebook_launcher(flood, num_processes=1)
"""


def run_flood(kernel: KernelSession, code: str, interrupt_after: float | None = None):
    prober = Prober(kernel)
    started = time.monotonic()
    flooding, interrupted = [], []

    def on_message(msg: dict) -> None:
        """Interrupt ``interrupt_after`` seconds into the flood (its first lines shown)."""
        if not interrupt_after or interrupted:
            return
        if not flooding and "line 1" in json.dumps(msg["content"]):
            flooding.append(time.monotonic())
        if flooding and time.monotonic() - flooding[0] > interrupt_after:
            interrupted.append(time.monotonic())
            kernel.interrupt()

    prober.start()
    try:
        cell = kernel.execute(code, timeout=120, on_message=on_message)
        ended = time.monotonic()
        deadline = ended + 10
        while prober.answered_at is None and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        prober.stop()
    if interrupt_after:
        assert cell.error and cell.error["ename"] == "KeyboardInterrupt", cell.error_text
        started = interrupted[0]  # what is timed from here is how soon the interrupt ends it
    else:
        assert cell.error is None, cell.error_text
    took, sent = ended - started, sent_bytes(cell.messages)
    print(
        f"{kernel.view}: cell {took:.1f} s, {sent / 1e6:.2f} MB on iopub, {len(cell.messages)} "
        f"messages, control answers within {max(prober.control_waits):.2f} s"
    )
    # ipykernel may abort a request queued behind a cell that raised (the interrupt) or run it.
    assert prober.result in (("ok", "aborted") if interrupt_after else ("ok",)), prober.result
    assert prober.answered_at is not None
    assert prober.answered_at - ended < 1.0, "1+1 waited behind the flood's output"
    assert max(prober.control_waits) < 1.0, prober.control_waits
    return cell, took, sent


def log_of(kernel: KernelSession) -> bytes:
    (path,) = sorted(kernel.logs.glob("*/rank0.stdout.log"), key=lambda p: p.stat().st_mtime)[-1:]
    return path.read_bytes()


def test_one_50_mb_line(kernel):
    cell, took, sent = run_flood(kernel, LONG_LINE)
    assert took < 60
    assert sent < 2_000_000, sent  # 50 MB printed
    text = shown_text(kernel, cell)
    assert f"[line cut here: {LINE - (1 << 16):,} more bytes not shown" in text
    assert "after the long line" in text
    assert f"full output of every rank: {kernel.logs}/" in text  # the summary says where
    data = log_of(kernel)
    assert len(data) == LINE + 1 + len("after the long line\n")
    assert data.startswith(b"Sxxx") and data.endswith(b"xxE\nafter the long line\n")
    assert not kernel.leftovers()


def test_500k_lines(kernel):
    cell, took, sent = run_flood(kernel, MANY_LINES)
    assert took < 90
    assert sent < 4_000_000, sent  # 6.4 MB printed, in 500k lines
    text = shown_text(kernel, cell)
    assert "line 499999" in text and "the end" in text
    if kernel.view == "text":
        assert "lines not shown here (too much output); every line is in" in text
    else:  # the saved summary counts every line printed, not the 1,000 its pane kept
        kept = f"the first {LINES + 1 - 1000:,} are not kept here; every line is in {kernel.logs}/"
        assert f"-- rank 0: the last 20 of {LINES + 1:,} lines ({kept}" in text, text[-3000:]
        html = cell.of_type("update_display_data")[-1]["content"]["data"]["text/html"]
        assert f"show the 990 earlier lines ({kept}" in html
        assert "lines not kept]" not in html  # no count posing as a line the rank printed
    data = log_of(kernel)
    assert data.count(b"\n") == LINES + 1 and data.endswith(b"line 499999\nthe end\n")
    assert not kernel.leftovers()


def test_an_endless_flood_is_interrupted_promptly(kernel):
    cell, took, sent = run_flood(kernel, ENDLESS, interrupt_after=3.0)
    assert took < 10, f"the interrupt took {took:.1f} s to end the cell"
    assert sent < 4_000_000, sent
    assert "launch interrupted; all 1 ranks were stopped" in cell.error_text
    asked = time.monotonic()
    answer = kernel.execute("1+1", timeout=30)
    assert answer.results == [{"text/plain": "2"}] and time.monotonic() - asked < 1.0
    assert not kernel.leftovers()
