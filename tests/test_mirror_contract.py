"""The mirror's contract, in real kernels: what the kernel imported is imported in the fork
server while the kernel idles (as the person writes the next cell), whatever the number of
modules; checked through the server (a rank forked from it), not by timing."""

from __future__ import annotations

import contextlib
import html
import os
import pathlib
import re
import textwrap
import time
from collections.abc import Iterator

import pytest

from tests.kernel_helpers import KernelSession

pytestmark = pytest.mark.slow  # real kernels

PACKAGES, MODULES = 30, 100  # 3,030 modules: about what `import transformers, datasets` loads
PREFIX = "nbgen_p"


def value(kernel: KernelSession, code: str, timeout: float = 240):
    cell = kernel.execute(textwrap.dedent(code).strip(), timeout=timeout)
    assert cell.error is None, cell.error_text
    return eval(cell.results[-1]["text/plain"])


@contextlib.contextmanager
def user_site_kernel(
    tmp_path, env=None, background_shutdown: bool = False
) -> Iterator[tuple[KernelSession, pathlib.Path]]:
    """A kernel whose user site folder (a site-packages folder: mirrored) is under tmp_path;
    ``background_shutdown`` as :class:`KernelSession`'s."""
    home = tmp_path / "userbase"
    with KernelSession(
        env={"NBACCEL_VIEW": "text", "PYTHONUSERBASE": str(home), **(env or {})},
        startup="import site, sys, time, importlib\n0",
        background_shutdown=background_shutdown,
    ) as kernel:
        user_site = value(kernel, "site.getusersitepackages()")
        folder = home / user_site[len(str(home)) + 1 :]
        folder.mkdir(parents=True)
        value(kernel, f"sys.path.append({user_site!r})\n0")
        yield kernel, folder


def _generate(folder) -> list[str]:
    names = []
    for p in range(PACKAGES):
        package = folder / f"{PREFIX}{p:02d}"
        package.mkdir()
        (package / "__init__.py").write_text("VALUE = 0\n")
        names.append(package.name)
        for m in range(MODULES):
            (package / f"m{m:03d}.py").write_text(f"VALUE = {m}\n")
            names.append(f"{package.name}.m{m:03d}")
    return names


def test_a_kernel_that_imported_3000_modules_finds_them_all_in_the_server_after_idling(tmp_path):
    with user_site_kernel(tmp_path) as (kernel, folder):
        names = _generate(folder)
        half = len(names) // 2
        began = time.monotonic()
        # Half before `import nbaccel` (they go with the server's start), half after (a cell's).
        value(kernel, f"for n in {names[:half]!r}: importlib.import_module(n)\n0")
        value(kernel, "import nbaccel, nbaccel.forkserver.server as _fs\n0")
        value(kernel, f"for n in {names[half:]!r}: importlib.import_module(n)\n0")
        imports = time.monotonic() - began
        # The kernel idles (the person writes the next cell) for as long as the imports took,
        # and the server's warm-up, many times over; it stops early once everything was answered.
        idle = max(60.0, 10 * imports)
        value(
            kernel,
            f"""
            _until = time.monotonic() + {idle}
            while time.monotonic() < _until and (_fs.SERVER.mirror is None or _fs.SERVER.mirror.pending):
                time.sleep(0.5)
            0
            """,
            timeout=idle + 60,
        )
        # The rank reports what the server had when it forked: the function and its argument
        # name no generated package, so the launch holds for none of them.
        probe = """
        def in_server(reversed_prefix):
            import sys
            prefix = reversed_prefix[::-1]
            return sum(1 for n in sys.modules if n.startswith(prefix))
        0
        """
        value(kernel, probe)
        in_kernel = value(kernel, f"sum(1 for n in sys.modules if n.startswith({PREFIX!r}))")
        assert in_kernel == len(names)
        found = value(
            kernel,
            f"nbaccel.notebook_launcher(in_server, args=({PREFIX[::-1]!r},), num_processes=1)",
        )
        assert found == len(names)


