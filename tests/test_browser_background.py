"""A background launch in JupyterLab: its dashboard goes on updating in its own cell while the
next cell runs, and that cell's output stays its own."""

from __future__ import annotations

import time

import pytest

from tests import browser_helpers as bh

pytestmark = [
    pytest.mark.slow,  # JupyterLab in a real browser
    pytest.mark.skipif(bh.missing() is not None, reason=str(bh.missing())),
]

SETUP = "import nbaccel, os, time"
LAUNCH = """def train():
    for i in range(120):
        nbaccel.log({"x": i})
        print("line", i, flush=True)
        time.sleep(0.1)
    return 5

launch = nbaccel.notebook_launcher(train, num_processes=2, block=False)"""
BUSY = "print('other cell'); time.sleep(8); print('other done')"
RESULT = "launch.result()"


def _last_line(page) -> int:
    """The newest ``line N`` rank 0's pane shows (in the launching cell), or -1."""
    text = page.locator(".jp-Notebook .jp-Cell").nth(1).locator(".jp-OutputArea").inner_text()
    numbers = [int(w.split()[1]) for w in text.splitlines() if w.startswith("line ")]
    return max(numbers, default=-1)


def test_a_background_dashboard_updates_while_the_next_cell_runs(tmp_path):
    bh.write_notebook(tmp_path / "bg.ipynb", [SETUP, LAUNCH, BUSY, RESULT])
    with bh.JupyterLab(tmp_path) as lab, bh.chromium_page() as page:
        try:
            page.set_default_timeout(90_000)
            bh.run_all_cells(page, lab, "bg.ipynb")
            busy_cell = page.locator(".jp-Notebook .jp-Cell").nth(2)
            busy_cell.locator(".jp-OutputArea-output:has-text('other cell')").wait_for()
            page.wait_for_function(
                "() => document.querySelector('.nbaccel-pane[data-rank=\"0\"]')"
                " && document.querySelector('.nbaccel-pane[data-rank=\"0\"]')"
                ".innerText.includes('line 3')"
            )
            seen = [_last_line(page)]
            time.sleep(2)
            seen.append(_last_line(page))
            busy_output = busy_cell.locator(".jp-OutputArea").inner_text()
            assert "other done" not in busy_output, "the next cell ended too soon"
            assert seen[1] > seen[0] >= 0, f"the dashboard did not move: {seen}"
            assert "line" not in busy_output
            result = page.locator(".jp-Notebook .jp-Cell").nth(3)
            result.locator(".jp-OutputArea-output:has-text('5')").wait_for(timeout=60_000)
        except Exception:
            bh.screenshot(page, "background-launch-failure")
            raise
