"""The views in Notebook 7 (the `notebook` package), as tests/test_browser*.py check them in
JupyterLab: the live dashboard renders and moves, a rank's ``breakpoint()`` is answered in its
input box, and the static summary, chart included, survives a save and a reload, and reads
right in a copy that is not trusted (a colleague's). One server and one page for all of it.
Screenshots go to test-artifacts/browser/."""

from __future__ import annotations

import pytest

from tests import browser_helpers as bh

pytestmark = [
    pytest.mark.slow,  # Notebook 7 in a real browser
    pytest.mark.skipif(bh.missing() is not None, reason=str(bh.missing())),
]

SETUP = "import nbaccel, time"
# 60 steps logged without step=: the chart's x axis ends at 59 (it ended near 30 before).
LAUNCH = """def train():
    for i in nbaccel.progress(range(60), desc="batch"):
        nbaccel.log({"loss": 1.0 / (i + 1)})
        time.sleep(0.05)
    return "trained"

nbaccel.notebook_launcher(train, num_processes=2)"""
DEBUG = """def paused(n):
    import torch.distributed as dist
    dist.init_process_group('gloo')
    values = [n, n + 1, dist.get_rank()]
    if dist.get_rank() == 1:
        breakpoint()
    dist.barrier()
    return sum(values)

nbaccel.notebook_launcher(paused, args=(3,), num_processes=2)"""
INPUT_BOX = ".jp-Stdin-input"
PROGRESS = ".nbaccel-live tr.nbaccel-rank[data-rank='0']"
ROW_TEXT = "(sel) => (document.querySelector(sel) || {innerText: ''}).innerText"


def test_dashboard_debugger_and_saved_summary_in_notebook_7(tmp_path):
    bh.write_notebook(tmp_path / "nb7.ipynb", [SETUP, LAUNCH, DEBUG])
    with bh.JupyterLab(tmp_path, frontend="notebook") as nb7, bh.chromium_page() as page:
        try:
            page.set_default_timeout(90_000)
            bh.run_all_cells(page, nb7, "nb7.ipynb")

            # The live dashboard renders, then moves on.
            page.wait_for_selector(f"{PROGRESS}[data-status='running']")
            page.wait_for_function(
                f"(sel) => /\\b[1-9]\\d*\\/60/.test(({ROW_TEXT})(sel))", arg=PROGRESS
            )
            first = page.locator(PROGRESS).inner_text()
            page.wait_for_function(
                f"([sel, was]) => ({ROW_TEXT})(sel) !== was", arg=[PROGRESS, first]
            )
            bh.screenshot(page, "notebook7-dashboard-live")
            page.wait_for_selector(".nbaccel-summary tr.nbaccel-rank[data-status='finished']")
            assert page.locator(".jp-OutputArea-output:has-text(\"'trained'\")").count() == 1

            # A rank's pdb, in the cell's input box; the echo reads as typed (one space).
            page.wait_for_selector(f".jp-Stdin:has-text('(Pdb rank 1)') {INPUT_BOX}")
            page.locator(INPUT_BOX).last.fill("p values")
            page.locator(INPUT_BOX).last.press("Enter")
            page.wait_for_selector(".jp-OutputArea-output:has-text('[3, 4, 1]')")
            echo = page.locator(".jp-OutputArea-output:has-text('p values')").first.inner_text()
            assert "(Pdb rank 1) p values" in echo, repr(echo)
            page.wait_for_function(f"document.querySelectorAll('{INPUT_BOX}').length >= 1")
            page.locator(INPUT_BOX).last.fill("c")
            page.locator(INPUT_BOX).last.press("Enter")
            page.wait_for_selector(".jp-OutputArea-executeResult:has-text('7')")
            bh.screenshot(page, "notebook7-debugged")

            # Saved and reloaded: the static summary, its chart to the last step.
            saved = bh.save_and_wait(page, tmp_path / "nb7.ipynb", "nbaccel-summary")
            bh.open_notebook(page, nb7, "nb7.ipynb")
            chart = bh.saved_chart(page)
            assert ">59</text>" in chart["svg"] and ">step</text>" in chart["svg"], chart["svg"]
            assert page.locator(".nbaccel-summary").first.locator("tr.nbaccel-rank").count() == 2
            bh.screenshot(page, "notebook7-reloaded")

            # A colleague's copy (not trusted): the same chart, no loose labels.
            bh.as_sent_by_a_colleague(saved, tmp_path / "colleague.ipynb")
            bh.open_notebook(page, nb7, "colleague.ipynb")
            chart = bh.saved_chart(page)
            assert ">59</text>" in chart["svg"], chart["svg"]
            assert "rank 0rank 1" not in chart["text"] and "step59" not in chart["text"], chart
            rows = page.locator(".nbaccel-summary").first.locator("tr")
            assert rows.count() == 3  # the header and 2 ranks
            # Shown as untrusted indeed: the sanitizer took the data- attributes off the rows.
            assert page.locator(".nbaccel-summary tr[data-status]").count() == 0
            bh.screenshot(page, "notebook7-untrusted")
        except Exception:
            bh.screenshot(page, "notebook7-failure")
            raise
