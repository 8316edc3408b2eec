"""A ``%%ranks`` cell as a person sees it: JupyterLab in headless Chromium, the dashboard's rows
for the cell, then each rank's ``Out:`` line. Screenshots go to test-artifacts/browser/."""

from __future__ import annotations

import pytest

from tests import browser_helpers as bh

pytestmark = [
    pytest.mark.slow,  # JupyterLab in a real browser
    pytest.mark.skipif(bh.missing() is not None, reason=str(bh.missing())),
]

CELLS = [
    "import nbaccel\n%ranks start -n 2",
    "%%ranks\nimport time\nfor i in nbaccel.progress(range(150), desc='steps'):\n"
    "    time.sleep(0.01)\nprint('ranks cell done')\naccelerator.process_index",
    "%ranks stop",
]


def test_ranks_cell_in_jupyterlab(tmp_path):
    bh.write_notebook(tmp_path / "ranks.ipynb", CELLS)
    with bh.JupyterLab(tmp_path) as lab, bh.chromium_page() as page:
        try:
            page.set_default_timeout(60_000)
            bh.run_all_cells(page, lab, "ranks.ipynb")
            page.wait_for_selector(".jp-OutputArea-output:has-text('2 ranks ready')")
            page.wait_for_selector(".nbaccel-live tr.nbaccel-rank[data-status='running']")
            bh.screenshot(page, "ranks-cell-live")
            page.wait_for_selector(".jp-OutputArea-output:has-text('[rank1] Out: 1')")
            page.wait_for_selector(".jp-OutputArea-output:has-text('2 ranks stopped')")
            bh.screenshot(page, "ranks-cell-finished")
            rows = page.locator(".nbaccel-summary tr.nbaccel-rank")
            assert rows.count() == 2
            for i in range(2):
                assert rows.nth(i).get_attribute("data-status") == "finished"
                assert "150/150" in rows.nth(i).inner_text()
            assert page.locator(".jp-OutputArea-output:has-text('[rank0] Out: 0')").count() == 1
        except Exception:
            bh.screenshot(page, "failure")
            raise
