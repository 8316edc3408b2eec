"""The dashboard and the config panel as a person sees them: JupyterLab in headless Chromium.

Screenshots go to test-artifacts/browser/ (git-ignored).
"""

from __future__ import annotations

import nbformat
import pytest

from tests import browser_helpers as bh

pytestmark = [
    pytest.mark.slow,  # JupyterLab in a real browser
    pytest.mark.skipif(bh.missing() is not None, reason=str(bh.missing())),
]

SETUP = """import nbaccel
cfg = nbaccel.configure()"""

LAUNCH = """import time

def train(steps):
    for i in nbaccel.progress(range(steps), desc="train", unit_scale=8):
        nbaccel.log({"loss": 1.0 / (i + 1)}, step=i)
        time.sleep(0.01)  # stands in for a training step
    print("rank done")
    return steps

result = nbaccel.notebook_launcher(train, args=(250,), config=cfg)
print("result", result)"""


def test_dashboard_and_config_panel_in_jupyterlab(tmp_path):
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3",
        "language": "python",
    }
    nb.cells = [nbformat.v4.new_code_cell(SETUP), nbformat.v4.new_code_cell(LAUNCH)]
    nbformat.write(nb, tmp_path / "launch.ipynb")
    config_file = tmp_path / "nbaccel.yaml"
    from nbaccel.core.config import LaunchConfig

    LaunchConfig(num_processes=2).save(config_file)  # the saved default the panel starts from

    env = {"NBACCEL_CONFIG_FILE": str(config_file)}
    with bh.JupyterLab(tmp_path, env=env) as lab, bh.chromium_page() as page:
        try:
            page.set_default_timeout(60_000)
            page.goto(lab.url("lab/tree/launch.ipynb"))
            page.wait_for_selector(".jp-NotebookPanel .jp-Cell")
            page.wait_for_function(
                "() => window.jupyterapp && window.jupyterapp.shell.currentWidget"
                " && window.jupyterapp.shell.currentWidget.sessionContext"
                " && window.jupyterapp.shell.currentWidget.sessionContext.session"
                " && window.jupyterapp.shell.currentWidget.sessionContext.session.kernel"
                " && window.jupyterapp.shell.currentWidget.sessionContext.session.kernel.status === 'idle'"
            )
            # Not awaited: the command's promise only settles once every cell has run.
            page.evaluate("() => { window.jupyterapp.commands.execute('notebook:run-all-cells'); }")

            hardware = page.wait_for_selector(".nbaccel-config .nbaccel-hardware")
            assert "CPU:" in hardware.inner_text()
            assert page.locator(".nbaccel-config button:has-text('bf16')").count() == 1
            assert page.locator(".nbaccel-config button:has-text('fp8')").is_disabled()
            page.wait_for_selector(".nbaccel-live tr.nbaccel-rank[data-status='running']")
            bh.screenshot(page, "dashboard-live")

            page.wait_for_function(
                "() => document.querySelectorAll(\"tr.nbaccel-rank[data-status='finished']\").length == 2"
            )
            page.wait_for_selector(".jp-OutputArea-output:has-text('result 250')")
            bh.screenshot(page, "dashboard-finished")
            rows = page.locator(".nbaccel-summary tr.nbaccel-rank")
            assert rows.count() == 2
            for i in range(2):
                assert rows.nth(i).get_attribute("data-status") == "finished"
                assert "250/250" in rows.nth(i).inner_text()
            assert page.locator(".nbaccel-live").count() == 0  # the live widget gave way
        except Exception:
            bh.screenshot(page, "failure")
            raise
