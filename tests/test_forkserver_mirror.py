"""The fork server mirrors what the kernel imported (``forkserver.mirror``, ``forkserver.importer``), in real
kernels: a rank is sound whatever the kernel imported before ``import nbaccel`` (pyarrow's C-level
type registry is the case that broke when the server was a module-forgetting fork of the kernel),
the kernel's packages are warm in the ranks, an import the server cannot make is skipped, and a
user module edited and reloaded in the kernel arrives edited.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import site
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator

import pytest

from tests.kernel_helpers import KernelSession

pytestmark = pytest.mark.slow  # real kernels


def value(kernel: KernelSession, code: str):
    cell = kernel.execute(textwrap.dedent(code).strip(), timeout=240)
    assert cell.error is None, cell.error_text
    return eval(cell.results[-1]["text/plain"])


# Each import cell comes before `import nbaccel`, as in a Hugging Face notebook; the launched
# function imports the same package and uses its C-level state.
IMPORT_CELLS = {
    "datasets": (
        "import datasets",
        "import datasets\n"
        "    table = datasets.Dataset.from_dict({'x': [[[1, 2]]]},\n"
        "        features=datasets.Features({'x': datasets.Array2D((1, 2), 'int32')}))\n"
        "    return len(table)",
        1,
    ),
    "transformers": (
        "from transformers import Trainer",
        "from transformers import Trainer, TrainingArguments\n    return Trainer.__name__",
        "Trainer",
    ),
    "pyarrow_pandas": (
        "import pyarrow, pandas",
        "import pyarrow, pandas\n"
        "    return int(pyarrow.Table.from_pandas(pandas.DataFrame({'a': [1, 2]})).num_rows)",
        2,
    ),
}


@pytest.mark.parametrize("case", sorted(IMPORT_CELLS))
def test_a_package_imported_before_nbaccel_launches_twice(case):
    before, body, expected = IMPORT_CELLS[case]
    startup = f"{before}\nimport nbaccel"
    with KernelSession(env={"NBACCEL_VIEW": "text"}, startup=startup) as kernel:
        value(kernel, f"def uses():\n    {body}\n\n0")
        for _ in range(2):
            assert value(kernel, "nbaccel.notebook_launcher(uses, num_processes=2)") == expected


# A kernel that imported transformers and pandas, a user module from its working directory, and
# a package from a site folder that refuses to import inside the fork server.
REFUSES = (
    "import os\n"
    "if os.environ.get('NBACCEL_MIRROR_ADDRESS'):\n"
    "    raise RuntimeError('this package does not import in a fork server')\n"
    "VALUE = 'imported in the rank'\n"
)


@pytest.fixture(scope="module")
def hf_kernel(tmp_path_factory):
    home = tmp_path_factory.mktemp("userbase")
    work = tmp_path_factory.mktemp("work")
    (work / "helper_mod.py").write_text("VALUE = 1\n")
    env = {"NBACCEL_VIEW": "text", "PYTHONUSERBASE": str(home)}
    with KernelSession(env=env, startup="import site\nsite.getusersitepackages()") as kernel:
        user_site = value(kernel, "site.getusersitepackages()")
        assert user_site.startswith(str(home)) and user_site != site.getusersitepackages()
        (home / user_site[len(str(home)) + 1 :]).mkdir(parents=True)
        (home / user_site[len(str(home)) + 1 :] / "refuses_server.py").write_text(REFUSES)
        startup = (
            f"import importlib, os, sys\nsys.path.append({user_site!r})\nos.chdir({str(work)!r})\n"
            "from transformers import Trainer\nimport pandas, tqdm.auto, refuses_server\n"
            "import helper_mod\nimport nbaccel\n"
            "import nbaccel.forkserver.server as _fs\n0"
        )
        value(kernel, startup)
        kernel.work = work
        yield kernel


def test_the_kernels_packages_are_warm_in_the_ranks(hf_kernel):
    # A function that refers to transformers finds it loaded already at the first launch (the
    # server imports it before the ranks fork); one that does not find pandas loaded once the
    # server has caught up with the kernel.
    probe = """
    def loaded():
        import sys
        return {n: n in sys.modules for n in ("transformers.trainer", "pandas", "IPython")}

    def trainer_loaded():
        import sys
        warm = "transformers.trainer" in sys.modules
        from transformers import Trainer  # noqa: F401
        return warm
    0
    """
    value(hf_kernel, probe)
    server = value(hf_kernel, "import nbaccel.core.mp_internals as _mp\n_mp.forkserver_pid()")
    assert value(hf_kernel, "nbaccel.notebook_launcher(trainer_loaded, num_processes=2)")
    value(hf_kernel, "_fs.SERVER.mirror.wait() or 0")
    cell = hf_kernel.execute("nbaccel.notebook_launcher(loaded, num_processes=2, return_all=True)")
    assert cell.error is None, cell.error_text
    assert (
        eval(cell.results[-1]["text/plain"])
        == [{"transformers.trainer": True, "pandas": True, "IPython": False}] * 2
    )
    # The same server all along: its mirror kept up with thousands of names (it once ended
    # when its answers outgrew the socket while the kernel ran a cell, and was replaced).
    assert "replacing the fork server" not in cell.stderr, cell.stderr
    assert value(hf_kernel, "_mp.forkserver_pid()") == server


def test_a_rank_forked_after_mirroring_has_nothing_of_the_kernels_side(hf_kernel):
    probe = """
    def kernel_side():
        import builtins, sys, tqdm.auto
        sides = ("IPython", "ipykernel", "zmq", "ipywidgets", "comm", "jupyter_client",
                 "tornado", "traitlets", "debugpy", "pydevd", "nbaccel.launch", "nbaccel.ui",
                 "matplotlib_inline", "nbaccel.forkserver.importer")
        return (sorted(n for n in sys.modules if n.startswith(sides)),
                tqdm.auto.tqdm.__module__, hasattr(builtins, "get_ipython"))
    0
    """
    value(hf_kernel, probe)
    value(hf_kernel, "_fs.SERVER.mirror.wait() or 0")
    modules, tqdm_auto, ipython = value(
        hf_kernel, "nbaccel.notebook_launcher(kernel_side, num_processes=1)"
    )
    # nbaccel.forkserver.importer is loaded (the server imported it) but inert in a rank
    assert [m for m in modules if m != "nbaccel.forkserver.importer"] == []
    assert not tqdm_auto.startswith("tqdm.notebook") and not ipython


def test_an_import_the_server_cannot_make_is_skipped(hf_kernel):
    answer = value(
        hf_kernel,
        "_m = _fs.SERVER.mirror\n_m.wait()\n_m.answers['refuses_server']['error']",
    )
    assert answer == "RuntimeError: this package does not import in a fork server"
    uses = "def uses():\n    import refuses_server, pandas\n    return refuses_server.VALUE\n0"
    value(hf_kernel, uses)
    for _ in range(2):  # the server goes on serving; the rank imports the package itself
        assert value(hf_kernel, "nbaccel.notebook_launcher(uses, num_processes=2)") == (
            "imported in the rank"
        )


def test_a_user_module_edited_and_reloaded_arrives_edited(hf_kernel):
    helper = hf_kernel.work / "helper_mod.py"
    value(hf_kernel, "def from_cell():\n    import helper_mod\n    return helper_mod.VALUE\n0")
    assert value(hf_kernel, "nbaccel.notebook_launcher(from_cell, num_processes=2)") == 1
    helper.write_text("VALUE = 2\n")
    value(hf_kernel, "importlib.reload(helper_mod).VALUE")
    assert value(hf_kernel, "nbaccel.notebook_launcher(from_cell, num_processes=2)") == 2
    assert "helper_mod" not in value(hf_kernel, "_fs.SERVER.mirror.sent")


@pytest.mark.skipif(sys.platform != "linux", reason="the mirror's CUDA check reads /proc maps")
@contextlib.contextmanager
def _kernel_with_a_cuda_loading_package(tmp_path) -> Iterator[KernelSession]:
    """A kernel (with nbaccel imported) that can import ``loads_cuda``, a package from a site
    folder that maps a stand-in ``libcuda.so`` when imported in the fork server."""
    import shutil
    import subprocess

    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler to build a stand-in libcuda.so")
    home = tmp_path / "userbase"
    lib = tmp_path / "libcuda.so.1"
    source = tmp_path / "stub.c"
    source.write_text("int nbaccel_stub(void) { return 1; }\n")
    subprocess.run([compiler, "-shared", "-fPIC", "-o", str(lib), str(source)], check=True)
    env = {"NBACCEL_VIEW": "text", "PYTHONUSERBASE": str(home)}
    with KernelSession(env=env, startup="import site, sys\n0") as kernel:
        user_site = value(kernel, "site.getusersitepackages()")
        folder = home / user_site[len(str(home)) + 1 :]
        folder.mkdir(parents=True)
        (folder / "loads_cuda.py").write_text(
            f"import ctypes, os\nif os.environ.get('NBACCEL_MIRROR_ADDRESS'):\n"
            f"    ctypes.CDLL({str(lib)!r})\n"
        )
        value(kernel, f"sys.path.append({user_site!r})\nimport nbaccel, os, time\n0")
        value(kernel, "import nbaccel.core.mp_internals as _mp\n0")
        value(kernel, "def f():\n    import loads_cuda\n    return 7\n0")
        yield kernel


def test_an_import_that_loads_a_cuda_driver_replaces_the_server(tmp_path):
    """An import that maps a library named libcuda.so into the server makes the next launch
    start from a fresh server that no longer imports it (a fork could not use the GPU)."""
    with _kernel_with_a_cuda_loading_package(tmp_path) as kernel:
        pid = value(kernel, "_mp.forkserver_pid()")
        value(kernel, "import loads_cuda\n0")
        cell = kernel.execute("nbaccel.notebook_launcher(f, num_processes=1)", timeout=240)
        assert cell.error is None, cell.error_text
        assert "loaded CUDA's driver" in cell.stderr, cell.stderr
        assert value(kernel, "_mp.forkserver_pid()") != pid
        assert value(kernel, "nbaccel.notebook_launcher(f, num_processes=1)") == 7


def test_a_server_replaced_under_a_background_launch_keeps_serving_its_ranks(tmp_path):
    """The server breaks (an import loaded CUDA) while a background launch's ranks run from it:
    the next launch starts from a fresh server, and the old one keeps serving those ranks
    (replacing it stopped them) until they end; then it is stopped too."""
    from tests.test_background_launch import _start_recording
    from tests.test_containment import running, wait_until_none_running

    directory = tmp_path / "pids"
    directory.mkdir()
    with _kernel_with_a_cuda_loading_package(tmp_path) as kernel:
        old = value(kernel, "_mp.forkserver_pid()")
        _start_recording(kernel, directory, "background")
        value(kernel, "import loads_cuda\n0")
        cell = kernel.execute("nbaccel.notebook_launcher(f, num_processes=1)", timeout=240)
        assert cell.error is None, cell.error_text
        # The cell's offer got loads_cuda imported, answered and the server's mirror closed
        # before the launch held it: the answer waiting before the close says why.
        assert "replacing the fork server (importing loads_cuda loaded CUDA's driver" in (
            cell.stderr
        ), cell.stderr
        assert value(kernel, "_mp.forkserver_pid()") != old
        assert len(running(directory)) == 4  # both ranks and their children
        assert value(kernel, "background.status") == "running"
        value(kernel, "background.stop(timeout=60)\n0")
        assert wait_until_none_running(directory) == []
        assert value(kernel, f"_mp.server_alive({old})") is False  # stopped once they ended
        assert kernel.leftovers() == []


def test_a_package_imported_after_nbaccel_is_warm_at_the_first_launch():
    # The cell's import reaches the server when the cell ends, not only at the next launch.
    with KernelSession(env={"NBACCEL_VIEW": "text"}, startup="import nbaccel") as kernel:
        value(kernel, "import nbaccel.forkserver.server as _fs\n_fs.SERVER.wait_until_ready() or 0")
        value(kernel, "import pandas\n0")
        assert value(kernel, "'pandas' in _fs.SERVER.mirror.sent")
        value(kernel, "_fs.SERVER.mirror.wait() or 0")
        probe = "def loaded():\n    import sys\n    return 'pandas' in sys.modules\n0"
        value(kernel, probe)
        assert value(kernel, "nbaccel.notebook_launcher(loaded, num_processes=1)") is True


def test_stop_while_a_launch_waits_for_the_server_leaves_it_mirroring(tmp_path):
    # The launch waits for the server to import a slow package its function uses; Stop then
    # must let the server go on (not leave it holding for a launch that never comes).
    home = tmp_path / "userbase"
    # A launch that waits for the server longer than this is no stall (whose stack request
    # would kill ranks forked after the wait, before they can answer it).
    env = {"NBACCEL_VIEW": "text", "PYTHONUSERBASE": str(home), "NBACCEL_STALL_AFTER": "3"}
    with KernelSession(env=env, startup="import site, sys, threading, time\n0") as kernel:
        user_site = value(kernel, "site.getusersitepackages()")
        folder = home / user_site[len(str(home)) + 1 :]
        folder.mkdir(parents=True)
        (folder / "slow_in_server.py").write_text(
            "import os, time\nif os.environ.get('NBACCEL_MIRROR_ADDRESS'):\n    time.sleep(6)\n"
        )
        value(kernel, f"sys.path.append({user_site!r})\nimport nbaccel\n0")
        value(kernel, "import nbaccel.forkserver.server as _fs\n_fs.SERVER.wait_until_ready() or 0")
        value(kernel, "def slow():\n    import slow_in_server\n    return 1\n0")
        kernel.execute("import slow_in_server")  # the cell's end sends it to the server
        timer = threading.Timer(1.5, kernel.interrupt)
        timer.start()
        cell = kernel.execute("nbaccel.notebook_launcher(slow, num_processes=1)", timeout=60)
        timer.join()
        assert "launch interrupted before any rank started" in cell.error_text, cell.error_text
        pid = value(kernel, "import nbaccel.core.mp_internals as _mp\n_mp.forkserver_pid()")
        started = time.monotonic()
        assert value(kernel, "nbaccel.notebook_launcher(slow, num_processes=1)") == 1
        assert time.monotonic() - started < 60  # not the 120 s deadline for a silent server
        assert value(kernel, "_mp.forkserver_pid()") == pid  # and not replaced
        assert value(kernel, "_fs.SERVER.mirror.answers['slow_in_server']['ok']")


SCRIPT = """
import os, site, sys, time
sys.path.append(site.getusersitepackages())
import slow_pkg  # installed (a site-packages folder), imported by the script before launching
import nbaccel

