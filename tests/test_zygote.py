"""The fork server as a fork of the kernel (``rank.zygote``), in real kernels.

A rank forked from it must be indistinguishable from one forked from a fresh-interpreter server
(``NBACCEL_ZYGOTE=0``) in everything the kernel's process carries: kernel-side modules, builtins,
hooks, the running asyncio loop, atexit hooks, signal handlers, file descriptors, threads, the
user's namespace, tqdm's notebook choice. A module the user edits and reloads after
``import nbaccel`` reaches the ranks as edited. A kernel that ran a multi-threaded matmul before
``import nbaccel`` still gets ranks that can (GNU OpenMP does not survive a fork by itself).
"""

from __future__ import annotations

import textwrap

import pytest

from tests.kernel_helpers import KernelSession

pytestmark = pytest.mark.slow  # real kernels

# What the kernel holds before `import nbaccel`: torch (and its modes changed), tqdm.auto (its
# notebook bar), a name, a multiprocessing child of its own, and an exit hook of its own (a
# stdlib callable, as `atexit.register(shutil.rmtree, tmp)` is).
BEFORE = (
    "import asyncio, atexit, importlib, multiprocessing, os, pathlib, sys, time\n"
    "import torch, tqdm.auto\n"
    "USER_SECRET = 42\n"
    "torch.set_default_dtype(torch.float64)\ntorch.set_grad_enabled(False)\n"
    "torch.use_deterministic_algorithms(True)\n"
    "_child = multiprocessing.Process(target=time.sleep, args=(300,), daemon=True)\n"
    "_child.start()\n"
    "atexit.register(pathlib.Path(os.environ['PROBE_DIR'], 'kernel-hook-ran').touch)\n"
)
PROBE = textwrap.dedent(
    """
    def probe():
        import asyncio, builtins, getpass, logging, logging.handlers, os, pathlib, signal, sys
        import threading, warnings, weakref
        import torch, tqdm.auto

        # torch's own log handler: its line must reach this launch's cell as the rank's
        logging.getLogger("torch.distributed").warning("TORCH-LOG from a rank")

        # What the rank's exit must still do: flush buffered log records, run finalisers.
        d, rank = pathlib.Path(os.environ["PROBE_DIR"]), os.environ["RANK"]
        target = logging.FileHandler(d / f"log-{rank}")
        buffered = logging.handlers.MemoryHandler(100, logging.CRITICAL, target)
        logging.getLogger("probe").addHandler(buffered)
        logging.getLogger("probe").warning("flushed at exit")
        probe.keep = type("Kept", (), {})()
        weakref.finalize(probe.keep, (d / f"finalized-{rank}").touch)

        async def one():
            return 1

        # The server was forked inside `import nbaccel`: a thread must still be able to import.
        imported = []
        worker = threading.Thread(target=lambda: imported.append(bool(__import__("nbaccel").utils)))
        worker.start()
        worker.join(20)

        kernel_side = ("IPython", "ipykernel", "zmq", "ipywidgets", "comm", "jupyter_client",
                       "tornado", "traitlets", "debugpy", "pydevd", "nbaccel.launch", "nbaccel.ui")
        return {
            "kernel_side_modules": sorted(n for n in sys.modules if n.startswith(kernel_side)),
            "builtins": sorted(vars(builtins)),
            "input": builtins.input.__module__,
            "own_hooks": [getattr(sys, h) is getattr(sys, f"__{h}__")
                          for h in ("displayhook", "excepthook", "breakpointhook")],
            "asyncio_run": asyncio.run(one()),
            "thread_imported_nbaccel": imported == [True],
            "handlers": sorted(int(s) for s in signal.valid_signals()
                               if callable(signal.getsignal(s))),
            "open_fds": len(os.listdir("/proc/self/fd")),
            "threads": threading.active_count(),
            "warning_categories": sorted({f[2].__module__ for f in warnings.filters}),
            "main_names": sorted(n for n in vars(sys.modules["__main__"]) if n[:1] != "_"),
            "tqdm_auto": tqdm.auto.tqdm.__module__,
            "getpass": getpass.getpass.__module__,  # not ipykernel's (it waits on zmq)
            "torch_modes": [
                torch.is_grad_enabled(),
                str(torch.get_default_dtype()),
                torch.are_deterministic_algorithms_enabled(),
            ],
            "title": open("/proc/self/cmdline").read().split("\\0")[0],
        }
    """
)


