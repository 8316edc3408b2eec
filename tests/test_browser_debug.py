"""A rank's ``breakpoint()`` as a person meets it: JupyterLab in headless Chromium shows the
input box for rank 1's pdb in the launching cell; typing into it reaches the rank's frames.
Screenshots go to test-artifacts/browser/."""

from __future__ import annotations

import pytest

from tests import browser_helpers as bh

pytestmark = [
    pytest.mark.slow,  # JupyterLab in a real browser
    pytest.mark.skipif(bh.missing() is not None, reason=str(bh.missing())),
]

CELLS = [
    "import nbaccel, os",
    "def train(n):\n"
    "    import torch.distributed as dist\n"
    "    dist.init_process_group('gloo')\n"
    "    values = [n, n + 1, dist.get_rank()]\n"
    "    if dist.get_rank() == 1:\n"
    "        breakpoint()\n"
    "    dist.barrier()\n"
    "    return sum(values)\n"
    "\n"
    "nbaccel.notebook_launcher(train, args=(3,), num_processes=2)",
]
OUTPUT = ".jp-OutputArea-output"
INPUT_BOX = ".jp-Stdin-input"


def test_typing_into_a_paused_ranks_input_box_reaches_its_pdb(tmp_path):
    bh.write_notebook(tmp_path / "debug.ipynb", CELLS)
    with bh.JupyterLab(tmp_path) as lab, bh.chromium_page() as page:
        try:
            page.set_default_timeout(90_000)
            bh.run_all_cells(page, lab, "debug.ipynb")
            page.wait_for_selector(f".jp-Stdin:has-text('(Pdb rank 1)') {INPUT_BOX}")
            page.wait_for_selector(f"{OUTPUT}:has-text('Cell In[2], line 7, in train()')")
            # The dashboard says where, and the launch holds still meanwhile.
            page.wait_for_selector(".nbaccel-stall:has-text('rank 1 paused in breakpoint()')")
            page.locator(INPUT_BOX).last.fill("p values")
            page.locator(INPUT_BOX).last.press("Enter")
            page.wait_for_selector(f"{OUTPUT}:has-text('[3, 4, 1]')")
            bh.screenshot(page, "rank-pdb")
            page.wait_for_function(f"document.querySelectorAll('{INPUT_BOX}').length >= 2")
            page.locator(INPUT_BOX).last.fill("c")
            page.locator(INPUT_BOX).last.press("Enter")
            page.wait_for_selector(".jp-OutputArea-executeResult:has-text('7')")
        except Exception:
            bh.screenshot(page, "failure")
            raise
