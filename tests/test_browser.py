"""The dashboard and the config panel as a person sees them: JupyterLab in headless Chromium.

Screenshots go to test-artifacts/browser/ (git-ignored).
"""

from __future__ import annotations

import pytest

from tests import browser_helpers as bh

pytestmark = [
    pytest.mark.slow,  # JupyterLab in a real browser
    pytest.mark.skipif(bh.missing() is not None, reason=str(bh.missing())),
]

SETUP = """import nbaccel
cfg = nbaccel.configure()"""

LAUNCH = """import time

def train(epochs):
    rank = nbaccel.Accelerator().process_index
    for epoch in nbaccel.progress(range(epochs), desc="epoch"):
        for i in nbaccel.progress(range(25), desc="batch", unit_scale=8):
            step = epoch * 25 + i
            nbaccel.log({"loss": 1.0 / (step + 1), "lr": 0.011 - step * 5e-6}, step=step)
            # rank 1 is slower on purpose: the dashboard marks it as a straggler
            time.sleep(0.04 if rank == 1 else 0.01)
            for k in range(3):
                print(f"epoch {epoch} batch {i} line {k}")
    print("rank done")
    return epochs

result = nbaccel.notebook_launcher(train, args=(16,), config=cfg)
print("result", result)"""

STALL = """import os
os.environ["NBACCEL_STALL_AFTER"] = "3"

def wait_in_barrier():
    import torch.distributed as dist
    acc = nbaccel.Accelerator()
    if acc.process_index == 0:
        time.sleep(9)  # rank 1 waits in the barrier meanwhile
    dist.barrier()

nbaccel.notebook_launcher(wait_in_barrier, config=cfg)
del os.environ["NBACCEL_STALL_AFTER"]"""

FAIL = """def broken_step(batch):
    return batch["missing"]

def fails():
    import os
    if os.environ["RANK"] == "1":
        broken_step({})

nbaccel.notebook_launcher(fails, config=cfg)"""

PANE_AT_TAIL = """(rank) => {
    const pane = document.querySelector(`.nbaccel-live-panes .nbaccel-pane[data-rank='${rank}']`)
        || document.querySelector(`.nbaccel-pane[data-rank='${rank}']`);
    const box = pane.closest('.nbaccel-pane-box');
    const last = pane.lastElementChild.getBoundingClientRect();
    const frame = box.getBoundingClientRect();
    return {atTail: last.bottom <= frame.bottom + 2 && last.top >= frame.top - 2,
            scrollTop: box.scrollTop, scrollHeight: box.scrollHeight, height: box.clientHeight};
}"""


# When the config panel (the cell before the first launch) and the launch's live view first
# appear, recorded in the page from its start.
FIRST_APPEARANCE = """() => {
    window.nbaccelSeen = {};
    new MutationObserver(() => {
        for (const [name, selector] of [["config", ".nbaccel-config"], ["live", ".nbaccel-live"]]) {
            if (!window.nbaccelSeen[name] && document.querySelector(selector)) {
                window.nbaccelSeen[name] = performance.now();
            }
        }
    }).observe(document, {childList: true, subtree: true});
}"""


# How far each rank's metrics cell runs past the output area's right edge (px).
METRICS_OVERFLOW = """() => [...document.querySelectorAll('.nbaccel-live tr.nbaccel-rank')].map(row => {
    const cell = row.lastElementChild.getBoundingClientRect();
    const area = row.closest('.jp-OutputArea-output').getBoundingClientRect();
    return cell.right - area.right;
})"""


def show(page, selector: str) -> None:
    """Scroll the notebook so that ``selector`` is on screen (the notebook scrolls, not the page),
    for a screenshot. A view replaced meanwhile (its launch ended: the live view becomes the
    summary) has nothing left to scroll to; what the test asserts is asserted elsewhere."""
    from playwright.sync_api import Error as PlaywrightError

    try:
        page.locator(selector).last.scroll_into_view_if_needed(timeout=10_000)
    except PlaywrightError as exc:
        if "not attached" not in str(exc):
            raise


