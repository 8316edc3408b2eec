"""A ``%%ranks`` session as a person sees it: JupyterLab in headless Chromium. Cells read as a
REPL's: each rank's lines and ``Out:`` values, no launch header or rank table; the dashboard's
table only for a cell that reports progress; an error as a local one. Screenshots go to
test-artifacts/browser/."""

from __future__ import annotations

import pytest

from tests import browser_helpers as bh

pytestmark = [
    pytest.mark.slow,  # JupyterLab in a real browser
    pytest.mark.skipif(bh.missing() is not None, reason=str(bh.missing())),
]

CELLS = [
    "import nbaccel\n%ranks start -n 2  # gloo on CPU",
    "%%ranks\nx = torch.ones(2) * (accelerator.process_index + 1)\nprint('x is', x)\nx.sum()",
    "%%ranks --rank 1\nprint('only rank', accelerator.process_index)",
    "%%ranks\nimport time\nfor i in nbaccel.progress(range(150), desc='steps'):\n"
    "    time.sleep(0.01)\nprint('ranks cell done')\naccelerator.process_index",
    "%%ranks\nif accelerator.process_index == 1:\n    raise ValueError('only rank 1')",
]  # run-all stops at the error; the ranks end with the kernel
OUTPUT = ".jp-OutputArea-output"


def cell_output(page, index: int) -> str:
    return page.locator(".jp-Notebook .jp-Cell").nth(index).locator(".jp-OutputArea").inner_text()


def test_a_ranks_session_reads_as_a_repl_in_jupyterlab(tmp_path):
    bh.write_notebook(tmp_path / "ranks.ipynb", CELLS)
    with bh.JupyterLab(tmp_path) as lab, bh.chromium_page() as page:
        try:
            page.set_default_timeout(60_000)
            bh.run_all_cells(page, lab, "ranks.ipynb")
            page.wait_for_selector(f"{OUTPUT}:has-text('starting 2 ranks… ready')")
            page.wait_for_selector(".nbaccel-live tr.nbaccel-rank[data-status='running']")
            bh.screenshot(page, "ranks-cell-live")
            page.wait_for_selector(f"{OUTPUT}:has-text('ValueError: only rank 1')")

            first = cell_output(page, 1)
            assert "[rank0] x is tensor([1., 1.])" in first and "[rank1] Out: tensor(4.)" in first
            only = cell_output(page, 2)
            assert only.strip() == "[rank1] only rank 1", only
            assert page.locator(".nbaccel-header").count() == 0  # no launch header anywhere
            assert page.locator(".jp-Notebook .jp-Cell").nth(1).locator("table").count() == 0

            # The progress cell: its table and the lines around it.
            progress = page.locator(".jp-Notebook .jp-Cell").nth(3)
            rows = progress.locator(".nbaccel-summary tr.nbaccel-rank")
            assert rows.count() == 2
            for i in range(2):
                assert rows.nth(i).get_attribute("data-status") == "finished"
                assert "150/150" in rows.nth(i).inner_text()
            text = cell_output(page, 3)
            assert "[rank0] ranks cell done" in text and "[rank0] Out: 0" in text

            error = cell_output(page, 4)
            assert "Cell In[5], line 3" in error and "raise ValueError('only rank 1')" in error
            assert "run_cell_magic" not in error and "<rank cell" not in error
            bh.screenshot(page, "ranks-session")
        except Exception:
            bh.screenshot(page, "failure")
            raise
