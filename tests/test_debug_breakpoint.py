"""``breakpoint()`` and ``input()`` in a rank of a blocking launch, in a real kernel answered
on its stdin channel as JupyterLab's input box answers it (``input_request``/``input_reply``).

The rank's own pdb runs on its real frames; the kernel relays its text (``rank.debugger``,
``launch.debugging``).
"""

from __future__ import annotations

import re
import textwrap
import time

import psutil
import pytest

from tests.kernel_helpers import KernelSession, text_view_kernel

pytestmark = pytest.mark.slow  # a real kernel


@pytest.fixture(scope="module")
def kernel():
    yield from text_view_kernel()


@pytest.fixture(autouse=True)
def nothing_left_in_kernel(request):
    yield
    if "kernel" in request.fixturenames:
        assert request.getfixturevalue("kernel").leftovers() == [], "rank processes left"


def cell(code: str) -> str:
    return textwrap.dedent(code).strip()


class Typist:
    """Types ``lines`` into the input box, one per prompt; what was asked is kept."""

    def __init__(self, *lines: str | None) -> None:
        self.lines = list(lines)
        self.prompts: list[str] = []

    def __call__(self, prompt: str) -> str | None:
        self.prompts.append(prompt)
        if not self.lines:
            raise AssertionError(f"asked once more than expected: {prompt!r}")
        return self.lines.pop(0)


PAUSING = cell("""
    def train(n):
        import torch.distributed as dist
        dist.init_process_group("gloo")
        rank = dist.get_rank()
        values = [n, n + 1, rank]
        if rank == 1:
            breakpoint()
            values.append(len(values))
        dist.barrier()
        return sum(values) if rank == 0 else values
""")


def rank_pids(text: str) -> list[int]:
    return [int(p) for p in re.findall(r"pid=(\d+)", text)]


def test_breakpoint_on_rank_1_opens_pdb_in_the_cell(kernel):
    typist = Typist("p values", "n", "p values[-1] + 100", "values[0] = 7", "p values", "w", "c")
    result = kernel.execute(
        PAUSING + "\nnbaccel.notebook_launcher(train, args=(3,), num_processes=2, timeout=60)",
        answer=typist,
    )
    assert result.error is None, result.error_text
    assert typist.prompts == ["(Pdb rank 1)"] * 7  # the prompt names the rank
    out = result.stdout
    assert "[3, 4, 1]" in out  # `p` of the rank's local
    assert "103" in out  # after `n`: the appended element, on the rank's real list
    assert "[7, 4, 1, 3]" in out  # a local assigned
    # Where it stopped reads like the cell, and `w` shows the user's frame only.
    assert re.search(r"> Cell In\[\d+\], line 8, in train\(\)", out), out
    assert "nbaccel/rank/entry.py" not in out
    assert result.results[-1]["text/plain"] == "7"  # rank 0's value: 3 + 4 + 0


def test_time_paused_does_not_count_towards_the_timeout(kernel):
    def slow(prompt: str) -> str:
        time.sleep(4)  # longer than the launch's whole timeout
        return "c"

    result = kernel.execute(
        PAUSING + "\nnbaccel.notebook_launcher(train, args=(1,), num_processes=2, timeout=3)",
        answer=slow,
    )
    assert result.error is None, result.error_text
    assert result.results[-1]["text/plain"] == "3"


def test_input_in_a_rank_reads_a_line_from_the_notebook(kernel):
    typist = Typist("ada", "grace")
    result = kernel.execute(
        cell("""
        def ask():
            return input("name? ").upper()

        nbaccel.notebook_launcher(ask, num_processes=2, return_all=True)
        """),
        answer=typist,
    )
    assert result.error is None, result.error_text
    assert sorted(typist.prompts) == ["[rank 0] name?", "[rank 1] name?"]
    assert sorted(eval(result.results[-1]["text/plain"])) == ["ADA", "GRACE"]


def test_q_at_the_prompt_stops_the_launch_and_every_rank(kernel):
    typist = Typist("q")
    result = kernel.execute(
        cell("""
        def train():
            print(f"pid={os.getpid()}", flush=True)
            if int(os.environ["RANK"]) == 1:
                breakpoint()
                print("ran on", "after q")
            time.sleep(600)

        nbaccel.notebook_launcher(train, num_processes=2)
        """),
        answer=typist,
    )
    assert typist.prompts == ["(Pdb rank 1)"]
    assert result.error is not None and result.error["ename"] == "KeyboardInterrupt"
    assert "all 2 ranks were stopped" in result.error_text
    assert result.error["traceback"] == [
        "KeyboardInterrupt: launch interrupted; all 2 ranks were stopped"
    ]  # not Launch._attempt's frame, nor its source lines
    assert "ran on after q" not in result.stdout
    pids = rank_pids(result.stdout)
    assert len(pids) == 2
    assert not [p for p in pids if psutil.pid_exists(p)]


