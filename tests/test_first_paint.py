"""The first seconds of a launch and what stays once it ended, as a notebook receives them.

A fresh kernel (the first launch after the import cell is the slow one: the fork server may
still import torch) with the widget view: the dashboard's first display comes at once, and a
finished launch's rank output stays in the cell as ``[rankN] …`` lines.
"""

from __future__ import annotations

import time

import pytest

from tests.kernel_helpers import KernelSession

pytestmark = pytest.mark.slow

# s from the execute request: 0.2-0.6 s here; 1.24 s (1.2-2.6 s) when the view came last
FIRST_PAINT = 1.0

PRINTS = """def train(lines):
    import nbaccel
    rank = nbaccel.Accelerator().process_index
    for i in range(lines):
        print(f"line {i} of rank {rank}")
    return rank

nbaccel.notebook_launcher(train, args=({lines},), num_processes=2)"""


@pytest.fixture(scope="module")
def kernel():
    with KernelSession(env={"NBACCEL_VIEW": "widgets"}, background_shutdown=True) as k:
        yield k


def _timed(kernel, code: str):
    sent = time.monotonic()
    return sent, kernel.execute(code)


def _final_html(cell) -> str:
    return cell.of_type("update_display_data")[-1]["content"]["data"]["text/html"]


def test_the_dashboard_shows_at_once_and_short_output_stays_inline(kernel):
    assert kernel.execute("import nbaccel").error is None
    sent, cell = _timed(kernel, PRINTS.replace("{lines}", "2"))
    assert cell.error is None, cell.error_text
    shown = cell.of_type("display_data")
    assert shown, "the launch never showed its view"
    waited = shown[0]["received_at"] - sent
    assert waited < FIRST_PAINT, f"the first display came {waited:.2f} s after the request"
    final = _final_html(cell)
    # Short output is there to read, labelled as the README says, not folded away.
    assert "[rank0] line 1 of rank 0" in final and "[rank1] line 0 of rank 1" in final
    assert "<details" not in final
    assert "lines)" not in final  # no "(1 lines)" fold


def test_long_output_is_folded_with_its_last_lines_shown(kernel):
    cell = kernel.execute(PRINTS.replace("{lines}", "60"))
    assert cell.error is None, cell.error_text
    final = _final_html(cell)
    rank1 = final.split("class='nbaccel-output' data-rank='1'", 1)[1]
    folded, _, shown = rank1.partition("</details>")
    assert "show the 50 earlier lines" in folded
    assert "[rank1] line 0 of rank 1" in folded  # expandable: all of it is there
    assert "[rank1] line 49 of rank 1" not in shown
    assert all(f"[rank1] line {i} of rank 1" in shown for i in range(50, 60))  # in view
    text = cell.of_type("update_display_data")[-1]["content"]["data"]["text/plain"]
    assert "[rank0] line 59 of rank 0" in text
