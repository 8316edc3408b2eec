"""Small frictions a newcomer met in the first hour (issue 34), each checked where it happens."""

from __future__ import annotations

import pytest


@pytest.fixture
def shell():
    """An IPython shell in this process for the test, gone after it (other tests see none)."""
    from IPython.core.interactiveshell import InteractiveShell

    yield InteractiveShell.instance()
    InteractiveShell.clear_instance()


def test_ranks_status_before_any_start_says_not_running_as_after_a_stop(shell):
    from nbaccel.persistent.magics import RanksMagics

    magics = RanksMagics(shell)
    table = magics._line("status")  # raised a UsageError before any `%ranks start`
    assert "not running" in repr(table) and "not running" in table._repr_html_()


def test_the_failures_text_names_cells_as_the_rendered_traceback_does(shell):
    import linecache

    from nbaccel.core.errors import RankFailedError
    from nbaccel.core.local_traceback import name_cell, render_launch_error

    cell_file = "/tmp/ipykernel_4243/7654321.py"  # where ipykernel compiles a cell
    source = "def boom():\n    raise ValueError('bad batch')\n"
    linecache.cache[cell_file] = (len(source), None, source.splitlines(True), cell_file)
    name_cell(cell_file, 16)
    remote = (
        "Traceback (most recent call last):\n"
        f'  File "{cell_file}", line 2, in boom\n'
        "    raise ValueError('bad batch')\n"
        "ValueError: bad batch\n"
    )
    err = RankFailedError(0, 2, "raised ValueError: bad batch", remote, "builtins.ValueError")
    rendered = "\n".join(render_launch_error(err, colour=False))
    assert "Cell In[16], line 2, in boom()" in rendered
    # str(error) is the evalue a saved notebook and nbconvert show: the same cell, not its file.
    assert "  Cell In[16], line 2, in boom\n    raise ValueError('bad batch')" in str(err)
    assert cell_file not in str(err)
    assert err.remote_traceback == remote  # the rank's own text is kept as it came


def fails_silently():
    raise ValueError("bad batch")


@pytest.mark.slow  # a real rank
def test_a_failed_launch_names_the_log_that_has_its_traceback(capfd):
    import glob

    import nbaccel
    from nbaccel.core.errors import RankFailedError

    with pytest.raises(RankFailedError):
        nbaccel.notebook_launcher(fails_silently, num_processes=1, progress="text")
    out = capfd.readouterr().out
    assert "full output of every rank: " in out, out  # as a launch that printed says
    folder = out.split("full output of every rank: ", 1)[1].split("/rank*.log", 1)[0]
    (log,) = glob.glob(f"{folder}/rank0.stderr.log")
    with open(log) as f:
        text = f.read()
    assert 'raise ValueError("bad batch")' in text and "ValueError: bad batch" in text