def test_interrupt_at_the_prompt_stops_the_launch(kernel):
    def interrupt(prompt: str) -> None:
        kernel.interrupt()  # the Stop button while the input box waits

    result = kernel.execute(
        PAUSING + "\nnbaccel.notebook_launcher(train, args=(1,), num_processes=2)",
        answer=interrupt,
    )
    assert result.error is not None and result.error["ename"] == "KeyboardInterrupt"
    assert "all 2 ranks were stopped" in result.error_text


def test_pythonbreakpoint_0_still_turns_breakpoint_off(kernel):
    result = kernel.execute(
        "os.environ['PYTHONBREAKPOINT'] = '0'\n"
        + PAUSING
        + "\ntry:\n    print(nbaccel.notebook_launcher(train, args=(1,), num_processes=2))\n"
        "finally:\n    del os.environ['PYTHONBREAKPOINT']",
        answer=Typist(),
    )
    assert result.error is None, result.error_text
    assert result.stdout.strip().endswith("3")


def test_kernel_shut_down_at_the_prompt_leaves_nothing_running():
    code = cell("""
        def train():
            print(f"pid={os.getpid()}", flush=True)
            if int(os.environ["RANK"]) == 1:
                breakpoint()
            time.sleep(600)

        nbaccel.notebook_launcher(train, num_processes=2)
    """)
    with KernelSession(env={"NBACCEL_VIEW": "text"}, startup="import nbaccel, os, time") as k:
        k.client.execute(code, allow_stdin=True)
        request = k.client.get_stdin_msg(timeout=120)
        assert request["content"]["prompt"] == "(Pdb rank 1)"
        k.drain_iopub(0.5)
        text = "".join(
            m["content"].get("text", "") for m in k.other_messages if m["msg_type"] == "stream"
        )
        pids = rank_pids(text)
        assert len(pids) == 2
        server = [c.pid for c in psutil.Process(k.pid).children(recursive=True)]
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        alive = [p for p in pids + server if _alive(p)]
        if not alive:
            break
        time.sleep(0.1)
    assert alive == [], "processes of the kernel still run after its shutdown"


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_other_ranks_run_on_while_a_rank_waits_at_its_prompt(kernel, tmp_path):
    """Rank 0 prints far more than a pipe holds while rank 1 waits at its prompt: the kernel
    keeps reading, so rank 0 gets past its prints before anyone answers rank 1."""
    past = tmp_path / "rank0-past-its-prints"
    prompted = tmp_path / "rank1-at-its-prompt"
    seen: list[bool] = []

    def answer_once_rank_0_is_past(prompt: str) -> str:
        prompted.touch()
        deadline = time.monotonic() + 30
        while not past.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        seen.append(past.exists())
        return "c"

    result = kernel.execute(
        cell(f"""
        def train():
            if int(os.environ["RANK"]) == 1:
                breakpoint()
                return 1
            while not os.path.exists({str(prompted)!r}):
                time.sleep(0.01)
            for i in range(3000):
                print(f"line {{i}} " + "x" * 100)
            open({str(past)!r}, "w").close()
            return 0

        nbaccel.notebook_launcher(train, num_processes=2)
        """),
        answer=answer_once_rank_0_is_past,
    )
    assert result.error is None, result.error_text
    assert seen == [True], "rank 0 was blocked while rank 1 waited at its prompt"


def test_input_where_the_frontend_sends_no_input_is_an_eoferror_that_says_why(kernel):
    result = kernel.execute(  # no answer: the request says allow_stdin=False
        cell("""
        def ask():
            try:
                return input("name? ")
            except EOFError as exc:
                return str(exc)

        print(nbaccel.notebook_launcher(ask, num_processes=2))
        """)
    )
    assert result.error is None, result.error_text
    assert "cannot read in a rank (rank 0): this frontend does not send input" in result.stdout


def test_two_ranks_that_pause_are_served_one_after_the_other(kernel):
    typist = Typist("p mine", "c", "p mine", "c")
    result = kernel.execute(
        cell("""
        def both():
            mine = f"rank {os.environ['RANK']}'s value"
            breakpoint()
            return mine

        nbaccel.notebook_launcher(both, num_processes=2, return_all=True)
        """),
        answer=typist,
    )
    assert result.error is None, result.error_text
    # Each rank's prompt twice in a row: one conversation at a time, never interleaved.
    first, second = typist.prompts[0], typist.prompts[2]
    assert typist.prompts == [first, first, second, second]
    assert {first, second} == {"(Pdb rank 0)", "(Pdb rank 1)"}
    assert "'rank 0's value'" in result.stdout.replace('"', "'")
    assert result.results[-1]["text/plain"] == '["rank 0\'s value", "rank 1\'s value"]'