def kernel_with(env: dict[str, str], before: str = BEFORE) -> KernelSession:
    return KernelSession(env={"NBACCEL_VIEW": "text", **env}, startup=before + "import nbaccel")


def value(kernel: KernelSession, code: str):
    cell = kernel.execute(textwrap.dedent(code).strip())
    assert cell.error is None, cell.error_text
    return eval(cell.results[-1]["text/plain"])


def launched(kernel: KernelSession, definition: str, call: str):
    """Define a function in a cell, then return what ``call`` (a launch of it) gives."""
    cell = kernel.execute(definition)
    assert cell.error is None, cell.error_text
    return value(kernel, call)


def server_kind(kernel: KernelSession) -> str:
    return value(kernel, "import nbaccel.launch.forkserver as _fs\n_fs.server_kind()")


def probe_ranks(env: dict[str, str], d) -> tuple[str, list[dict]]:
    with kernel_with({**env, "PROBE_DIR": str(d)}) as kernel:
        kernel.execute(PROBE)
        cell = kernel.execute("nbaccel.notebook_launcher(probe, num_processes=2, return_all=True)")
        assert cell.error is None, cell.error_text
        states = eval(cell.results[-1]["text/plain"])
        assert "[rank0]" in cell.stderr and "TORCH-LOG from a rank" in cell.stderr, cell.stderr
        ran = sorted(p.name for p in d.iterdir())
        assert ran == ["finalized-0", "finalized-1", "log-0", "log-1"], ran  # not the kernel's
        assert all((d / f"log-{r}").read_text() == "flushed at exit\n" for r in (0, 1))
        kind = server_kind(kernel)
        # A server restarted (other preloads) ends the first one; the kernel's child lives on.
        value(kernel, "nbaccel.notebook_launcher(lambda: 1, num_processes=1, preload=('json',))")
        assert value(kernel, "(_child.is_alive(), _child.exitcode)") == (True, None)
        return kind, states


def test_a_rank_from_the_kernel_fork_is_a_rank_from_a_fresh_server(tmp_path):
    (tmp_path / "fork").mkdir()
    (tmp_path / "fresh").mkdir()
    kind, forked = probe_ranks({}, tmp_path / "fork")
    fresh_kind, fresh = probe_ranks({"NBACCEL_ZYGOTE": "0"}, tmp_path / "fresh")
    assert (kind, fresh_kind) == ("fork of the kernel", "fresh interpreter")
    for state in forked + fresh:
        assert state["kernel_side_modules"] == []
        assert state["input"] == "nbaccel.rank.process_setup"  # not ipykernel's zmq input
        assert state["own_hooks"] == [True, True, True]
        assert state["asyncio_run"] == 1  # no event loop "running" in the rank
        assert state["thread_imported_nbaccel"]
        assert set(state.pop("main_names")) <= {"main"}  # (a fresh server's -c defines main)
        assert not state["tqdm_auto"].startswith("tqdm.notebook")  # no widget bars in a rank
        assert state["title"].startswith("nbaccel rank ")
        assert state["getpass"] == "getpass"
        assert state["torch_modes"] == [True, "torch.float32", False]  # as `import torch` does
    for forked_rank, fresh_rank in zip(forked, fresh):
        # a fresh server leaves one /dev/null open (its stdin) that the fork does not
        assert forked_rank.pop("open_fds") <= fresh_rank.pop("open_fds")
        assert forked_rank == fresh_rank


def test_a_module_edited_and_reloaded_after_import_reaches_the_ranks_as_edited(tmp_path):
    (tmp_path / "helper_mod.py").write_text("VALUE = 1\n\ndef value():\n    return VALUE\n")
    before = f"import os\nos.chdir({str(tmp_path)!r})\n{BEFORE}import helper_mod\n"
    with kernel_with({"PROBE_DIR": str(tmp_path)}, before) as kernel:
        assert server_kind(kernel) == "fork of the kernel"
        (tmp_path / "helper_mod.py").write_text("VALUE = 2\n\ndef value():\n    return VALUE\n")
        value(kernel, "importlib.reload(helper_mod).VALUE")
        # by reference (cloudpickle imports the module in the rank) and from a cell
        assert value(kernel, "nbaccel.notebook_launcher(helper_mod.value, num_processes=2)") == 2
        from_cell = "def from_cell():\n    import helper_mod\n    return helper_mod.VALUE"
        call = "nbaccel.notebook_launcher(from_cell, num_processes=2)"
        assert launched(kernel, from_cell, call) == 2


