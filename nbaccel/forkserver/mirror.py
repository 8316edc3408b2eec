"""The kernel's side of the mirror: which of the kernel's modules the fork server imports too,
so ranks find them loaded, and the conversation with the server (``nbaccel.forkserver.importer``).

What qualifies (:func:`candidates`): a module the kernel has loaded, in the order it loaded them,
whose file lies in a site-packages folder (installed code; one the kernel reloads is reloaded
in the server too, before the next launch's ranks fork), that
is no part of the kernel's side (``forkserver.protocol.KERNEL_SIDE``), of the standard library
or of nbaccel. The user's own modules (files in the working directory, on ``PYTHONPATH``,
editable installs) are never mirrored: each rank imports them afresh, so one edited and reloaded
in the kernel arrives edited.

When names travel: those loaded before the server started go with it (a file it reads); after
each cell, what the cell imported (``ForkServer.follow_kernel``); before ranks are forked, the
names the launched function refers to (strings in its pickle: ``from transformers import
Trainer`` in its body, a global module) go with ``HOLD`` and are waited for; after the forks,
``GO`` and the rest. A thread of the :class:`Mirror` reads the server's answers as they come,
so the server imports everything while the person writes the next cell: a launch waits only
for imports its ranks would make themselves (the server makes each once, for every rank) and
for the one import under way, at most :func:`import_deadline` s. Outside a kernel (a script),
only the ``HOLD`` names are sent: the packages launched functions refer to, once.
"""

from __future__ import annotations

import collections
import contextlib
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
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from nbaccel.core.events import RankSpec
from nbaccel.forkserver.protocol import (
    ENV_ADDRESS,
    ENV_FILE,
    GO,
    HOLD,
    PATH,
    RELOAD,
    kernel_side,
    parse_line,
)

# Submodules whose choice is the kernel's (tqdm's notebook bars draw through it).
KERNEL_CHOICES = ("tqdm.notebook", "tqdm.autonotebook", "tqdm.auto", "google.colab")
# A server that says nothing for this long while a launch waits for it is hung: it is replaced.
SILENCE_DEADLINE = 120.0
# One import under way in the server for this long while a launch waits is given up: the server
# is replaced (the launch goes on from a fresh one; the ranks import that module themselves).
# $NBACCEL_MIRROR_IMPORT_DEADLINE (seconds) changes it.
IMPORT_DEADLINE = 20.0
TICK = 0.2  # how often a waiting launch's ``tick`` runs (a view's clock)

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
    if modules is None:
        # Listed once per change of the kernel's modules (a launch, and the end of its cell,
        # ask again: 3,000 modules with transformers): the count, the last loaded, the refusals.
        key = (len(sys.modules), next(reversed(sys.modules), None), len(_never))
        if _listed[0] != key:
            _listed[:] = [key, candidates(dict(sys.modules))]
        return list(_listed[1])
    names = []
    for name, module in list(modules.items()):
        verdict = _verdicts.get(name)
        if verdict is None or verdict[0] is not module:
            verdict = _verdicts[name] = (module, _qualifies(name, module))
        if verdict[1] and name not in _never:
            names.append(name)
    return names


