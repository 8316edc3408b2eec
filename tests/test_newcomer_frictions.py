"""Small frictions a newcomer met in the first hour (issue 34), each checked where it happens."""

from __future__ import annotations


def test_ranks_status_before_any_start_says_not_running_as_after_a_stop():
    from IPython.core.interactiveshell import InteractiveShell

    from nbaccel.launch.magics import RanksMagics

    magics = RanksMagics(InteractiveShell.instance())
    table = magics._line("status")  # raised a UsageError before any `%ranks start`
    assert "not running" in repr(table) and "not running" in table._repr_html_()