def test_ranks_multiply_on_two_threads_after_the_kernel_did_before_import():
    # Without releasing the kernel's OpenMP pool before the fork, this rank's matmul hangs.
    before = (
        "import torch\ntorch.set_num_threads(2)\n"
        "_a = torch.randn(1000, 1000)\nfor _ in range(3):\n    _a @ _a\n"
    )
    with kernel_with({}, before) as kernel:
        assert server_kind(kernel) == "fork of the kernel"
        matmul = (
            "def matmul():\n    import torch\n    torch.set_num_threads(2)\n"
            "    a = torch.randn(1000, 1000)\n    (a @ a).sum()\n    return torch.get_num_threads()"
        )
        call = "nbaccel.notebook_launcher(matmul, num_processes=1, timeout=60)"
        assert launched(kernel, matmul, call) == 2
        assert value(kernel, "int((_a @ _a).shape[0])") == 1000  # and the kernel still can


def test_sorted_imports_nbaccel_before_torch_still_fork_the_kernel():
    with KernelSession(env={"NBACCEL_VIEW": "text"}, startup="import nbaccel\nimport torch") as k:
        assert server_kind(k) == "fork of the kernel"
        assert value(k, "nbaccel.notebook_launcher(lambda: 5, num_processes=2)") == 5


def test_a_kernel_holding_much_memory_gets_a_fresh_server_instead():
    # A fork would keep these 1.6 GB alive after the kernel frees them: no zygote then.
    before = "import torch\n_big = torch.ones(400_000_000)\n"
    with kernel_with({}, before) as kernel:
        assert server_kind(kernel) == "fresh interpreter"
        assert "GiB of its own memory" in value(kernel, "_fs.zygote_unavailable()")
        assert value(kernel, "nbaccel.notebook_launcher(lambda: 3, num_processes=2)") == 3


def test_a_module_that_defined_torch_operators_before_import_still_works_in_ranks(tmp_path):
    # Imported again in a rank, it would register its operators twice (an error).
    (tmp_path / "ops_mod.py").write_text(
        "import torch\n"
        "lib = torch.library.Library('nbaccel_zygote_test', 'DEF')\n"
        "lib.define('twice(Tensor x) -> Tensor')\n"
        "lib.impl('twice', lambda x: x * 2, 'CPU')\n"
    )
    before = f"import os\nos.chdir({str(tmp_path)!r})\nimport torch, ops_mod\n"
    with kernel_with({}, before) as kernel:
        assert server_kind(kernel) == "fork of the kernel"
        twice = (
            "def twice():\n    import torch, ops_mod\n"
            "    return float(torch.ops.nbaccel_zygote_test.twice(torch.ones(1)))"
        )
        assert launched(kernel, twice, "nbaccel.notebook_launcher(twice, num_processes=2)") == 2.0


def test_a_failed_magic_before_import_leaves_the_zygote_working():
    # The failed cell leaves sys.last_type = IPython's UsageError in the kernel.
    with KernelSession(env={"NBACCEL_VIEW": "text"}, startup="import torch") as kernel:
        kernel.execute("%nosuchmagic")  # IPython reports it (UsageError) without raising
        assert value(kernel, "import sys\nsys.last_type.__module__").startswith("IPython")
        assert kernel.execute("import nbaccel").error is None
        pid = value(kernel, "import nbaccel.core.mp_internals as _mp\n_mp.forkserver_pid()")
        assert value(kernel, "nbaccel.notebook_launcher(lambda: 4, num_processes=2)") == 4
        assert server_kind(kernel) == "fork of the kernel"
        assert value(kernel, "_mp.forkserver_pid()") == pid  # the same zygote served it
