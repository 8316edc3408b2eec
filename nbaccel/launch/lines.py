"""Cut a rank's output byte stream into whole lines, as a terminal would show them.

The unfinished last line is available as :attr:`LineSplitter.pending`, so a view can show a
``print("\\rstep 5", end="")`` progress line live, replaced in place. torch's own ``[rankN]:``
prefix is dropped: the views label every line with its rank already.

>>> s = LineSplitter()
>>> s.feed(b"epoch 1\\nste")
['epoch 1']
>>> s.pending
'ste'
>>> s.feed(b"p 1\\rstep 2\\n[rank0]:W1201 warning\\n")
['step 2', 'W1201 warning']
>>> s.flush()
[]
"""

from __future__ import annotations

import re

MAX_PARTIAL_LINE = 1 << 16
_TORCH_PREFIX = re.compile(r"^\[rank\d+\]:")


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

    @property
    def pending(self) -> str:
        """The unfinished line as a terminal shows it now (after its last ``\\r``); "" if none."""
        return self._decode(self._partial) if self._partial else ""

    def flush(self) -> list[str]:
        rest, self._partial = self._partial, b""
        return [self._decode(rest)] if rest.strip() else []

    @staticmethod
    def _decode(line: bytes) -> str:
        text = line.decode("utf-8", errors="replace").rstrip("\r")
        return _TORCH_PREFIX.sub("", text.rsplit("\r", 1)[-1], count=1)
