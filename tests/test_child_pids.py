"""``core.process_table.child_pids``: a process's children from ``/proc``, as psutil's scan finds them."""

from __future__ import annotations

import os
import subprocess
import threading

import psutil

from nbaccel.core import process_table


def test_child_pids_are_psutils_children_whichever_thread_started_them():
    """The quick look a rank's exit and a launch's sweep take at a process's children lists
    what psutil's full scan lists: children started from the main thread and from another
    one (each thread has its own children file), and nothing once they are reaped."""

    def psutils() -> list[int]:
        return sorted(p.pid for p in psutil.Process().children())

    before = psutils()  # (the fork server, when an earlier test started it)
    assert sorted(process_table.child_pids() or []) == before
    from_main = subprocess.Popen(["sleep", "30"])
    started: list[subprocess.Popen] = []
    thread = threading.Thread(target=lambda: started.append(subprocess.Popen(["sleep", "30"])))
    thread.start()
    thread.join()
    try:
        expected = psutils()
        assert sorted(process_table.child_pids() or []) == expected
        assert sorted(process_table.child_pids(os.getpid()) or []) == expected
        assert {from_main.pid, started[0].pid} <= set(expected)
    finally:
        for p in (from_main, *started):
            p.kill()
            p.wait()
    assert sorted(process_table.child_pids() or []) == before
    assert process_table.child_pids(2**22 + 1) is None  # no such process
