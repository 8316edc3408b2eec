"""The kernel's side of the mirror: which of the kernel's modules the fork server imports too,
so ranks find them loaded, and the conversation with the server (``nbaccel.rank.mirror``).

What qualifies (:func:`candidates`): a module the kernel has loaded, in the order it loaded them,
whose file lies in a site-packages folder (installed code, which a session does not edit), that
is no part of the kernel's side (``core.mirror_protocol.KERNEL_SIDE``), of the standard library
or of nbaccel. The user's own modules (files in the working directory, on ``PYTHONPATH``,
editable installs) are never mirrored: each rank imports them afresh, so one edited and reloaded
in the kernel arrives edited.

When names travel: those loaded before the server started go with it (a file it reads); after
each cell, what the cell imported (``ForkServer.follow_kernel``, so the server imports it while the
person writes the next cell); before ranks are forked, the names the launched function refers to (strings in its pickle: ``from
transformers import Trainer`` in its body, a global module) go with ``HOLD`` and are waited for;
after the forks, ``GO`` and the rest. So a launch waits only for imports its ranks would make
themselves (the server makes each once, for every rank) and for the one import under way; from
the next launch on, everything the kernel had is warm in every rank.
"""

from __future__ import annotations

import collections
import functools
import json
import os
import pickletools
import select
import shutil
import socket
import sys
import sysconfig
import tempfile
import time
from collections.abc import Iterable
from typing import Any

from nbaccel.core.events import RankSpec
from nbaccel.core.mirror_protocol import (
    ENV_ADDRESS,
    ENV_FILE,
    GO,
    HOLD,
    PATH,
    kernel_side,
    parse_line,
)

# Submodules whose choice is the kernel's (tqdm's notebook bars draw through it).
KERNEL_CHOICES = ("tqdm.notebook", "tqdm.autonotebook", "tqdm.auto", "google.colab")
# A server that answers nothing for this long is importing something that hangs: it is replaced.
SILENCE_DEADLINE = 120.0

_never: set[str] = set()  # failed, loaded CUDA or hung in a server: not sent again


@functools.cache
def _site_dirs() -> tuple[str, ...]:
    import site

    paths = sysconfig.get_paths()
    dirs = {paths.get("purelib"), paths.get("platlib")}
    dirs.update(getattr(site, "getsitepackages", list)())
    dirs.add(getattr(site, "getusersitepackages", str)())
    found = {os.path.join(f(d), "") for d in dirs if d for f in (os.path.abspath, os.path.realpath)}
    return tuple(found)


def candidates(modules: dict[str, Any] | None = None) -> list[str]:
    """The kernel's modules the fork server should import too, in the order they were loaded.

    >>> import json
    >>> candidates({"json": json})  # the standard library is never mirrored
    []
    """
    modules = sys.modules if modules is None else modules
    names = []
    for name, module in list(modules.items()):
        verdict = _verdicts.get(name)
        if verdict is None or verdict[0] is not module:
            verdict = _verdicts[name] = (module, _qualifies(name, module))
        if verdict[1] and name not in _never:
            names.append(name)
    return names


# name → (module, whether it qualifies): a launch asks about every loaded module (thousands with
# transformers), and finding a module's real path is a few system calls.
_verdicts: dict[str, tuple[Any, bool]] = {}


def _qualifies(name: str, module: Any) -> bool:
    if (
        name.partition(".")[0] in sys.stdlib_module_names
        or kernel_side(name)
        or name.startswith(KERNEL_CHOICES)
        or name.endswith(".__main__")
        or getattr(getattr(module, "__spec__", None), "name", None) != name
    ):
        return False
    path = getattr(module, "__file__", None)
    if not isinstance(path, str):
        return False
    return path.startswith(_site_dirs()) or os.path.realpath(path).startswith(_site_dirs())


def referenced(specs: Iterable[RankSpec]) -> set[str]:
    """Top-level names the launched function and its arguments mention: the strings in their
    pickles (the modules of globals, the names the code imports)."""
    found: set[str] = set()
    for spec in specs:  # every rank gets the same function: the first one says it
        for blob in (spec.function, *spec.args, *spec.kwargs.values()):
            try:
                for _, arg, _ in pickletools.genops(blob):
                    if isinstance(arg, str) and len(arg) < 200:
                        found.update(word.partition(".")[0] for word in arg.split())
            except Exception:  # noqa: BLE001 - a pickle it cannot walk only costs warmth
                continue
        break
    return found


