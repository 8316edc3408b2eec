"""``breakpoint()`` and ``%debug`` in ``%%ranks`` cells, in a real kernel answered on its stdin
channel as a frontend does: the ranks are alive, so both are their real frames."""

from __future__ import annotations

import pytest

from tests.kernel_helpers import KernelSession, typed

pytestmark = pytest.mark.slow  # a real kernel


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ranks-tmp")
    env = {"NBACCEL_VIEW": "text", "TMPDIR": str(tmp)}
    with KernelSession(env=env, startup="import nbaccel, os, time") as k:
        cell = k.execute("%ranks start -n 2 --timeout 60  # gloo on CPU")
        assert cell.error is None, cell.error_text
        # Nothing of nbaccel's in the temporary directory once the ranks run: a kernel shut
        # down without `%ranks stop` left its nbaccel-ranks-* folder behind.
        assert [p.name for p in tmp.iterdir() if p.name.startswith("nbaccel-")] == []
        yield k
        k.execute("%ranks stop")
        assert k.leftovers() == []


def test_breakpoint_in_a_ranks_cell_opens_pdb_in_the_cell(ranks):
    answer, prompts = typed("p x", "x.append(5)", "c")
    cell = ranks.execute(
        "%%ranks --rank 1\nx = [1, 2]\nbreakpoint()\ny = len(x)\nprint('y is', y)", answer=answer
    )
    assert cell.error is None, cell.error_text
    assert prompts == ["(Pdb rank 1)"] * 3
    assert "[1, 2]" in cell.stdout
    assert "y is 3" in cell.stdout  # the rank ran on with the list changed at the prompt
    assert ranks.execute("%%ranks --rank 1\nprint(x)").stdout.count("[1, 2, 5]") == 1


def test_debug_after_a_cell_error_enters_the_failing_ranks_real_frames(ranks):
    failed = ranks.execute(
        "%%ranks\nimport os\n"
        "def lookup(table, key):\n"
        "    return table[key]\n"
        "seen = {'rank': int(os.environ['RANK'])}\n"
        "if seen['rank'] == 1:\n"
        "    lookup(seen, 'missing')\n"
    )
    assert failed.error is not None and failed.error["ename"] == "CellError"
    answer, prompts = typed("p key", "u", "p seen", "seen['fixed'] = True", "q")
    cell = ranks.execute("%debug", answer=answer)
    assert cell.error is None, cell.error_text
    assert prompts[0] == "(Pdb rank 1)"
    assert "'missing'" in cell.stdout
    assert "{'rank': 1}" in cell.stdout
    # Real frames: what was assigned at the prompt is in the rank's namespace.
    after = ranks.execute("%%ranks --rank 1\nprint(seen)")
    assert "'fixed': True" in after.stdout
    # The next cell let go of the failure: %debug now says so.
    again = ranks.execute("%debug", answer=typed()[0])
    assert again.error is not None and "no failed cell to debug" in again.error_text


def stop_at_first_prompt(kernel, later: str):
    """Presses Stop while the first input box waits (as test_debug_breakpoint does for a
    launch); any later prompt is answered ``later``, so a cell that asks again ends instead of
    waiting for a person."""
    prompts: list[str] = []

    def answer(prompt: str) -> str | None:
        prompts.append(prompt)
        if len(prompts) == 1:
            kernel.interrupt()
            return None
        return later

    return answer, prompts


def assert_interrupted_and_alive(ranks, cell) -> None:
    assert cell.error is not None and cell.error["ename"] == "KeyboardInterrupt", cell.error_text
    assert "the ranks are alive" in cell.error_text, cell.error_text
    # One line: not nbaccel's frames (cell.py, magics.py) nor the cell's run_cell_magic call.
    assert len(cell.error["traceback"]) == 1, cell.error_text
    after = ranks.execute("%%ranks\nkept")  # the ranks lived on, with their state
    assert "[rank0] Out: 'state'" in after.stdout, after.error_text
    assert "[rank1] Out: 'state'" in after.stdout, after.error_text


@pytest.mark.parametrize(
    "code",
    [
        "x = input('name? ')",  # both ranks ask: the other rank's question was asked next
        "breakpoint()\ny = 1",  # both ranks in pdb: pdb catches the interrupt and asks again
        "if accelerator.process_index == 1:\n    breakpoint()\ny = 1",
    ],
    ids=["input-on-both", "breakpoint-on-both", "breakpoint-on-one"],
)
def test_stop_at_a_prompt_interrupts_the_cell_and_asks_nothing_more(ranks, code):
    """Before: the input box came back (another rank's question, or pdb's own after
    ``--KeyboardInterrupt--``) and a second Stop broke the ranks, losing their state."""
    assert ranks.execute("%%ranks\nkept = 'state'").error is None
    answer, prompts = stop_at_first_prompt(ranks, later="c")
    cell = ranks.execute(f"%%ranks\n{code}", answer=answer, timeout=60)
    assert len(prompts) == 1, prompts
    assert_interrupted_and_alive(ranks, cell)


def test_q_in_one_ranks_pdb_interrupts_the_cell_and_the_other_rank_is_not_asked(ranks):
    """Before: ``q`` at rank 0's prompt interrupted the cell, rank 1's pdb asked again, and its
    ``q`` (a second interrupt) broke the ranks."""
    assert ranks.execute("%%ranks\nkept = 'state'").error is None
    answer, prompts = typed("q", "q")
    cell = ranks.execute("%%ranks\nbreakpoint()\ny = 1", answer=answer, timeout=60)
    assert len(prompts) == 1, prompts
    assert_interrupted_and_alive(ranks, cell)


@pytest.mark.parametrize("how", ["q", "stop"])
def test_q_or_stop_runs_no_code_of_the_cell_after_it_whatever_the_except(ranks, how):
    """Before: pdb's ``q`` left the rank with ``BdbQuit``, an ``Exception``: an
    ``except Exception`` around ``breakpoint()`` caught it and the cell ran on."""
    assert ranks.execute("%%ranks\nkept = 'state'\nran_on = []").error is None
    code = (
        "if accelerator.process_index == 1:\n"
        "    try:\n"
        "        breakpoint()\n"
        "        y = 1\n"
        "    except Exception as exc:\n"
        "        ran_on.append(type(exc).__name__)\n"
        "    ran_on.append('after')\n"
    )
    answer, _ = typed("q") if how == "q" else stop_at_first_prompt(ranks, later="q")
    cell = ranks.execute(f"%%ranks\n{code}", answer=answer, timeout=60)
    assert_interrupted_and_alive(ranks, cell)
    after = ranks.execute("%%ranks --rank 1\nran_on")
    assert "Out: []" in after.stdout, after.stdout


def test_what_a_rank_printed_before_its_breakpoint_reads_above_its_pdb(ranks):
    """A ``%%ranks`` cell holds each rank's burst of lines a moment (so two ranks' blocks do not
    interleave); pdb's header was printed past them, above what the rank had printed first."""
    answer, _ = typed("c")
    cell = ranks.execute(
        "%%ranks --rank 1\nprint('before the breakpoint')\nbreakpoint()\nz = 1", answer=answer
    )
    assert cell.error is None, cell.error_text
    lines = cell.stdout.splitlines()
    printed = lines.index("[rank1] before the breakpoint")
    header = next(i for i, line in enumerate(lines) if line.startswith("> "))
    assert printed < header, cell.stdout
