"""Cut a rank's output byte stream into whole lines, as a terminal would show them.

The unfinished last line is available as :attr:`LineSplitter.pending`, so a view can show a
``print("\\rstep 5", end="")`` progress line live, replaced in place. torch's own ``[rankN]:``
prefix is dropped: the views label every line with its rank already. A line longer than
``LINE_LIMIT`` bytes is cut there and ends with a note of how many bytes were dropped (the
rank's log file, :mod:`nbaccel.launch.output_logs`, has all of it), so memory and what reaches
the views stay bounded whatever a rank prints.

>>> s = LineSplitter()
>>> s.feed(b"epoch 1\\nste")
['epoch 1']
>>> s.pending
'ste'
>>> s.feed(b"p 1\\rstep 2\\n[rank0]:W1201 warning\\n")
['step 2', 'W1201 warning']
>>> s.flush()
[]
>>> LineSplitter(limit=4).feed(b"abcdefgh\\n")
['abcd … [line cut here: 4 more bytes not shown]']
"""

from __future__ import annotations

import re
from typing import Protocol

LINE_LIMIT = 1 << 16  # bytes of one line the views get; the rest is counted, not kept
_TORCH_PREFIX = re.compile(r"^\[rank\d+\]:")


class Sink(Protocol):
    """Where every byte goes as it arrives (a rank's log file)."""

    path: str | None

    def write(self, data: bytes) -> None: ...


def cut_note(dropped: int, where: str | None = None) -> str:
    """What ends a line cut at the limit: how many bytes are not shown, and where they are.

    >>> cut_note(1234, "/tmp/rank0.stdout.log")
    ' … [line cut here: 1,234 more bytes not shown; the whole line is in /tmp/rank0.stdout.log]'
    """
    rest = f"; the whole line is in {where}" if where else ""
    return f" … [line cut here: {dropped:,} more bytes not shown{rest}]"


class LineSplitter:
    """Cut a byte stream into whole lines; a carriage return keeps only what follows it,
    as a terminal would show it. ``sink`` (optional) receives every byte unchanged."""

    def __init__(self, limit: int = LINE_LIMIT, sink: Sink | None = None) -> None:
        self.limit = limit
        self.sink = sink
        self._partial = b""  # the current line's bytes, at most ``limit``
        self._dropped = 0  # bytes of the current line beyond the limit, counted only

    def feed(self, data: bytes) -> list[str]:
        if self.sink is not None:
            self.sink.write(data)
        *complete, rest = data.split(b"\n")
        lines = []
        for piece in complete:
            self._add(piece)
            lines.append(self._take())
        self._add(rest)
        return lines

    @property
    def pending(self) -> str:
        """The unfinished line as a terminal shows it now (after its last ``\\r``); "" if none."""
        if not self._partial:
            return ""
        return self._decode(self._partial) + (" …" if self._dropped else "")

    def flush(self) -> list[str]:
        if not self._partial.strip() and not self._dropped:
            self._partial = b""
            return []
        return [self._take()]

    def _add(self, piece: bytes) -> None:
        if self._dropped:  # already past the limit: only count
            self._dropped += len(piece)
            return
        line = self._partial + piece  # at most limit + one read
        if len(line) > self.limit:
            # What a carriage return with text after it replaces is gone on a terminal too.
            cr = line.rfind(b"\r", 0, len(line) - 1)
            if cr > 0:
                line = line[cr:]
        if len(line) > self.limit:
            end = self.limit
            while end > 0 and line[end] & 0xC0 == 0x80:  # cut between characters, not inside one
                end -= 1
            line, self._dropped = line[:end], len(line) - end
        self._partial = line

    def _take(self) -> str:
        text = self._decode(self._partial)
        if self._dropped:
            text += cut_note(self._dropped, self.sink.path if self.sink is not None else None)
        self._partial, self._dropped = b"", 0
        return text

    @staticmethod
    def _decode(line: bytes) -> str:
        text = line.decode("utf-8", errors="replace").rstrip("\r")
        return _TORCH_PREFIX.sub("", text.rsplit("\r", 1)[-1], count=1)