_listed: list[Any] = [None, []]  # [what sys.modules looked like, its candidates]
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
    """The mirror of one fork server: names sent, answers pending, the socket it speaks on.

    A thread of its own (``nbaccel-mirror-answers``) takes the server's connection, reads
    every answer as it comes and writes what the kernel queued, so the server never waits
    for the kernel (it once waited on a full socket while the kernel ran cells, and imported
    nothing while the person wrote the next one); the kernel only ever waits for an answer
    it needs (:meth:`hold`)."""

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
        self._changed = threading.Condition()  # guards everything below; notified on news
        self._outbox = b""
        self._closed = False
        self._accepted = threading.Event()  # the server connected, or never will
        self.pending: collections.OrderedDict[str, None] = collections.OrderedDict.fromkeys(initial)
        self.sent = set(initial)
        # name -> (its __spec__, when it was sent): reloaded in the kernel since?
        self._specs = {n: (_spec_of(n), time.time()) for n in initial}
        self.answers: dict[str, dict[str, Any]] = {}
        self.held = self._holds = 0  # the last hold the server answered, the last asked for
        self.broken: str | None = None  # why this server must be replaced, once it must
        # The import under way in the server (name, since when), as it announced it.
        self.importing: tuple[str, float] | None = None
        self.heard = time.monotonic()  # when the server last said anything
        self._wake_r, self._wake_w = socket.socketpair()
        self._thread = threading.Thread(target=self._io, name="nbaccel-mirror-answers", daemon=True)
        self._thread.start()

    def env(self) -> dict[str, str]:
        """What the server's environment must have to find this mirror."""
        return {ENV_ADDRESS: self.address, ENV_FILE: self.file}

    def connected(self, wait: float = 2.0) -> bool:
        """Whether the server has connected (it connects while it starts, so a ready server
        has); ``False`` for one that did not within ``wait`` s (then there is no mirror;
        ``wait=0``: not yet, ask again later)."""
        if not self._accepted.wait(wait) and wait:
            self.close()
        return self._conn is not None and not self._closed

    def offer(self, names: list[str]) -> None:
        """Queue ``names`` (those not sent yet) and modules reloaded in the kernel since they
        were sent; never waits."""
        if self.broken is None and not self._closed:
            self._queue([*_reload_lines(self._reloaded())], names, resume=False)

    def hold(self, first: list[str], tick: Callable[[], None] | None = None) -> None:
        """Have the server import ``first`` (before anything queued; modules reloaded in the
        kernel since they were sent are reloaded there first), then hold; wait for it
        (``tick``: see :meth:`wait_for`)."""
        reload = self._reloaded()
        first = [n for n in first if n in self.pending or n not in self.sent]
        with self._changed:
            self.sent.update(first)
            self.pending.update(dict.fromkeys(first))
            self._specs.update((n, (_spec_of(n), time.time())) for n in first)
            self._holds += 1
            number = self._holds
        path = [] if sys.path == self._path else [_path_line(sys.path)]
        self._path = list(sys.path)
        self._write([*path, *_reload_lines(reload), " ".join([HOLD, str(number), *first])])
        self.wait_for(lambda: self.held == number, tick)

    def lacks(self, names: list[str]) -> bool:
        """Whether any of ``names`` is not imported in the server yet (or is being imported)."""
        with self._changed:
            return bool(self.pending) or any(n not in self.sent for n in names)

    def hold_words(self, first: list[str]) -> str:
        """What a :meth:`hold` for ``first`` waits for now, in words for a view's header."""
        with self._changed:
            under = self.importing[0] if self.importing is not None else None
            done = sum(1 for n in first if n not in self.pending)
        if under is not None and under not in first:
            return f"fork server: finishing its import of {under}"
        name = under or next((n for n in first if n in self.pending), "")
        return (
            f"fork server: importing {name.partition('.')[0]} for your function "
            f"({min(done + 1, len(first))} of {len(first)} modules)"
        )

    def go(self, names: list[str], resume: bool = True) -> None:
        """Let the server import again (``resume``), ``names`` (those not sent yet) after what
        it has."""
        self._queue([GO] if resume else [], names, resume)

    def _queue(self, lines: list[str], names: list[str], resume: bool) -> None:
        with self._changed:
            names = [n for n in names if n not in self.sent and n not in _never]
            self.sent.update(names)
            self.pending.update(dict.fromkeys(names))
            self._specs.update((n, (_spec_of(n), time.time())) for n in names)
        if lines or names:
            self._write([*lines, *names])

    def _reloaded(self) -> list[str]:
        """Names sent whose module the kernel has reloaded since (``importlib.reload`` gives
        it a new ``__spec__``) from a file changed since they were sent: the server's copy is
        the old code. (A new ``__spec__`` alone is no reload: a package may set its own.)"""
        modules, stale = sys.modules, []
        with self._changed:
            for name, (spec, sent_at) in self._specs.items():
                module = modules.get(name)
                current = getattr(module, "__spec__", spec)
                if module is None or current is spec:
                    continue
                self._specs[name] = (current, sent_at)
                if _changed_since(module, sent_at):
                    stale.append(name)
            for name in stale:
                self._specs[name] = (self._specs[name][0], time.time())
                self.pending[name] = None
        return stale

    def wait(self) -> None:
        """Wait until every name sent is answered (tests; a launch waits only in :meth:`hold`)."""
        if self.connected(wait=SILENCE_DEADLINE):
            self.wait_for(lambda: not self.pending)

    def wait_for(self, done: Callable[[], bool], tick: Callable[[], None] | None = None) -> None:
        """Wait until ``done()`` or this server is broken or gone; interruptible (no rank is
        started meanwhile). An import under way in the server for :func:`import_deadline` s
        breaks it (the launch goes on from a fresh server; that module is not mirrored
        again), and so does a server silent for :data:`SILENCE_DEADLINE` s. ``tick`` is
        called every :data:`TICK` s meanwhile (a view's clock)."""
        deadline, began = import_deadline(), time.monotonic()
        ticked = began
        while True:
            with self._changed:
                if done() or self.broken is not None or self._closed:
                    return
                now = time.monotonic()
                if self.importing is not None and now - self.importing[1] > deadline:
                    name = self.importing[0]
                    _never.add(name)
                    self.broken = f"importing {name} took over {deadline:g} s"
                    return
                if now - max(self.heard, began) > SILENCE_DEADLINE:
                    self.broken = f"the fork server said nothing for {SILENCE_DEADLINE:g} s"
                    return
                self._changed.wait(TICK)
            if tick is not None and time.monotonic() - ticked >= TICK:
                ticked = time.monotonic()
                tick()

    def _write(self, lines: list[str]) -> None:
        with self._changed:
            self._outbox += ("\n".join(lines) + "\n").encode()
        self._wake()

    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")

    def _io(self) -> None:
        """The thread: take the server's connection, then read its answers and write the
        kernel's lines until either side closes."""
        listener = self._listener
        assert listener is not None
        try:
            listener.settimeout(0.2)
            while not self._closed:
                try:
                    conn, _ = listener.accept()
                except TimeoutError:
                    continue
                with self._changed:
                    if self._closed:
                        conn.close()
                        return
                    self._conn, self.heard = conn, time.monotonic()
                # The server read its first names before it connected, and connects once:
                # the folder goes now, not at close(), which a kernel shut down never reaches
                # (each clean shutdown left an nbaccel-mirror-* folder behind).
                shutil.rmtree(self._dir, ignore_errors=True)
                self._accepted.set()
                self._exchange(conn)
                return
        except OSError:
            return
        finally:
            self._accepted.set()
            with self._changed:
                if not self._closed:
                    self._lost()
                self._changed.notify_all()
            self._release()
            for sock in (self._wake_r, self._wake_w):
                sock.close()

    def _exchange(self, conn: socket.socket) -> None:
        buffer = b""
        conn.setblocking(False)
        while True:
            with self._changed:
                if self._closed:
                    return
                writing = bool(self._outbox)
            readable, writable, _ = select.select(
                [conn, self._wake_r], [conn] if writing else [], []
            )
            if self._wake_r in readable:
                self._wake_r.recv(4096)
            if conn in writable:
                with self._changed:
                    try:
                        sent = conn.send(self._outbox)
                    except BlockingIOError:
                        sent = 0
                    self._outbox = self._outbox[sent:]
            if conn in readable:
                try:
                    chunk = conn.recv(65536)
                except BlockingIOError:
                    continue
                if not chunk:
                    return  # the server closed its end
                *lines, buffer = (buffer + chunk).split(b"\n")
                with self._changed:
                    self.heard = time.monotonic()
                    for line in lines:
                        self._answer(parse_line(line))
                    self._changed.notify_all()

    def _answer(self, answer: dict[str, Any]) -> None:
        if "held" in answer:
            self.held = answer["held"]
            return
        if "importing" in answer:
            self.importing = (answer["importing"], time.monotonic())
            return
        name = answer["name"]
        self.importing = None
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
        name = self._under_way()
        if name is not None:
            _never.add(name)
            self.broken = self.broken or f"the fork server ended while importing {name}"
        self.pending.clear()
        self._closed = True

    def _under_way(self) -> str | None:
        if self.importing is not None:
            return self.importing[0]
        return next(iter(self.pending), None)

    def abandon(self, died: bool) -> None:
        """Close; for a server that ``died``, the module it was importing is never sent again
        (it may be what killed it)."""
        with self._changed:
            name = self._under_way()
            if died and name is not None:
                _never.add(name)
        self.close()

    def close(self) -> None:
        with self._changed:
            self._closed = True
            self._changed.notify_all()
        self._wake()
        if threading.current_thread() is not self._thread:
            self._thread.join(2.0)
        self._release()

    def _release(self) -> None:
        with self._changed:
            for sock in (self._conn, self._listener):
                if sock is not None:
                    sock.close()
            self._conn = self._listener = None
        shutil.rmtree(self._dir, ignore_errors=True)


def import_deadline() -> float:
    """Seconds one import in the server may take while a launch waits for it.

    >>> import_deadline() > 0
    True
    """
    try:
        return float(os.environ.get("NBACCEL_MIRROR_IMPORT_DEADLINE") or IMPORT_DEADLINE)
    except ValueError:
        return IMPORT_DEADLINE


def _spec_of(name: str) -> Any:
    return getattr(sys.modules.get(name), "__spec__", None)


def _changed_since(module: Any, when: float) -> bool:
    try:
        return os.path.getmtime(module.__file__) >= when - 1.0  # (coarse file clocks)
    except (OSError, TypeError):
        return False


def _reload_lines(names: list[str]) -> list[str]:
    return [" ".join([RELOAD, *names])] if names else []


def _path_line(path: list[str]) -> str:
    return f"{PATH} {json.dumps(path)}"


def needed(specs: Iterable[RankSpec], names: list[str] | None = None) -> list[str]:
    """The candidates (``names``, else the kernel's now) the launched function refers to (see
    :func:`referenced`)."""
    tops = referenced(specs)
    return [n for n in (candidates() if names is None else names) if n.partition(".")[0] in tops]
