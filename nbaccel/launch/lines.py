r"""Cut a rank's output byte stream into whole lines, as a terminal would show them.

>>> s = LineSplitter()
>>> s.feed(b"epoch 1\nste")
['epoch 1']
>>> s.feed(b"p 1\rstep 2\n")
['step 2']
>>> s.flush()
[]
"""

from __future__ import annotations

MAX_PARTIAL_LINE = 1 << 16


class LineSplitter:
    """Cut a byte stream into whole lines; a carriage return keeps only what follows it,
    as a terminal would show it."""

    def __init__(self) -> None:
        self._partial = b""

    def feed(self, data: bytes) -> list[str]:
        data = self._partial + data
        *complete, self._partial = data.split(b"\n")
        if len(self._partial) > MAX_PARTIAL_LINE:  # a runaway line: emit rather than hoard
            complete.append(self._partial)
            self._partial = b""
        return [self._decode(line) for line in complete]

    def flush(self) -> list[str]:
        rest, self._partial = self._partial, b""
        return [self._decode(rest)] if rest.strip() else []

    @staticmethod
    def _decode(line: bytes) -> str:
        text = line.decode("utf-8", errors="replace").rstrip("\r")
        return text.rsplit("\r", 1)[-1]
