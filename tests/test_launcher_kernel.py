"""What a notebook user sees: notebook_launcher run inside a real ipykernel via jupyter_client.

Functions are defined in cells, so they travel by value, exactly as in a notebook.
"""

from __future__ import annotations

import textwrap

import pytest

from tests.kernel_helpers import KernelSession

pytestmark = pytest.mark.slow  # a real kernel


@pytest.fixture(scope="module")
def kernel():
    with KernelSession(
        env={"NBACCEL_VIEW": "text"}, startup="import nbaccel, os, time", background_shutdown=True
    ) as k:
        yield k


@pytest.fixture(autouse=True)
def nothing_left_in_kernel(kernel):
    yield
    assert kernel.leftovers() == [], "the kernel still has rank processes"


def cell(code: str) -> str:
    return textwrap.dedent(code).strip()


def test_lines_arrive_while_ranks_run_and_result_comes_back(kernel, tmp_path):
    """Rank 0 blocks until the test has seen its first line on iopub: if output were only
    delivered at the end, this cell could never finish."""
    gate = tmp_path / "seen-first-line"
    code = cell(f"""
        def train(gate):
            import torch, torch.distributed as dist
            dist.init_process_group("gloo")
            print(f"first line from {{dist.get_rank()}}", flush=True)
            if dist.get_rank() == 0:
                while not os.path.exists(gate):
                    time.sleep(0.01)
            dist.barrier()
            total = torch.tensor([dist.get_rank() + 1.0])
            dist.all_reduce(total)
            return total.item()

        nbaccel.notebook_launcher(train, args=({str(gate)!r},), num_processes=2, timeout=120)
    """)

    def open_gate(msg):
        if msg["msg_type"] == "stream" and "[rank0] first line from 0" in msg["content"]["text"]:
            gate.touch()

    result = kernel.execute(code, on_message=open_gate)
    assert result.error is None, result.error_text
    assert gate.exists()
    assert "[rank1] first line from 1" in result.stdout
    assert result.results[-1]["text/plain"] == "3.0"


def test_failing_rank_shows_rank_type_message_and_user_code(kernel):
    result = kernel.execute(
        cell("""
        def train():
            rank = int(os.environ["RANK"])
            if rank == 1:
                values = {"lr": 0.1}
                return values["learning_rate"]   # the user's bug
            time.sleep(600)

        nbaccel.notebook_launcher(train, num_processes=2)
    """)
    )
    assert result.error is not None
    assert result.error["ename"] == "RankFailedError"
    text = result.error_text
    assert "rank 1 (of 2) raised KeyError: 'learning_rate'" in text
    assert 'return values["learning_rate"]   # the user\'s bug' in text
    assert "in train" in text


def run_and_interrupt_once_both_ranks_train(kernel):
    """Launch two ranks that sleep, and interrupt the kernel once both have said so."""
    code = cell("""
        def train():
            print("training", flush=True)
            time.sleep(600)

        nbaccel.notebook_launcher(train, num_processes=2)
    """)
    seen = set()

    def interrupt_when_both_run(msg):
        if msg["msg_type"] == "stream":
            for rank in (0, 1):
                if f"[rank{rank}] training" in msg["content"]["text"]:
                    seen.add(rank)
            if seen == {0, 1} and "sent" not in seen:
                seen.add("sent")
                kernel.interrupt()

    return kernel.execute(code, on_message=interrupt_when_both_run, timeout=120)


def test_interrupt_stops_every_rank_and_raises_keyboardinterrupt_once(kernel):
    result = run_and_interrupt_once_both_ranks_train(kernel)
    assert result.error is not None and result.error["ename"] == "KeyboardInterrupt"
    # One line: no chained tracebacks, no frames of nbaccel's (it showed Launch._attempt's)
    assert result.error["traceback"] == [f"KeyboardInterrupt: {result.error['evalue']}"]
    assert "all 2 ranks were stopped" in result.error["evalue"]
    assert "KeyboardInterrupt" not in result.stdout + result.stderr  # none from the ranks
    assert "stopped" in result.stdout  # the final summary marks the ranks as stopped

    after = kernel.execute("print(1 + 1)")
    assert after.stdout == "2\n"


