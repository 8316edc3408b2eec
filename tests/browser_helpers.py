"""Run JupyterLab or Notebook 7 on 127.0.0.1 and drive it with headless Chromium (Debian's,
via Playwright).

Example::

    with JupyterLab(tmp_path) as lab, chromium_page() as page:
        page.goto(lab.url("lab/tree/test.ipynb"))
    with JupyterLab(tmp_path, frontend="notebook") as nb7, chromium_page() as page:
        run_all_cells(page, nb7, "test.ipynb")
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"]
REPO = Path(__file__).resolve().parent.parent
ARTIFACTS = REPO / "test-artifacts" / "browser"


def missing() -> str | None:
    """Why the browser tests cannot run here, or ``None``."""
    if not (Path(CHROMIUM).exists() or shutil.which("chromium")):
        return "Debian's chromium is not installed (apt-get install -y chromium)"
    for module, package in (
        ("playwright", "playwright"),
        ("jupyterlab", "jupyterlab"),
        ("notebook", "notebook"),
    ):
        try:
            __import__(module)
        except ImportError:
            return f"{package} is not installed (pip install jupyterlab playwright)"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class JupyterLab:
    """A JupyterLab server in ``root``; on exit it, its kernels and their children are gone.
    ``frontend="notebook"``: Notebook 7's server instead (the same views, its own pages)."""

    def __init__(
        self, root: Path, env: dict[str, str] | None = None, frontend: str = "lab"
    ) -> None:
        assert frontend in ("lab", "notebook"), frontend
        self.frontend = frontend
        self.root = root
        self.token = secrets.token_hex(16)
        self.port = _free_port()
        self.env = env or {}
        self.process: subprocess.Popen[bytes] | None = None
        self.log = root / "jupyterlab.log"

    def url(self, path: str = "") -> str:
        sep = "&" if "?" in path else "?"
        return f"http://127.0.0.1:{self.port}/{path}{sep}token={self.token}"

    def __enter__(self) -> JupyterLab:
        env = {**os.environ, **self.env}
        env["PYTHONPATH"] = os.pathsep.join(p for p in [str(REPO), env.get("PYTHONPATH")] if p)
        env["JUPYTER_CONFIG_DIR"] = str(self.root / ".jupyter")  # no user settings leak in
        env["JUPYTER_RUNTIME_DIR"] = str(self.root / ".runtime")
        # No "get notified about Jupyter news?" toast over the page being screenshotted.
        settings = self.root / ".jupyter/lab/user-settings/@jupyterlab/apputils-extension"
        settings.mkdir(parents=True, exist_ok=True)
        (settings / "notification.jupyterlab-settings").write_text('{"fetchNews": "false"}')
        cmd = [
            sys.executable, "-m", "jupyterlab" if self.frontend == "lab" else "notebook",
            "--ServerApp.ip=127.0.0.1",
            f"--ServerApp.port={self.port}",
            "--ServerApp.port_retries=0",
            f"--IdentityProvider.token={self.token}",
            f"--ServerApp.root_dir={self.root}",
            "--ServerApp.open_browser=False",
        ]  # fmt: skip
        if self.frontend == "lab":
            cmd += [
                "--LabApp.news_url=",
                "--LabApp.expose_app_in_browser=True",  # lets the test run cells by command
                "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
            ]
        else:
            cmd += ["--JupyterNotebookApp.expose_app_in_browser=True"]
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            cmd.append("--allow-root")  # CI containers run as root
        self._log_file = open(self.log, "wb")  # noqa: SIM115 - closed in __exit__
        self.process = subprocess.Popen(
            cmd, cwd=self.root, env=env, stdout=self._log_file, stderr=subprocess.STDOUT
        )
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"JupyterLab exited:\n{self.log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(self.url("api/status"), timeout=5) as r:
                    if r.status == 200:
                        return self
            except OSError:
                pass
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=0.25)  # doubles as the pause between polls
        self.__exit__()
        raise TimeoutError(f"JupyterLab did not answer in 120 s:\n{self.log.read_text()[-3000:]}")

    def __exit__(self, *exc: object) -> None:
        if self.process is None:
            return
        try:
            family = psutil.Process(self.process.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            family = []
        self.process.terminate()  # the server shuts its kernels down on the way out
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)
        alive = [p for p in family if p.is_running()]
        for p in alive:
            with contextlib.suppress(psutil.Error):
                p.kill()
        psutil.wait_procs(alive, timeout=10)
        self._log_file.close()
        self.process = None


