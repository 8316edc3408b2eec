"""``%ranks status``: one row per persistent rank (pid, device, memory, state) as a table.

The table renders as HTML in a notebook and as aligned text anywhere else; the kernel measures
RSS itself (psutil), the ranks report their GPU memory after each command.
"""

from __future__ import annotations

import html
import time
from typing import Any

import psutil

COLUMNS = ("rank", "pid", "device", "RSS", "GPU memory", "state")


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.0f} MiB"


def rank_rows(ranks: Any) -> list[dict[str, str]]:
    """The status of each rank of a :class:`~nbaccel.persistent.session.Ranks` session (``None``:
    none was started yet).

    >>> rank_rows(None)[0]["state"]
    'not running'
    """
    if ranks is None or not ranks.started:
        state = f"broken: {ranks.broken}" if ranks is not None and ranks.broken else "not running"
        return [
            {"rank": "-", "pid": "-", "device": "-", "RSS": "-", "GPU memory": "-", "state": state}
        ]
    rows = []
    running = ranks.running
    for r in ranks._relay.group.ranks:
        try:
            rss = psutil.Process(r.pid).memory_info().rss
        except psutil.Error:
            rss = None
        device, gpu = ranks._devices.get(r.rank, ("-", None))
        if r.exitcode() is not None:
            state = f"exited ({r.exitcode()})"
        elif running is not None:
            state = f"running {running[0]!r} for {time.monotonic() - running[1]:.1f} s"
        else:
            state = "idle"
        rows.append(
            {
                "rank": str(r.rank),
                "pid": str(r.pid),
                "device": device,
                "RSS": _mib(rss),
                "GPU memory": _mib(gpu),
                "state": state,
            }
        )
    return rows


class StatusTable:
    """Rows of ``%ranks status``; shows as an HTML table in notebooks, as text elsewhere.

    Example::

        ranks.status()          # rank  pid    device  RSS     GPU memory  state
    """

    def __init__(self, rows: list[dict[str, str]]) -> None:
        self.rows = rows

    def __repr__(self) -> str:
        widths = {c: max(len(c), *(len(row[c]) for row in self.rows)) for c in COLUMNS}
        lines = ["  ".join(c.ljust(widths[c]) for c in COLUMNS)]
        lines += ["  ".join(row[c].ljust(widths[c]) for c in COLUMNS) for row in self.rows]
        return "\n".join(line.rstrip() for line in lines)

    def _repr_html_(self) -> str:
        head = "".join(f"<th>{html.escape(c)}</th>" for c in COLUMNS)
        body = "".join(
            "<tr>" + "".join(f"<td>{html.escape(row[c])}</td>" for c in COLUMNS) + "</tr>"
            for row in self.rows
        )
        return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"