def test_an_import_that_hangs_in_the_server_is_given_up_and_named_once(tmp_path):
    # A package that waits, in a fresh interpreter, for something only the kernel had set up.
    # Launches, even unrelated ones, once all waited ~120 s for it, and again after a Stop.
    deadline = {"NBACCEL_MIRROR_IMPORT_DEADLINE": "3"}
    with user_site_kernel(tmp_path, env=deadline) as (kernel, folder):
        (folder / "hangs_in_server.py").write_text(
            "import os, time\nif os.environ.get('NBACCEL_MIRROR_ADDRESS'):\n    time.sleep(3600)\n"
            "VALUE = 5\n"
        )
        value(kernel, "import nbaccel, nbaccel.forkserver.server as _fs\n0")
        value(kernel, "import nbaccel.core.mp_internals as _mp\n_fs.SERVER.wait_until_ready() or 0")
        value(kernel, "import hangs_in_server\n0")  # the cell's end sends it to the server
        # Launch once the server is inside that import: a launch that came before it began
        # would rightly be answered first and never wait for it (a CI run under load did so).
        under_way = (
            "import time\n_until = time.monotonic() + 60\n"
            "while (_fs.SERVER.mirror.importing or ('',))[0] != 'hangs_in_server'"
            " and time.monotonic() < _until:\n    time.sleep(0.02)\n"
            "(_fs.SERVER.mirror.importing or ('',))[0]"
        )
        assert value(kernel, under_way) == "hangs_in_server"
        value(kernel, "def plain():\n    return 7\n0")
        cell = kernel.execute("nbaccel.notebook_launcher(plain, num_processes=1)", timeout=90)
        assert cell.error is None, cell.error_text
        assert eval(cell.results[-1]["text/plain"]) == 7
        named = [line for line in cell.stderr.splitlines() if "hangs_in_server" in line]
        assert len(named) == 1 and "took over 3 s" in named[0], cell.stderr
        server = value(kernel, "_mp.forkserver_pid()")
        uses = "def uses():\n    import hangs_in_server\n    return hangs_in_server.VALUE\n0"
        value(kernel, uses)
        for _ in range(2):  # the rank imports it itself; the fresh server is kept
            cell = kernel.execute("nbaccel.notebook_launcher(uses, num_processes=1)", timeout=90)
            assert cell.error is None, cell.error_text
            assert eval(cell.results[-1]["text/plain"]) == 5
            assert "hangs_in_server" not in cell.stderr, cell.stderr
        assert value(kernel, "_mp.forkserver_pid()") == server
        assert kernel.leftovers() == []


NOISY = (
    "import os, sys, warnings\n"
    "if os.environ.get('NBACCEL_MIRROR_ADDRESS'):\n"
    "    sys.stdout.write(('noisy line from the server ' * 4 + '\\n') * 20000)\n"
    "    warnings.warn('noisy warning from the server')\n"
)


def test_what_the_server_prints_goes_to_a_bounded_log_never_into_a_cell(tmp_path, monkeypatch):
    # It once put 2 MB on iopub, and its warning reappeared in the next, unrelated cell.
    # ipykernel forwards what its process's file descriptors get (the server inherits them) to
    # the cells, as in a notebook, except under pytest: the kernel must not know it is one.
    monkeypatch.delenv("PYTEST_CURRENT_TEST", raising=False)
    with user_site_kernel(tmp_path) as (kernel, folder):
        (folder / "prints_in_server.py").write_text(NOISY)
        value(kernel, "import nbaccel, nbaccel.forkserver.server as _fs\n0")
        cells = [kernel.execute("import prints_in_server\n0")]
        cells.append(kernel.execute("_fs.SERVER.mirror.wait()\n0", timeout=120))
        value(kernel, "def plain():\n    return 7\n0")
        cells.append(kernel.execute("nbaccel.notebook_launcher(plain, num_processes=1)"))
        cells.append(kernel.execute("time.sleep(2)\n1 + 1"))  # (output forwarded late)
        for cell in cells:
            assert cell.error is None, cell.error_text
            assert "noisy" not in cell.stdout + cell.stderr
        late = [m["content"].get("text", "") for m in kernel.other_messages]
        assert not [text for text in late if "noisy" in text]  # (nor with an earlier cell's)
        log = value(kernel, "_fs.SERVER.log_path")
        assert f"see {log}" in cells[2].stderr  # the launch names it, once
        assert "see " not in cells[3].stderr
        with open(log, encoding="utf-8") as f:
            text = f.read()
        assert "noisy line from the server" in text and len(text) < 1024 * 1024 + 1000
        assert "output past 1,048,576 bytes is not kept" in text
    # The kernel shuts down by itself, so its exit hook removes the log (it used to be
    # terminated first, and the next kernel's sweep removed it)
    assert not os.path.exists(log)


