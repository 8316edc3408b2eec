"""Post-mortem of a failed rank in a real kernel: ``%debug`` and ``nbaccel.debug()`` open the
failing rank's own frames, with its locals, answered on the stdin channel as a frontend does."""

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


def cell(code: str) -> str:
    return textwrap.dedent(code).strip()


FAILING = cell("""
    import threading
    import torch

    def scale(batch, factor):
        return batch["labels"] * factor        # rank 1's bug: no "labels"

    def train():
        rank = int(os.environ["RANK"])
        seen = [rank, "batch", 3]
        weights = torch.arange(4.0, requires_grad=True) * 2
        big = torch.zeros(2048, 2048)          # 16 MiB: described, not sent
        lock = threading.Lock()                # cannot be pickled: described
        if rank == 1:
            return scale({"inputs": seen}, 2)
        time.sleep(600)

    nbaccel.notebook_launcher(train, num_processes=2)
""")


def lines_for(*lines: str):
    answers = list(lines)
    prompts: list[str] = []

    def answer(prompt: str) -> str:
        prompts.append(prompt)
        return answers.pop(0) if answers else "q"

    return answer, prompts


def plain(text: str) -> str:
    return re.sub(r"\x1b\[[0-9;]*m", "", text)


def test_debug_magic_after_a_failed_launch_opens_the_failing_ranks_frames(kernel):
    failed = kernel.execute(FAILING)
    assert failed.error is not None and failed.error["ename"] == "RankFailedError"
    answer, prompts = lines_for(
        "p batch", "p factor", "u", "p seen", "p weights", "p big", "p lock", "w", "u", "q"
    )
    assert kernel.execute("%time 1").error is None  # IPython loads ExecutionMagics' others
    result = kernel.execute("%debug", answer=answer)
    assert result.error is None, result.error_text
    assert prompts[0] == "ipdb rank 1> "
    out = plain(result.stdout)
    assert "post-mortem of rank 1" in out
    assert "{'inputs': [1, 'batch', 3]}" in out  # the innermost frame's locals
    assert "\n2\n" in out
    assert "[1, 'batch', 3]" in out  # `u`: train's list, on rank 1
    assert "tensor([0., 2., 4., 6.])" in out  # detached, on the CPU
    assert "<not sent from the rank: torch.Tensor shape (2048, 2048) float32 cpu" in out
    assert "<not sent from the rank: _thread.lock (cannot be pickled: TypeError)" in out
    assert "Oldest frame" in out  # `u` past train: nbaccel's frames are not there
    assert "nbaccel/rank" not in out
    assert re.search(r"Cell In\[\d+\]", out), out


def test_nbaccel_debug_is_the_same_as_a_function(kernel):
    failed = kernel.execute(FAILING)
    assert failed.error is not None
    answer, prompts = lines_for("p factor * 10", "q")
    result = kernel.execute("nbaccel.debug()", answer=answer)
    assert result.error is None, result.error_text
    assert "20" in plain(result.stdout)


def test_debug_magic_after_another_error_is_ipythons_own(kernel):
    failed = kernel.execute("def oops():\n    local_value = 41\n    1 / 0\noops()")
    assert failed.error is not None
    answer, prompts = lines_for("p local_value + 1", "q")
    result = kernel.execute("%debug", answer=answer)
    assert result.error is None, result.error_text
    assert prompts[0] == "ipdb> "
    assert "42" in plain(result.stdout)
