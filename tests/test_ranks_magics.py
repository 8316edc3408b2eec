"""``%ranks``/``%%ranks`` in a real ipykernel: what a notebook user sees, cell after cell.

One kernel and one set of 2 CPU ranks serve the module; tests that break or stop the ranks
start them again. Every test leaves the ranks either running or stopped, never half-way.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import psutil
import pytest

from tests.kernel_helpers import KernelSession
from tests.test_dashboard import rank_rows, widget_states

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def kernel():
    with KernelSession(startup="import nbaccel", background_shutdown=True) as k:
        yield k


@pytest.fixture
def ranks(kernel):
    """2 running ranks (started once, or again after a test broke or stopped them)."""
    cell = kernel.execute(
        "_m = get_ipython()._nbaccel_ranks_magics\nprint(bool(_m.session and _m.session.started))"
    )
    if cell.stdout.strip() != "True":
        # A trailing comment, as the README writes it: IPython passes it to line magics.
        cell = kernel.execute("%ranks start -n 2 --timeout 60  # gloo on CPU")
        assert cell.error is None, cell.error_text
        assert cell.stdout.startswith("nbaccel: starting 2 ranks… ready (2 processes")
    return kernel


def _pids(kernel) -> list[int]:
    cell = kernel.execute("print(get_ipython()._nbaccel_ranks_magics.session.pids)")
    return eval(cell.stdout.strip())  # a list of ints printed by the kernel


def _gone(pids: list[int], timeout: float = 15) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]
        if not alive:
            return True
        time.sleep(0.1)
    return False


def _interrupt_after(kernel, marker: str, delay: float):
    """An ``on_message`` that presses Stop ``delay`` s after ``marker`` first appears (each
    rank's line may come in its own message: interrupt once)."""
    timers: list[threading.Timer] = []

    def on_message(msg):
        if msg["msg_type"] == "stream" and marker in msg["content"]["text"] and not timers:
            timers.append(threading.Timer(delay, kernel.interrupt))
            timers[0].start()

    return on_message


def test_state_lives_across_cells_and_output_is_labelled(ranks):
    cell = ranks.execute("%%ranks\nx = accelerator.process_index * 10\nprint('made', x)")
    assert cell.error is None, cell.error_text
    assert "[rank0] made 0" in cell.stdout and "[rank1] made 10" in cell.stdout
    cell = ranks.execute("%%ranks\nx + 1")
    assert cell.error is None, cell.error_text
    assert "[rank0] Out: 1" in cell.stdout and "[rank1] Out: 11" in cell.stdout
    cell = ranks.execute("%%ranks --rank 1  # only the second rank\nx")
    assert cell.stdout.strip() == "[rank1] Out: 10"


def test_load_ext_and_import_register_the_magics_once(kernel):
    cell = kernel.execute(
        "%load_ext nbaccel\n_ip = get_ipython()\n"
        "print(_ip.find_line_magic('ranks') is not None, _ip.find_cell_magic('ranks') is not None,"
        " _ip.input_transformers_cleanup.count(_ip._nbaccel_ranks_magics.transform))"
    )
    assert cell.error is None, cell.error_text
    assert cell.stdout.strip() == "True True 1"


def test_mistakes_are_explained(ranks):
    def said(code: str) -> str:  # IPython shows a UsageError on stderr, without a traceback
        cell = ranks.execute(code)
        assert cell.reply["status"] == "error"
        return cell.stderr + cell.error_text

    def short(text: str) -> str:  # one message, none of nbaccel's (or cloudpickle's) frames
        assert "File " not in text and "nbaccel/" not in text and "cloudpickle" not in text, text
        return text

    # What jupyter_client's wait_for_ready leaves behind under load: a kernel_info reply
    # nobody read. Each cell must still get its own reply, not the one before it.
    ranks.client.kernel_info()
    text = said("%ranks start -n 2")
    assert "already running" in text and "%ranks restart" in text
    assert "%ranks start -n N" in said("%ranks launch")
    assert "no rank [5]: the ranks are [0, 1]" in short(said("%%ranks --rank 5\n1"))
    assert "not_defined_here" in said("%ranks push not_defined_here")
    text = short(said("import threading\na_lock = threading.Lock()\n%ranks push a_lock"))
    assert "'a_lock' (lock) cannot be sent to the ranks" in text and "%%ranks" in text


def test_start_and_stopped_mistakes_are_one_message(ranks):
    def said(code: str) -> str:
        cell = ranks.execute(code)
        assert cell.reply["status"] == "error"
        text = cell.stderr + cell.error_text
        assert "File " not in text and "nbaccel/" not in text, text  # no internal frames
        assert len(text.strip().splitlines()) < 10, text
        return text

    assert ranks.execute("%ranks stop").error is None
    assert "%ranks restart" in said("%%ranks\n1") and "not running" in said("%%ranks\n1")
    assert "num_processes must be at least 1, got 0" in said("%ranks start -n 0")
    assert "strategy='zero' is not supported" in said("%ranks start -n 2 --strategy zero")
    assert "mixed_precision='fp8'" in said("%ranks start -n 2 --mixed_precision fp8")


def test_a_cells_unfinished_line_shows_in_that_cell(ranks):
    cell = ranks.execute("%%ranks\nprint('abc', end='')")
    assert cell.error is None, cell.error_text
    assert "[rank0] abc" in cell.stdout and "[rank1] abc" in cell.stdout, cell.stdout
    cell = ranks.execute("%%ranks\nprint('def')")
    assert "[rank0] def" in cell.stdout and "abcdef" not in cell.stdout, cell.stdout
    cell = ranks.execute("%%ranks\ntry:\n    input('x?')\nexcept EOFError:\n    pass")
    assert "[rank0] x?" in cell.stdout, cell.stdout
    cell = ranks.execute("%%ranks\nprint('next')")
    assert "x?" not in cell.stdout, cell.stdout


def test_all_reduce_and_pull_push_round_trip(ranks):
    cell = ranks.execute(
        "%%ranks\nt = torch.ones(3) * (accelerator.process_index + 1)\ndist.all_reduce(t)"
    )
    assert cell.error is None, cell.error_text
    cell = ranks.execute("%ranks pull t\nprint([v.tolist() for v in t])")
    assert cell.error is None, cell.error_text
    assert cell.stdout.strip() == "[[3.0, 3.0, 3.0], [3.0, 3.0, 3.0]]"
    cell = ranks.execute("scale = {'lr': 0.5}\n%ranks push scale")
    assert cell.error is None, cell.error_text
    cell = ranks.execute("%%ranks\nscale['lr'] * accelerator.process_index")
    assert "[rank0] Out: 0.0" in cell.stdout and "[rank1] Out: 0.5" in cell.stdout


def test_error_on_one_rank_shows_its_traceback_and_ranks_live_on(ranks):
    ranks.execute("%%ranks\nkept = 'still here'")
    cell = ranks.execute(
        "%%ranks\nif accelerator.process_index == 1:\n    raise ValueError('only rank 1')"
    )
    assert "rank 1 (of 2) raised ValueError: only rank 1" in cell.error_text
    # As a local error reads: the notebook's own cell and line, once, no magic plumbing.
    n = cell.of_type("execute_input")[0]["content"]["execution_count"]
    assert f"Cell In[{n}], line 3" in cell.error_text, cell.error_text
    assert cell.error_text.count("raise ValueError('only rank 1')") == 1
    assert "run_cell_magic" not in cell.error_text and "<rank cell" not in cell.error_text
    assert "Traceback" not in cell.stdout + cell.stderr  # the error alone shows it
    assert "alive" in cell.error_text
    cell = ranks.execute("%%ranks\nkept")
    assert "[rank1] Out: 'still here'" in cell.stdout, cell.error_text


def test_interrupt_raises_in_every_rank_and_ranks_live_on(ranks):
    ranks.execute("%%ranks\nsurvivor = accelerator.process_index")
    code = "%%ranks\nimport time\nprint('looping', flush=True)\nwhile True:\n    time.sleep(0.01)"
    started = time.monotonic()
    cell = ranks.execute(code, timeout=60, on_message=_interrupt_after(ranks, "looping", 0.5))
    assert time.monotonic() - started < 30
    assert cell.error is not None and cell.error["ename"] == "KeyboardInterrupt", cell.messages
    assert "ranks are alive" in cell.error_text
    cell = ranks.execute("%%ranks\nsurvivor")
    assert "[rank0] Out: 0" in cell.stdout and "[rank1] Out: 1" in cell.stdout, cell.error_text


def test_half_done_collective_breaks_the_group_without_hanging(ranks):
    pids = _pids(ranks)
    started = time.monotonic()
    cell = ranks.execute(
        "%%ranks\nif accelerator.process_index == 0:\n    raise RuntimeError('skip the sum')\n"
        "dist.all_reduce(torch.ones(1))",
        timeout=60,
    )
    assert time.monotonic() - started < 30
    text = cell.error_text
    assert "ranks are broken" in text and "all_reduce" in text and "%ranks start" in text
    assert "skip the sum" in text  # the cause: rank 0's traceback, as a local error's
    n = cell.of_type("execute_input")[0]["content"]["execution_count"]
    assert f"in rank 0:\nCell In[{n}], line 3" in text and "<rank cell" not in text, text
    assert "Traceback (most recent call last):" not in text  # no raw Python traceback too
    assert _gone(pids)
    cell = ranks.execute("%%ranks\n1")
    assert "broken" in cell.error_text  # until started again
    # %ranks stop on them said nothing at all: it says they had already ended, and why.
    cell = ranks.execute("%ranks stop")
    assert cell.error is None, cell.error_text
    assert cell.stdout.startswith("nbaccel: no ranks to stop: they were stopped when they broke")
    assert "%ranks start" in cell.stdout, cell.stdout
    cell = ranks.execute("%ranks start -n 2")
    assert cell.error is None, cell.error_text


def test_stop_during_a_collective_says_the_interrupt_left_it_half_done(ranks):
    pids = _pids(ranks)
    code = (
        "%%ranks\nimport time\nprint('waiting', flush=True)\n"
        "if accelerator.process_index == 0:\n    time.sleep(30)\n"
        "t = torch.ones(1)\ndist.all_reduce(t)"
    )
    started = time.monotonic()  # after 3 s rank 1 is in the all_reduce; rank 0 still sleeps
    cell = ranks.execute(code, timeout=60, on_message=_interrupt_after(ranks, "waiting", 3.0))
    assert time.monotonic() - started < 25
    text = cell.error_text
    assert "the interrupt stopped rank 0 before it reached the torch.distributed.all_reduce" in text
    assert "rank 1 is blocked in" in text and "%ranks restart" in text, text
    assert "already finished" not in text
    # Rank 0's KeyboardInterrupt ends in the user's line, not in nbaccel's signal handler.
    assert "KeyboardInterrupt" in text and "time.sleep(30)" in text
    assert "session_entry.py" not in text, text
    assert _gone(pids)


@pytest.mark.parametrize(
    "death, said",
    [
        ("os._exit(3)", ["rank 1 exited with code 3"]),
        # A segfault: the rank's stack in the cell (named as its traceback would name it), no
        # fork-server frames, no module list.
        ("ctypes.string_at(0)", ["SIGSEGV", "Segmentation fault", "crash_here", "Cell In["]),
    ],
)
def test_a_rank_that_dies_breaks_the_group(ranks, death, said):
    pids = _pids(ranks)
    cell = ranks.execute(
        f"%%ranks\nimport ctypes, os, time\ndef crash_here():\n    {death}\n"
        "if accelerator.process_index == 1:\n    crash_here()\ntime.sleep(30)",
        timeout=60,
    )
    text = cell.error_text
    assert all(s in text for s in said), text
    for internal in ("Extension modules", "multiprocessing", "forkserver", "session_entry.py"):
        assert internal not in text, text
    for internal in ("<rank cell",):
        assert internal not in text, text
    assert _gone(pids)


def test_timeout_shows_each_ranks_stack_and_interrupts(ranks):
    cell = ranks.execute(
        "%%ranks --timeout 1\nimport time\ndef waiting_here():\n    time.sleep(60)\nwaiting_here()",
        timeout=60,
    )
    text = cell.error_text
    assert "did not finish within timeout=1 s" in text, text
    assert "waiting_here" in text and "--- rank 1 stack at timeout ---" in text
    assert "Cell In[" in text and "<rank cell" not in text, text  # as the traceback says
    cell = ranks.execute("%%ranks\n'alive'")
    assert "[rank1] Out: 'alive'" in cell.stdout, cell.error_text


def test_auto_mode_runs_cells_on_the_ranks_and_local_in_the_kernel(ranks):
    cell = ranks.execute("%ranks auto on")
    assert cell.error is None, cell.error_text
    try:
        cell = ranks.execute("where = f'rank {accelerator.process_index}'\nwhere")
        assert "[rank1] Out: 'rank 1'" in cell.stdout, cell.error_text
        cell = ranks.execute("%%local\nprint('kernel' if 'accelerator' not in dir() else 'rank')")
        assert cell.stdout.strip() == "kernel"
    finally:
        cell = ranks.execute("%ranks auto off")
    assert cell.error is None, cell.error_text
    assert ranks.execute("print('here')").stdout.strip() == "here"


def test_names_on_the_ranks_complete_with_tab_and_status_lists_ranks(ranks):
    ranks.execute("%%ranks\nrank_only_model = torch.nn.Linear(2, 2)")
    reply = ranks.shell_reply(ranks.client.complete("rank_only_m", 11))
    assert "rank_only_model" in reply["content"]["matches"]
    types = reply["content"]["metadata"].get("_jupyter_types_experimental", [])
    assert {"text": "rank_only_model", "type": "Linear"}.items() <= next(
        t for t in types if t["text"] == "rank_only_model"
    ).items()
    cell = ranks.execute("%ranks status")
    text = cell.results[-1]["text/plain"]
    assert "idle" in text and "cpu" in text and "MiB" in text
    for pid in _pids(ranks):
        assert str(pid) in text


def test_restart_says_at_once_what_it_is_doing(ranks):
    sent = time.monotonic()
    cell = ranks.execute("%ranks restart")
    assert cell.error is None, cell.error_text
    first = cell.of_type("stream")[0]
    assert first["content"]["text"] == "nbaccel: restarting 2 ranks… "
    assert first["received_at"] - sent < 1.0, "a blank cell while the ranks start"
    assert cell.stdout == "nbaccel: restarting 2 ranks… ready\n"


def test_stop_leaves_nothing_running(ranks):
    cell = ranks.execute(
        "%%ranks\nimport subprocess\nchild = subprocess.Popen(['sleep', '300'])\nchild.pid"
    )
    assert cell.error is None, cell.error_text
    children = [int(line.split()[-1]) for line in cell.stdout.splitlines() if "Out:" in line]
    pids = _pids(ranks) + children
    assert len(pids) == 4
    cell = ranks.execute("%ranks stop")
    assert cell.error is None, cell.error_text
    assert "2 ranks stopped" in cell.stdout
    assert _gone(pids, timeout=5)
    assert ranks.leftovers() == []


@pytest.mark.parametrize("how", ["shutdown", "SIGKILL"])
def test_ranks_die_with_the_kernel(how):
    with KernelSession(startup="import nbaccel") as k:
        cell = k.execute("%ranks start -n 2")
        assert cell.error is None, cell.error_text
        pids = _pids(k)
        assert all(psutil.pid_exists(p) for p in pids)
        if how == "SIGKILL":  # no goodbye: containment, not politeness, must end them
            os.kill(k.pid, signal.SIGKILL)
            assert _gone(pids)
    assert _gone(pids)


def test_a_ranks_cell_shows_like_a_local_cell_and_progress_in_the_dashboard():
    with KernelSession(env={"NBACCEL_VIEW": "widgets"}, startup="import nbaccel") as k:
        cell = k.execute("%ranks start -n 2")
        assert cell.error is None, cell.error_text
        # A cell without progress: its lines and values, as a local cell's; no header, no table.
        cell = k.execute("%%ranks\nprint('hi from', accelerator.process_index)\n7")
        assert cell.error is None, cell.error_text
        lines = cell.stdout.splitlines()
        # Each rank's line arrives when that rank prints it (either may be first); the values
        # are shown once every rank is done, in rank order.
        assert sorted(lines[:2]) == ["[rank0] hi from 0", "[rank1] hi from 1"], lines
        assert lines[2:] == ["[rank0] Out: 7", "[rank1] Out: 7"], lines
        assert not cell.of_type("display_data", "update_display_data"), "a table or header"
        assert "nbaccel" not in cell.stdout + cell.stderr
        cell = k.execute("%%ranks --rank 1\nprint('only me')")
        assert cell.stdout == "[rank1] only me\n" and not cell.of_type("display_data")
        cell = k.execute("%ranks pull _")
        assert cell.error is None and not cell.stdout and not cell.of_type("display_data")

        # A cell that reports progress: the dashboard's table for the cell's ranks only.
        cell = k.execute(
            "%%ranks --rank 1\nfor i in nbaccel.progress(range(50), desc='steps'):\n    pass\n"
            "print('looped')\naccelerator.process_index"
        )
        assert cell.error is None, cell.error_text
        assert cell.stdout == "[rank1] looped\n[rank1] Out: 1\n"
        live = [
            s["value"]
            for s in widget_states(cell).values()
            if "nbaccel-live" in str(s.get("value", ""))
        ]
        assert (
            live and "nbaccel-header" not in live[-1] and "nbaccel-pane" not in str(cell.messages)
        )
        rows = rank_rows(live[-1])
        assert sorted(rows) == [1], "rank 0 did not run this cell"
        assert rows[1]["status"] == "finished" and rows[1]["n"] == rows[1]["total"] == "50"
        final = cell.of_type("update_display_data")[-1]["content"]["data"]
        assert final["text/plain"].startswith("rank 1 finished in "), final["text/plain"]
        assert "50/50" in final["text/plain"]  # the static summary a saved notebook keeps
        assert sorted(rank_rows(final["text/html"])) == [1]
        pids = _pids(k)
        assert k.execute("%ranks stop").error is None
    assert _gone(pids)


def test_a_magic_or_shell_line_in_a_ranks_cell_says_what_to_do(ranks):
    cell = ranks.execute("%%ranks\nx = 1\n!pip list")
    # IPython shows a UsageError as one line on stderr
    assert "line 2, '!pip list': ranks run plain Python" in cell.stderr, cell.stderr
    assert "SyntaxError" not in cell.stdout + cell.stderr


def test_a_ranks_object_rebound_after_its_error_stops_its_ranks(kernel):
    """Running ``r = nbaccel.Ranks(2)`` again after one of its cells failed (Run All after a
    fix): the old session's ranks stop as they do after any rebinding. Before, the error IPython
    keeps for ``%debug`` (``sys.last_traceback``) held the old session through nbaccel's frames,
    so its ranks ran on, with no handle left to stop them, until the next error."""
    cell = kernel.execute("_r = nbaccel.Ranks(2)\n_old = _r.pids\n_r.run('1/0')")
    assert cell.error is not None and cell.error["ename"] == "CellError", cell.error_text
    assert "ZeroDivisionError" in cell.error_text  # the error still reads as it did
    cell = kernel.execute("_r = nbaccel.Ranks(2)\nprint(_old)")
    assert cell.error is None, cell.error_text
    try:
        assert _gone(eval(cell.stdout.strip()), timeout=5)  # a list of ints printed by the kernel
    finally:
        kernel.execute("_r.stop()")