def test_an_installed_module_edited_and_reloaded_runs_edited_in_the_ranks(tmp_path):
    with user_site_kernel(tmp_path) as (kernel, folder):
        module = folder / "edited_pkg.py"
        module.write_text("VALUE = 1\n")
        value(kernel, "import edited_pkg, nbaccel, nbaccel.forkserver.server as _fs\n0")
        value(kernel, "def f():\n    import edited_pkg\n    return edited_pkg.VALUE\n0")
        value(kernel, "_fs.SERVER.mirror.wait()\n0")
        assert value(kernel, "nbaccel.notebook_launcher(f, num_processes=1)") == 1
        module.write_text("VALUE = 22\n")  # (another size: the cached bytecode is not reused)
        assert value(kernel, "importlib.reload(edited_pkg).VALUE") == 22
        assert value(kernel, "nbaccel.notebook_launcher(f, num_processes=2)") == 22
        assert value(kernel, "_fs.SERVER.mirror.answers['edited_pkg']['ok']")


SLOW_IN_SERVER = (
    "import os, time\nif os.environ.get('NBACCEL_MIRROR_ADDRESS'):\n    time.sleep(2)\n"
)
FOR_FUNCTION = re.compile(
    r"fork server: importing slow_pkg for your function \(\d+ of \d+ modules\)"
)
WAITED = re.compile(r"(.*) \((\d+(?:\.\d+)?) s\)")  # waiting_text: what, then its seconds


@contextlib.contextmanager
def first_launch_while_warming(tmp_path, view: str, before: str = "0") -> Iterator[KernelSession]:
    """A kernel showing ``view`` whose first launch (of ``f``, which imports a package the
    server takes 2 s to import) runs at once after ``import nbaccel``: while the server warms
    (torch, then torch._dynamo), then holds for the function's package."""
    env = {"NBACCEL_VIEW": view}
    with user_site_kernel(tmp_path, env, background_shutdown=True) as (kernel, folder):
        (folder / "slow_pkg.py").write_text(SLOW_IN_SERVER)
        define = """
        def f():
            import slow_pkg, time
            time.sleep(0.5)  # the ranks run for a moment: the view shows them running
            return 3
        0
        """
        value(kernel, define)
        value(kernel, before)
        value(kernel, "import slow_pkg, nbaccel\n0")  # the server starts warming now
        yield kernel


def test_the_view_hears_what_the_first_launch_waits_for_while_the_server_warms(tmp_path):
    # The view drew once and then nothing for seconds while the server imported torch and
    # the function's packages; now it is told what is waited for, and updated meanwhile.
    spy = """
    import nbaccel.ui.text as _text
    _heard = []
    _update = _text.TextView.update
    def _spy(self):
        _heard.append((self._state.waiting_for, self._state.waiting_since is not None))
        return _update(self)
    _text.TextView.update = _spy
    0
    """
    with first_launch_while_warming(tmp_path, "text", before=spy) as kernel:
        cell = kernel.execute("nbaccel.notebook_launcher(f, num_processes=1)")
        assert cell.error is None, cell.error_text
        assert eval(cell.results[-1]["text/plain"]) == 3
        heard = value(kernel, "_heard")
        waits = [w for w, _ in heard if w is not None]
        assert any(w.startswith("fork server: importing torch") for w in waits), heard
        assert any(FOR_FUNCTION.fullmatch(w) for w in waits), set(heard)
        assert len(waits) >= 5  # about every 0.2 s, over ~2 s at least
        assert all(since for w, since in heard if w is not None)
        last = max(i for i, (w, _) in enumerate(heard) if w is not None)
        assert heard[last + 1 :] and all(w is None for w, _ in heard[last + 1 :])  # cleared
        # What the cell shows: a line when what is waited for changes (at most every 2 s) or
        # the wait has doubled, each with its seconds, printed as the wait goes on, not at its
        # end. (Which wait the later lines name depends on the server's pace: not asserted.)
        printed = [
            (m["received_at"], line[len("nbaccel: waiting for ") :])
            for m in cell.of_type("stream")
            for line in m["content"]["text"].splitlines()
            if line.startswith("nbaccel: waiting for ")
        ]
        said = [WAITED.fullmatch(text) for _, text in printed]
        assert len(printed) >= 2 and all(said), cell.stdout
        assert said[0][1].startswith("fork server: importing torch"), cell.stdout
        for m in said:
            assert m[1].startswith("fork server: importing ") or FOR_FUNCTION.fullmatch(m[1])
        seconds = [float(m[2]) for m in said]
        assert seconds == sorted(seconds) and seconds[-1] - seconds[0] >= 1.5, cell.stdout
        assert printed[-1][0] - printed[0][0] >= (seconds[-1] - seconds[0]) / 2  # as it waited


