"""A rank's output pane: the last ``PANE_LINES`` lines, a count of dropped ones, the live
unfinished line, rendered as HTML that stays scrolled to the newest line.

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


class PaneBuffer:
    def __init__(self, limit: int = PANE_LINES) -> None:
        self._lines: collections.deque[tuple[str, str]] = collections.deque(maxlen=limit)
        self.total = 0  # lines received
        self.partial: tuple[str, str] | None = None  # (stream, text) of the unfinished line

    @property
    def dropped(self) -> int:
        return self.total - len(self._lines)

    def extend(self, stream: str, lines: list[str]) -> None:
        self._lines.extend((stream, line) for line in lines)
        self.total += len(lines)

    def set_partial(self, stream: str, text: str) -> bool:
        """Show ``text`` as the live last line ("" clears it); report whether it changed."""
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


def pane_html(rank: int, buffer: PaneBuffer) -> str:
    """The pane as HTML. The outer box is a reversed flex column, so the browser keeps it
    scrolled to the newest line each time the content is replaced (no script needed)."""
    body = [_line(stream, text) for stream, text in buffer.entries()]
    if buffer.partial is not None:
        body.append(_line(*buffer.partial, cls="nbaccel-partial"))
    note = ""
    if buffer.dropped:
        note = (
            f"<div class='nbaccel-dropped' style='color:#57606a;font-size:11px'>"
            f"{buffer.dropped:,} earlier lines dropped; showing the last {len(buffer.entries()):,}"
            "</div>"
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
