"""A rank started as a plain subprocess (``launch.subprocesses``): ``python -m
nbaccel.rank.subprocess_entry FD`` reads its pickled ``RankSpec`` and the numbers of its four
pipes' write ends from ``FD``, then runs :func:`nbaccel.rank.entry.run_rank` as a
multiprocessing child would.

Example (what the group runs; ``7`` is the descriptor it passed)::

    python -m nbaccel.rank.subprocess_entry 7
"""

from __future__ import annotations

import multiprocessing.connection
import os
import pickle
import sys


def main(fd: int) -> None:
    """Read the spec and the pipes' descriptors from ``fd``, then run the rank."""
    with os.fdopen(fd, "rb") as source:
        spec, ends = pickle.load(source)
    out_w, err_w, diag_w, events_w = (
        multiprocessing.connection.Connection(end, readable=False) for end in ends
    )
    from nbaccel.rank.entry import run_rank

    run_rank(spec, out_w, err_w, diag_w, events_w)


if __name__ == "__main__":
    main(int(sys.argv[1]))