@contextlib.contextmanager
def chromium_page(width: int = 1400, height: int = 1000) -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(
            executable_path=CHROMIUM if Path(CHROMIUM).exists() else shutil.which("chromium"),
            args=CHROMIUM_ARGS,
        )
        try:
            page = browser.new_page(viewport={"width": width, "height": height})
            yield page
        finally:
            browser.close()


def screenshot(page: Any, name: str) -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    return path


def write_notebook(path: Path, cells: list[str]) -> Path:
    """A notebook of code ``cells`` for the python3 kernel."""
    import nbformat

    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3",
        "language": "python",
    }
    nb.cells = [nbformat.v4.new_code_cell(c) for c in cells]
    nbformat.write(nb, path)
    return path


def notebook_url(lab: JupyterLab, name: str) -> str:
    """Where the frontend opens notebook ``name``."""
    # ?reset: JupyterLab opens only this notebook, not the tabs its workspace had open
    return lab.url(f"lab/tree/{name}?reset" if lab.frontend == "lab" else f"notebooks/{name}")


def open_notebook(page: Any, lab: JupyterLab, name: str) -> None:
    """Open notebook ``name`` and wait until its cells are on the page (not its kernel)."""
    page.goto(notebook_url(lab, name))
    page.wait_for_selector(".jp-NotebookPanel .jp-Cell")


def run_command(page: Any, command: str) -> None:
    """Start one of the frontend's commands (e.g. ``docmanager:save``); not awaited."""
    page.evaluate(f"() => {{ window.jupyterapp.commands.execute({command!r}); }}")


def run_all_cells(page: Any, lab: JupyterLab, name: str) -> None:
    """Open notebook ``name`` in the frontend, wait for its kernel, and start running every cell
    (not awaited: the command's promise only settles once every cell has run)."""
    open_notebook(page, lab, name)
    page.wait_for_function(
        "() => { const w = window.jupyterapp && window.jupyterapp.shell.currentWidget;"
        " const k = w && w.sessionContext && w.sessionContext.session"
        " && w.sessionContext.session.kernel; return !!k && k.status === 'idle'; }"
    )
    run_command(page, "notebook:run-all-cells")


# The saved summary's first chart, as the page shows it: loaded (an image that decodes), its
# SVG's text, and what the summary reads as text (where an inline <svg> was stripped, its
# labels ran together in there: "loss10.0170step30rank 0rank 1").
SAVED_CHART = """() => {
    const summary = document.querySelector(
        '.jp-NotebookPanel:not(.lm-mod-hidden) .nbaccel-summary');  // the notebook in view
    const chart = summary && summary.querySelector('img.nbaccel-chart');
    if (!chart || !chart.complete) return null;
    return {width: chart.naturalWidth, svg: atob(chart.src.split(',')[1]),
            text: summary.innerText, inlineSvg: summary.querySelectorAll('svg').length};
}"""


def save_and_wait(page: Any, path: Path, marker: str) -> dict[str, Any]:
    """Save the open notebook and wait until the file at ``path`` holds ``marker``."""
    import nbformat

    before = path.stat().st_mtime_ns
    run_command(page, "docmanager:save")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if path.stat().st_mtime_ns != before and marker in path.read_text():
            return nbformat.read(path, as_version=4)
        time.sleep(0.1)
    raise TimeoutError(f"{path.name} was not saved with {marker!r} within 60 s")


def as_sent_by_a_colleague(saved: dict[str, Any], path: Path) -> Path:
    """The saved notebook as another person's copy: not trusted here (its signature is of
    other content), so the frontend shows its HTML sanitized, as a colleague's notebook."""
    import nbformat

    saved.metadata["sent_by"] = "a colleague"
    nbformat.write(saved, path)
    return path


def saved_chart(page: Any) -> dict[str, Any]:
    """Wait for the saved summary's chart to load; what :data:`SAVED_CHART` says of it."""
    page.wait_for_function(f"({SAVED_CHART})() && ({SAVED_CHART})().width > 0")
    return page.evaluate(SAVED_CHART)