class Mirror:
    """The mirror of one fork server: names sent, answers pending, the socket it speaks on."""

    def __init__(self, initial: list[str]) -> None:
        self._dir = tempfile.mkdtemp(prefix="nbaccel-mirror-")
        self.address = os.path.join(self._dir, "socket")
        self.file = os.path.join(self._dir, "initial")
        self._path = list(sys.path)
        with open(self.file, "w", encoding="utf-8") as f:
            f.write("".join(f"{n}\n" for n in [_path_line(self._path), *initial]))
        self._listener: socket.socket | None = socket.socket(socket.AF_UNIX)
        self._listener.bind(self.address)
        self._listener.listen(1)
        self._conn: socket.socket | None = None
        self._buffer = b""
        self.pending: collections.OrderedDict[str, None] = collections.OrderedDict.fromkeys(initial)
        self.sent = set(initial)
        self.answers: dict[str, dict[str, Any]] = {}
        self.held = self._holds = 0  # the last hold the server answered, the last asked for
        self.broken: str | None = None  # why this server must be replaced, once it must

    def env(self) -> dict[str, str]:
        """What the server's environment must have to find this mirror."""
        return {ENV_ADDRESS: self.address, ENV_FILE: self.file}

    def connected(self, wait: float = 2.0) -> bool:
        """Take the server's connection (it connects while it starts, so a ready server's
        waits); ``False`` for a server that did not within ``wait`` s (then there is no mirror;
        ``wait=0``: not yet, ask again later)."""
        if self._conn is None and self._listener is not None:
            self._listener.settimeout(wait or None)
            if not wait:
                self._listener.setblocking(False)
            try:
                self._conn, _ = self._listener.accept()
                self._conn.setblocking(True)
            except OSError:
                if not wait:
                    return False
            self._listener.close()
            self._listener = None
            shutil.rmtree(self._dir, ignore_errors=True)
        return self._conn is not None

    def offer(self, names: list[str]) -> None:
        """Queue ``names`` (those not sent yet) if the server is connected, without waiting
        for it; take the answers already there."""
        if self.broken is None and self.connected(wait=0.0):
            self._read_until(lambda: False, poll=0.0, drain=True)
            self.go(names, resume=False)

    def hold(self, first: list[str]) -> None:
        """Have the server import ``first`` (before anything queued), then hold; wait for it."""
        first = [n for n in first if n in self.pending or n not in self.sent]
        self.sent.update(first)
        self.pending.update(dict.fromkeys(first))
        self._holds += 1
        number = self._holds
        path = [] if sys.path == self._path else [_path_line(sys.path)]
        self._path = list(sys.path)
        self._send("\n".join([*path, " ".join([HOLD, str(number), *first])]))
        self._read_until(lambda: self.held == number)

    def go(self, names: list[str], resume: bool = True) -> None:
        """Let the server import again (``resume``), ``names`` (those not sent yet) after what
        it has."""
        names = [n for n in names if n not in self.sent]
        if not names and not resume:
            return
        self.sent.update(names)
        self.pending.update(dict.fromkeys(names))
        self._send("\n".join([GO, *names] if resume else names))

    def wait(self) -> None:
        """Wait until every name sent is answered (tests; a launch waits only in :meth:`hold`)."""
        if self.connected(wait=SILENCE_DEADLINE):
            self._read_until(lambda: not self.pending)

    def _send(self, text: str) -> None:
        """Send ``text``, reading the server's answers whenever its socket is full: the server
        stops reading while it waits to write an answer, so sending alone could wait forever."""
        data = (text + "\n").encode()
        heard = time.monotonic()
        while data and self.broken is None and self.connected():
            ready = select.select([], [self._conn], [], 0.05)[1]
            try:
                if ready:
                    data = data[self._conn.send(data) :]  # type: ignore[union-attr]
                    heard = time.monotonic()
                else:
                    self._read_until(lambda: False, poll=0.0, drain=True)
            except OSError:
                # The server closed its end; the answer that says why may be waiting.
                self._read_until(lambda: False, poll=0.0, drain=True)
                self._lost()
                return
            if time.monotonic() - heard > SILENCE_DEADLINE:
                self.broken = f"the fork server took no names for {SILENCE_DEADLINE:g} s"

    def _read_until(self, done: Any, poll: float = 0.05, drain: bool = False) -> None:
        """Read answers until ``done()``, this server is broken (CUDA, died, hung) or gone
        (``drain``: until none is waiting); interruptible (no rank is started meanwhile)."""
        heard = time.monotonic()
        while not done() and self.broken is None and self.connected():
            self._conn.settimeout(poll)  # type: ignore[union-attr]
            try:
                chunk = self._conn.recv(65536)  # type: ignore[union-attr]
            except (TimeoutError, BlockingIOError):
                if drain:
                    return
                if time.monotonic() - heard > SILENCE_DEADLINE:
                    name = next(iter(self.pending), "?")
                    _never.add(name)
                    self.broken = f"importing {name} took over {SILENCE_DEADLINE:g} s"
                continue
            except OSError:
                chunk = b""
            if not chunk:
                if not drain:
                    self._lost()
                return
            heard = time.monotonic()
            *lines, self._buffer = (self._buffer + chunk).split(b"\n")
            for line in lines:
                self._answer(parse_line(line))

    def _answer(self, answer: dict[str, Any]) -> None:
        if "held" in answer:
            self.held = answer["held"]
            return
        name = answer["name"]
        self.pending.pop(name, None)
        self.answers[name] = answer
        if not answer["ok"]:
            _never.add(name)
        if answer["cuda"]:
            _never.add(name)
            self.broken = f"importing {name} loaded CUDA's driver into it"

    def _lost(self) -> None:
        """The server closed the connection: an import killed it, or it loaded CUDA. The name
        under way is never sent again."""
        if self.pending:
            name = next(iter(self.pending))
            _never.add(name)
            self.broken = self.broken or f"the fork server ended while importing {name}"
        self.pending.clear()
        self.close()

    def abandon(self, died: bool) -> None:
        """Close, after reading the answers already there; for a server that ``died``, the
        module it was importing is never sent again (it may be what killed it)."""
        if self._conn is not None:
            self._read_until(lambda: False, poll=0.0, drain=True)
        if died and self.pending:
            _never.add(next(iter(self.pending)))
        self.close()

    def close(self) -> None:
        for sock in (self._conn, self._listener):
            if sock is not None:
                sock.close()
        self._conn = self._listener = None
        shutil.rmtree(self._dir, ignore_errors=True)


def _path_line(path: list[str]) -> str:
    return f"{PATH} {json.dumps(path)}"


def needed(specs: Iterable[RankSpec]) -> list[str]:
    """The candidates the launched function refers to (see :func:`referenced`)."""
    tops = referenced(specs)
    return [n for n in candidates() if n.partition(".")[0] in tops]
