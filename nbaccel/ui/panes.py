"""A rank's output pane: its last lines (at most ``PANE_LINES`` of them, ``PANE_CHARS``
characters in all, each line at most ``LONG_LINE``), a count of dropped ones, the live
unfinished line, shown as blocks of widgets that stay scrolled to the newest line.

An update sends the blocks that changed (the newest, as lines arrive), and the limits bound it
whatever a rank prints; every line is in the rank's log file (:mod:`nbaccel.launch.output_logs`).

>>> buf = PaneBuffer(limit=2)
>>> buf.extend("stdout", ["a", "b", "c"])
>>> buf.lines(), buf.dropped
(['b', 'c'], 1)
>>> buf.set_partial("stdout", "step 5")
True
"""

from __future__ import annotations

import collections
import html
from collections.abc import Callable
from typing import Any

PANE_LINES = 1000  # output lines kept per rank in its pane
BLOCK_LINES = 50  # lines per block widget of a pane: what one update resends at most
PANE_CHARS = 64 * 1024  # characters of those lines in all
LONG_LINE = 8 * 1024  # a longer line shows its start and its end (where a cut line's note is)
_LONG_END = 1024


def shorten(text: str, limit: int = LONG_LINE) -> str:
    """``text`` as a pane shows it: its start and its end where it is longer than ``limit``.

    >>> shorten("a" * 10 + "b" * 10, limit=8)
    'aaaaaa … [12 characters not shown here] … bb'
    """
    if len(text) <= limit:
        return text
    end = min(_LONG_END, limit // 4)
    start = limit - end
    return f"{text[:start]} … [{len(text) - limit:,} characters not shown here] … {text[-end:]}"


class PaneBuffer:
    def __init__(self, limit: int = PANE_LINES, chars: int = PANE_CHARS) -> None:
        self._lines: collections.deque[tuple[str, str]] = collections.deque()
        self._limit, self._chars_limit = limit, chars
        self._chars = 0
        self.total = 0  # lines received
        self.partial: tuple[str, str] | None = None  # (stream, text) of the unfinished line

    @property
    def dropped(self) -> int:
        return self.total - len(self._lines)

    def extend(self, stream: str, lines: list[str]) -> None:
        self.total += len(lines)
        for line in lines[-self._limit :]:
            line = shorten(line)
            self._lines.append((stream, line))
            self._chars += len(line)
        while len(self._lines) > self._limit or (
            self._chars > self._chars_limit and len(self._lines) > 1
        ):
            self._chars -= len(self._lines.popleft()[1])

    def set_partial(self, stream: str, text: str) -> bool:
        """Show ``text`` as the live last line ("" clears it); report whether it changed."""
        text = shorten(text)
        new = (stream, text) if text else None
        if new == self.partial:
            return False
        if new is None and self.partial is not None and self.partial[0] != stream:
            return False  # the other stream finished a line; this one's partial stays
        self.partial = new
        return True

    def lines(self) -> list[str]:
        return [text for _, text in self._lines]

    def entries(self) -> list[tuple[str, str]]:
        return list(self._lines)


def _line(stream: str, text: str, cls: str = "") -> str:
    style = " style='color:#cf222e'" if stream == "stderr" else ""
    klass = f" class='{cls}'" if cls else ""
    return f"<span{klass}{style}>{html.escape(text)}</span>"


PRE_STYLE = "overflow:visible;margin:0;padding:0 4px;font-size:12px;line-height:1.3"


class PaneView:
    """A rank's pane as widgets: a note (dropped lines) above a scrolled box of blocks, HTML
    widgets of ``BLOCK_LINES`` lines each (by line number). An update sets only the blocks whose
    text changed: the newest one as lines arrive, all of them only after a flood replaced the
    whole tail. Only whole blocks are shown, so the oldest one does not change as lines scroll
    out. The box is a reversed flex column with the newest block first, so the browser keeps it
    at the newest line (no script needed).

    ``make(cls, **traits)`` makes each widget (the dashboard's, which closes them at the end).
    """

    def __init__(self, rank: int, make: Callable[..., Any]) -> None:
        import ipywidgets as w

        self.rank, self._make, self._html = rank, make, w.HTML
        self.note = make(w.HTML, value="", layout={"margin": "0"})
        box_layout = {
            "max_height": "14em",
            "overflow": "auto",
            "width": "100%",
            "flex_flow": "column-reverse",
            "border": "1px solid #d0d7de",
            "margin": "0",
        }
        self.box = make(w.Box, children=(), layout=box_layout)
        self.box.add_class("nbaccel-pane-box")
        self.widget = make(w.VBox, children=[self.note, self.box], layout={"width": "100%"})
        self._blocks: dict[int, Any] = {}  # block number -> the widget showing it
        self._free: list[Any] = []  # block widgets scrolled out, to show newer blocks

    def clear(self) -> None:
        """Forget what the blocks show (a new launch shows the pane again): each is free for
        the next lines, and ``changes`` sets what they show."""
        self._free += self._blocks.values()
        self._blocks = {}

    def changes(self, buffer: PaneBuffer, log: str | None = None) -> list[tuple[Any, str, Any]]:
        """(widget, trait, value) to set so the pane shows ``buffer`` (``log``: the file with
        every line, named where lines were dropped). Unchanged values cost nothing to set."""
        entries, first = buffer.entries(), buffer.total - len(buffer.entries())
        newest = max(buffer.total - 1, 0) // BLOCK_LINES
        oldest = min(-(-first // BLOCK_LINES), newest)
        wanted = range(oldest, newest + 1)
        for k in [k for k in self._blocks if k not in wanted]:
            self._free.append(self._blocks.pop(k))
        out: list[tuple[Any, str, Any]] = []
        for k in wanted:
            lo = max(k * BLOCK_LINES, first) - first
            body = [_line(*entry) for entry in entries[lo : (k + 1) * BLOCK_LINES - first]]
            if k == newest and buffer.partial is not None:
                body.append(_line(*buffer.partial, cls="nbaccel-partial"))
            text = "\n".join(body) or "<span style='color:#57606a'>(no output yet)</span>"
            value = (
                f"<pre class='nbaccel-pane' data-rank='{self.rank}' data-block='{k}' "
                f"style='{PRE_STYLE}'>{text}</pre>"
            )
            if k not in self._blocks:
                if self._free:
                    self._blocks[k] = self._free.pop()
                else:  # made with its value: no second message
                    layout = {"margin": "0", "flex": "0 0 auto"}
                    self._blocks[k] = self._make(self._html, value=value, layout=layout)
            out.append((self._blocks[k], "value", value))
        out.append((self.box, "children", tuple(self._blocks[k] for k in reversed(wanted))))
        dropped = max(oldest * BLOCK_LINES, first)  # changes only as a block scrolls out
        out.append((self.note, "value", dropped_note(dropped, log)))
        return out


def dropped_note(dropped: int, log: str | None) -> str:
    """The line above a pane that lost its earlier lines ("" when it has all of them)."""
    if not dropped:
        return ""
    where = f"; every line is in {html.escape(log)}" if log else ""
    return (
        "<div class='nbaccel-dropped' style='color:#57606a;font-size:11px'>"
        f"{dropped:,} earlier lines dropped{where}</div>"
    )