def test_dashboard_and_config_panel_in_jupyterlab(tmp_path):
    bh.write_notebook(tmp_path / "launch.ipynb", [SETUP, LAUNCH, STALL, FAIL])
    config_file = tmp_path / "nbaccel.yaml"
    from nbaccel.core.config import LaunchConfig

    LaunchConfig(num_processes=2).save(config_file)  # the saved default the panel starts from

    env = {"NBACCEL_CONFIG_FILE": str(config_file)}
    with bh.JupyterLab(tmp_path, env=env) as lab, bh.chromium_page() as page:
        try:
            page.set_default_timeout(90_000)
            page.add_init_script(f"({FIRST_APPEARANCE})()")
            bh.run_all_cells(page, lab, "launch.ipynb")

            # The first launch after the import cell shows its view at once, not after the
            # fork server has imported torch (a blank cell for 1.2-2.6 s before).
            page.wait_for_selector(".nbaccel-live")
            show(page, ".nbaccel-live")
            bh.screenshot(page, "launch-first-second")
            seen = page.evaluate("() => window.nbaccelSeen")
            assert seen["live"] - seen["config"] < 1000, f"the live view came late: {seen}"

            hardware = page.wait_for_selector(".nbaccel-config .nbaccel-hardware")
            assert "CPU:" in hardware.inner_text()
            assert page.locator(".nbaccel-config button:has-text('bf16')").count() == 1
            assert page.locator(".nbaccel-config button:has-text('fp8')").is_disabled()
            labels = page.locator(".nbaccel-config .widget-label").all_inner_texts()
            assert "gradient accumulation steps" in labels  # not "gradient accumulation st..."

            # The live view: a run line, a rate on every running rank, a straggler, the tail.
            page.wait_for_selector(".nbaccel-live tr.nbaccel-rank[data-status='running']")
            page.wait_for_function(
                "() => { const rows = document.querySelectorAll("
                "\".nbaccel-live tr.nbaccel-rank[data-status='running']\");"
                " return rows.length == 2 && [...rows].every(r => r.dataset.rate !== '-'); }"
            )
            run = page.locator(".nbaccel-live .nbaccel-run").inner_text()
            assert "step" in run and "/400" in run and "samples/s" in run and "ETA" in run, run
            page.wait_for_selector(
                ".nbaccel-live tr.nbaccel-rank[data-rank='1'] .nbaccel-straggler"
            )
            page.wait_for_selector(".nbaccel-pane[data-rank='0'] span:has-text('line 2')")
            show(page, ".nbaccel-dashboard")
            bh.screenshot(page, "dashboard-live")
            cut = page.evaluate(
                "() => [...document.querySelectorAll('.nbaccel-config button,"
                " .nbaccel-dashboard button')].filter(b => b.scrollWidth > b.clientWidth + 1)"
                ".map(b => b.innerText)"
            )
            assert not cut, f"labels cut short: {cut}"  # e.g. "sh..." or "DEEPS..."
            # Every metric is in view: the column wraps rather than running past the cell.
            overflow = page.evaluate(METRICS_OVERFLOW)
            assert overflow and all(o <= 1 for o in overflow), f"metrics cut off by {overflow} px"
            lr_axis = page.locator(".nbaccel-live .nbaccel-chart[data-metric='lr'] text")
            labels = lr_axis.all_text_contents()
            assert "m" not in "".join(labels[1:3]) and labels[1].startswith("0.01"), labels
            tail = page.evaluate(PANE_AT_TAIL, 0)
            assert tail["atTail"], f"the pane should show its newest line: {tail}"

            page.wait_for_selector(".jp-OutputArea-output:has-text('result 16')")
            rows = page.locator(".nbaccel-summary tr.nbaccel-rank")
            assert rows.count() == 2
            for i in range(2):
                assert rows.nth(i).get_attribute("data-status") == "finished"
                assert "25/25" in rows.nth(i).inner_text()
            assert "(straggler)" in rows.nth(1).inner_text()
            # The ranks' output stays in view: the last lines, labelled; the rest folded above.
            for rank in (0, 1):
                output = page.locator(f".nbaccel-summary .nbaccel-output[data-rank='{rank}']")
                shown = output.locator(":scope > pre").inner_text()
                assert shown.splitlines()[-1] == f"[rank{rank}] rank done", shown
                assert output.locator("details").count() == 1
                assert (
                    output.locator("summary").inner_text().startswith(f"rank {rank}: show the ")
                ), output.locator("summary").inner_text()
            show(page, ".nbaccel-summary .nbaccel-output[data-rank='1']")
            bh.screenshot(page, "dashboard-finished")

            # A stall: no rank advances for 3 s; the notice says where each rank waits.
            stall = page.wait_for_selector(".nbaccel-live .nbaccel-stall:has-text('waiting in')")
            assert "no rank has advanced" in stall.inner_text()
            assert "rank 1: waiting in barrier" in stall.inner_text()
            assert "rank 0: in wait_in_barrier, Cell In[3], line 8" in stall.inner_text()
            show(page, ".nbaccel-live")
            bh.screenshot(page, "stall")

            # A failure: the red row, and the rank's traceback as IPython shows a local one.
            stderr = ".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']"
            page.wait_for_selector(f"{stderr}:has-text('RankFailedError'):has-text('Cell In[')")
            failed = page.locator(".nbaccel-summary tr.nbaccel-rank[data-status='failed']")
            assert failed.count() == 1 and failed.get_attribute("data-rank") == "1"
            colour = failed.locator("td").nth(1).evaluate("td => getComputedStyle(td).color")
            assert colour == "rgb(207, 34, 46)", colour
            error = page.locator(stderr).last.inner_text()
            assert "in rank 1:" in error and "in broken_step()" in error, error
            assert 'return batch["missing"]' in error and "KeyError" in error
            assert "relay.py" not in error and "ipykernel_" not in error
            show(page, stderr)
            bh.screenshot(page, "failure")
            assert page.locator(".nbaccel-live").count() == 0  # every live widget gave way

            # Saved, then opened as a colleague's copy (not trusted): the summary's chart is
            # still a chart (it was loose text: an inline <svg> is stripped there).
            saved = bh.save_and_wait(page, tmp_path / "launch.ipynb", "nbaccel-summary")
            bh.as_sent_by_a_colleague(saved, tmp_path / "colleague.ipynb")
            bh.open_notebook(page, lab, "colleague.ipynb")
            chart = bh.saved_chart(page)
            assert chart["inlineSvg"] == 0 and ">399</text>" in chart["svg"], chart
            assert "rank 0rank 1" not in chart["text"], chart["text"]
            shown = ".jp-NotebookPanel:not(.lm-mod-hidden) .nbaccel-summary tr[data-status]"
            assert page.locator(shown).count() == 0  # untrusted: data- attributes stripped
            bh.screenshot(page, "untrusted-summary")
        except Exception:
            bh.screenshot(page, "failure-of-the-test")
            raise