def train():
    loaded = "slow_pkg" in sys.modules  # before the function's own import below
    import slow_pkg
    return loaded, slow_pkg.IMPORTS

def plain():
    return "slow_pkg" in sys.modules

for fn in (train, plain, train):
    print(nbaccel.notebook_launcher(fn, num_processes=2, progress=False, return_all=True))
"""


def test_in_a_script_the_server_imports_the_launched_functions_packages_once(tmp_path):
    # Outside a kernel nothing was mirrored: every launch's ranks imported the function's
    # packages themselves (transformers: 1.6-2.2 s a launch where a kernel's relaunch takes
    # 0.06 s). Now the server imports them before the first fork, and only those.
    home = tmp_path / "userbase"
    env = {**os.environ, "PYTHONUSERBASE": str(home), "PYTHONPATH": os.getcwd()}
    env.pop("NBACCEL_VIEW", None)
    user_site = subprocess.run(
        [sys.executable, "-c", "import site; print(site.getusersitepackages())"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    folder = pathlib.Path(user_site)
    folder.mkdir(parents=True)
    # Counts its imports in one file per process: each rank that imports it anew adds one.
    counter = tmp_path / "imports"
    counter.mkdir()
    (folder / "slow_pkg.py").write_text(
        "import os\n"
        f"open(os.path.join({str(counter)!r}, str(os.getpid())), 'w').close()\n"
        f"IMPORTS = len(os.listdir({str(counter)!r}))\n"
    )
    script = tmp_path / "sweep.py"
    script.write_text(SCRIPT)
    done = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    results = [eval(line) for line in done.stdout.splitlines() if line.startswith("[")]
    # The ranks of every launch found it imported, by the script and the server: two imports
    # in all, none by a rank.
    assert results == [[(True, 2), (True, 2)], [True, True], [(True, 2), (True, 2)]], done.stdout
    assert len(os.listdir(counter)) == 2
