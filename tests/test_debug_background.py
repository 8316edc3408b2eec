"""A rank paused in a background launch: the views say so with the line to run, and
``launch.debug()`` opens its pdb in the cell that runs it (a real kernel, answered on its stdin
channel as a frontend does)."""

from __future__ import annotations

import re
import textwrap

import pytest

from tests.kernel_helpers import text_view_kernel

pytestmark = pytest.mark.slow  # a real kernel


@pytest.fixture(scope="module")
def kernel():
    yield from text_view_kernel()


@pytest.fixture(autouse=True)
def nothing_left_in_kernel(kernel):
    yield
    assert kernel.leftovers() == [], "the kernel still has rank processes"


START = textwrap.dedent("""
    def train():
        values = [int(os.environ["RANK"]), 5]
        if values[0] == 1:
            breakpoint()
            values.append(6)
        time.sleep(0.5)
        return sum(values)

    launch = nbaccel.notebook_launcher(train, num_processes=2, block=False, timeout=3)
    while not any(r.paused for r in (launch.state.ranks.values() if launch.state else [])):
        time.sleep(0.05)
    from nbaccel.ui.summary import stall_text
    print(stall_text(launch.state, time.monotonic()))
""").strip()


def typed(*lines: str):
    answers, prompts = list(lines), []

    def answer(prompt: str) -> str:
        prompts.append(prompt)
        return answers.pop(0)

    return answer, prompts


def test_launch_debug_opens_a_paused_ranks_pdb_in_the_calling_cell(kernel):
    started = kernel.execute(START, timeout=60)
    assert started.error is None, started.error_text
    assert "rank 1 paused in breakpoint() at Cell In[" in started.stdout
    assert "run launch.debug() in a cell to debug it" in started.stdout
    shown = kernel.execute("print(repr(launch))")  # paused, not "running", says the handle
    assert shown.stdout.startswith("<nbaccel.Launch paused: rank 0 ") and (
        "rank 1 paused," in shown.stdout
    ), shown.stdout
    kernel.execute("time.sleep(4)")  # past the launch's timeout: a paused launch does not time out
    answer, prompts = typed("p values", "c")
    served = kernel.execute("launch.debug()", answer=answer)
    assert served.error is None, served.error_text
    assert prompts == ["(Pdb rank 1)"] * 2
    assert "[1, 5]" in served.stdout
    # The banner names the line pdb shows (the one after breakpoint()), not breakpoint()'s own.
    (paused_at,) = re.findall(
        r"paused in breakpoint\(\) at (Cell In\[\d+\], line \d+)", started.stdout
    )
    assert f"{paused_at}, in train()" in served.stdout, (paused_at, served.stdout)
    assert served.results == []  # no "Out: 1" (how many ranks were served) under the pdb
    result = kernel.execute("launch.result(timeout=30)")
    assert result.error is None, result.error_text
    assert result.results[-1]["text/plain"] == "5"


def test_q_in_launch_debug_stops_the_launch(kernel):
    assert kernel.execute(START, timeout=60).error is None
    answer, _ = typed("q")
    assert kernel.execute("launch.debug()", answer=answer).error is None
    result = kernel.execute("launch.result(timeout=30)")
    assert result.error is not None and result.error["ename"] == "LaunchStoppedError"


def test_stop_at_the_prompt_of_launch_debug_stops_the_launch_without_nbaccels_frames(kernel):
    """Stop while ``launch.debug()``'s input box waits: the launch stops as ``stop()`` stops it
    (documented with ``q``, which the test above covers). Before, the cell's error showed the
    relay's frames down to ipykernel's ``_input_request`` for a press of the Stop button."""
    assert kernel.execute(START, timeout=60).error is None

    def stop(prompt: str) -> None:
        kernel.interrupt()  # the Stop button while the input box waits

    cell = kernel.execute("launch.debug()", answer=stop)
    assert cell.error is not None and cell.error["ename"] == "KeyboardInterrupt"
    assert "the launch is stopped" in cell.error_text, cell.error_text
    text = cell.error_text
    assert "debugging.py" not in text and "kernelbase.py" not in text, text  # their frames
    assert len(cell.error["traceback"]) == 1, text  # nor launch.debug's own frame
    result = kernel.execute("launch.result(timeout=30)")
    assert result.error is not None and result.error["ename"] == "LaunchStoppedError"