def header_frames(cell) -> list[tuple[float, str, str, str]]:
    """Each state of the dashboard's header as the frontend received it, in order: (arrival,
    outcome, elapsed, what it waits for with its seconds or ""), read from the comm_open and
    comm_msg updates of the widget whose value holds the header."""
    frames = []
    for m in cell.of_type("comm_open", "comm_msg"):
        data = m["content"]["data"]
        if m["msg_type"] == "comm_msg" and data.get("method") != "update":
            continue
        markup = str(data.get("state", {}).get("value", ""))
        header = re.search(r"<div class='nbaccel-header' data-outcome='([^']*)'.*?</div>", markup)
        if header is None:
            continue
        elapsed = re.search(r"elapsed <b>([^<]*)</b>", header[0])
        waiting = re.search(r"<span class='nbaccel-waiting'>waiting for (.*?)</span>", header[0])
        frames.append(
            (
                m["received_at"],
                header[1],
                elapsed[1] if elapsed else "",
                html.unescape(waiting[1]) if waiting else "",
            )
        )
    return frames


def test_the_dashboard_header_ticks_and_says_what_the_first_launch_waits_for(tmp_path):
    # The dashboard drew "running · elapsed 0.0 s" and then nothing for 2.5-7 s while the
    # server warmed. Read as the frontend gets it: the header widget's states on iopub.
    with first_launch_while_warming(tmp_path, "widgets") as kernel:
        cell = kernel.execute("nbaccel.notebook_launcher(f, num_processes=1)")
        assert cell.error is None, cell.error_text
        assert eval(cell.results[-1]["text/plain"]) == 3
        frames = header_frames(cell)
        shown = "\n".join(map(str, frames))
        # From the first frame, it says it waits (not "running") and for what.
        assert frames[0][1] == "waiting", shown
        assert frames[0][3].startswith("fork server: importing torch"), shown
        waits = [f for f in frames if f[3]]
        said = [WAITED.fullmatch(f[3]) for f in waits]
        assert all(said), shown
        assert all(f[1] == "waiting" for f in waits), shown
        assert any(FOR_FUNCTION.fullmatch(m[1]) for m in said), shown
        # The clocks tick while it waits (about every 0.2 s over the 2 s hold, at least), in
        # updates that reach the frontend as the wait goes on, not at its end.
        seconds = [float(m[2]) for m in said]
        assert seconds == sorted(seconds) and len(set(seconds)) >= 5, shown  # its own clock
        assert seconds[-1] - seconds[0] >= 1.5 and len({f[2] for f in waits}) >= 5, shown
        assert waits[-1][0] - waits[0][0] >= (seconds[-1] - seconds[0]) / 2, shown
        # Once the ranks run, no more waiting: running, then finished.
        after = frames[frames.index(waits[-1]) + 1 :]
        assert after and not any(f[3] for f in after), shown
        assert "running" in [f[1] for f in after] and after[-1][1] == "finished", shown
