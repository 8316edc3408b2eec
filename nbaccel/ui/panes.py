"""A rank's output pane: its last lines (at most ``PANE_LINES`` of them, ``PANE_CHARS``
characters in all, each line at most ``LONG_LINE``), a count of dropped ones, the live
unfinished line, rendered as HTML that stays scrolled to the newest line.

The limits bound what one pane update sends, whatever a rank prints; every line is in the
rank's log file (:mod:`nbaccel.launch.output_logs`).

>>> buf = PaneBuffer(limit=2)
>>> buf.extend("stdout", ["a", "b", "c"])
>>> buf.lines(), buf.dropped
(['b', 'c'], 1)
>>> buf.set_partial("stdout", "step 5")
True
>>> "step 5" in pane_html(0, buf)
True
"""

from __future__ import annotations

import collections
import html

PANE_LINES = 1000  # output lines kept per rank in its pane
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


def pane_html(rank: int, buffer: PaneBuffer, log: str | None = None) -> str:
    """The pane as HTML (``log``: the file with every line, named where lines were dropped).
    The outer box is a reversed flex column, so the browser keeps it scrolled to the newest
    line each time the content is replaced (no script needed)."""
    body = [_line(stream, text) for stream, text in buffer.entries()]
    if buffer.partial is not None:
        body.append(_line(*buffer.partial, cls="nbaccel-partial"))
    note = ""
    if buffer.dropped:
        note = (
            f"<div class='nbaccel-dropped' style='color:#57606a;font-size:11px'>"
            f"{buffer.dropped:,} earlier lines dropped; showing the last {len(buffer.entries()):,}"
            f"{'; every line is in ' + html.escape(log) if log else ''}</div>"
        )
    text = "\n".join(body) or "<span style='color:#57606a'>(no output yet)</span>"
    return (
        f"{note}<div class='nbaccel-pane-box' style='max-height:14em;overflow:auto;width:100%;"
        "box-sizing:border-box;display:flex;flex-direction:column-reverse;"
        "border:1px solid #d0d7de;border-radius:3px'>"
        f"<pre class='nbaccel-pane' data-rank='{rank}' data-lines='{buffer.total}' "
        f"data-dropped='{buffer.dropped}' style='flex-shrink:0;overflow:visible;margin:0;padding:2px 4px;font-size:12px;"
        f"line-height:1.3'>{text}</pre></div>"
    )