def test_launch_after_interrupt_and_failure_works(kernel):
    """The same kernel interrupts one launch and sees another fail, then launches again."""
    interrupted = run_and_interrupt_once_both_ranks_train(kernel)
    assert interrupted.error is not None and interrupted.error["ename"] == "KeyboardInterrupt"
    failed = kernel.execute(
        cell("""
        def train():
            if os.environ["RANK"] == "1":
                raise ValueError("rank one gives up")
            time.sleep(600)

        nbaccel.notebook_launcher(train, num_processes=2)
    """)
    )
    assert failed.error is not None and failed.error["ename"] == "RankFailedError"
    assert "rank one gives up" in failed.error_text

    result = kernel.execute(
        cell("""
        def train():
            return int(os.environ["RANK"]) * 10

        nbaccel.notebook_launcher(train, num_processes=2, return_all=True)
    """)
    )
    assert result.error is None, result.error_text
    assert result.results[-1]["text/plain"] == "[0, 10]"


def test_cuda_free_kernel_class_and_global_from_earlier_cells(kernel):
    """Ranks see a class and a global from earlier cells, and the launch leaves CUDA
    uninitialised in the kernel (forked ranks could not use it otherwise).

    ``is_initialized()`` alone stays False on a machine without a GPU whatever the launcher
    does, so the kernel also records calls to ``torch.cuda._lazy_init``, the step through which
    placing a tensor on a GPU and torch.cuda's own functions initialise CUDA: that part of the
    check can fail on any machine.
    """
    setup = kernel.execute(
        cell("""
        import torch
        SCALE = 7
        class Box:
            def __init__(self, v): self.v = v

        _cuda_inits = []
        _real_lazy_init = torch.cuda._lazy_init
        def _recording_lazy_init(*a, **k):
            _cuda_inits.append(1)
            return _real_lazy_init(*a, **k)
        torch.cuda._lazy_init = _recording_lazy_init
    """)
    )
    assert setup.error is None, setup.error_text
    try:
        result = kernel.execute(
            cell("""
            def train():
                return Box(SCALE * (int(os.environ["RANK"]) + 1))

            [b.v for b in nbaccel.notebook_launcher(train, num_processes=2, return_all=True)]
        """)
        )
        assert result.error is None, result.error_text
        assert result.results[-1]["text/plain"] == "[7, 14]"
        cuda = kernel.execute("(torch.cuda.is_initialized(), len(_cuda_inits))")
        assert cuda.error is None, cuda.error_text
        assert cuda.results[-1]["text/plain"] == "(False, 0)", "the kernel initialised CUDA"
    finally:
        kernel.execute("torch.cuda._lazy_init = _real_lazy_init")


def test_ranks_do_not_inherit_the_inline_matplotlib_backend(kernel):
    """ipykernel sets MPLBACKEND to its inline backend; ranks must not import IPython."""
    result = kernel.execute(
        cell("""
        def plot():
            import sys
            import matplotlib.pyplot as plt
            plt.plot([1, 2, 3])
            return plt.get_backend(), "IPython" in sys.modules

        nbaccel.notebook_launcher(plot, num_processes=1)
    """)
    )
    assert result.error is None, result.error_text
    assert result.results[-1]["text/plain"] == "('Agg', False)"


def test_the_kernel_shows_busy_for_a_whole_blocking_launch(kernel):
    """JupyterLab's control-channel requests during a cell (its debugger's, the widget
    manager's subshell request) make ipykernel publish busy/idle for them, and JupyterLab shows
    the last status it saw: the running launch re-publishes its cell's busy (once a second)."""
    asked = []

    def ask_on_control(msg):
        if msg["msg_type"] == "stream" and "[rank0] go" in msg["content"]["text"] and not asked:
            request = kernel.client.session.msg("kernel_info_request")
            kernel.client.control_channel.send(request)
            asked.append(request["header"]["msg_id"])

    cell_code = cell("""
        def train():
            print("go", flush=True)
            time.sleep(4)

        nbaccel.notebook_launcher(train, num_processes=1)
    """)
    result = kernel.execute(cell_code, on_message=ask_on_control)
    assert result.error is None, result.error_text
    assert asked, "the rank's line never arrived"
    control_idle = next(
        m["received_at"]
        for m in kernel.other_messages
        if m["msg_type"] == "status"
        and m["parent_header"].get("msg_id") == asked[0]
        and m["content"]["execution_state"] == "idle"
    )
    busy_after = [
        m
        for m in kernel.statuses
        if m["parent_header"].get("msg_id") == kernel.last_msg_id
        and m["content"]["execution_state"] == "busy"
        and m["received_at"] > control_idle
    ]
    assert busy_after, "after the control request's idle the kernel looked idle to the end"
