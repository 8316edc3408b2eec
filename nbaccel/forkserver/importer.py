"""Imported by the fork server after torch: imports, in a thread, the modules the kernel has
imported, so the ranks forked later find them loaded (``nbaccel.forkserver.mirror`` is the kernel's
side and decides which modules qualify).

The kernel names in ``NBACCEL_MIRROR_ADDRESS`` a Unix socket it listens on and in
``NBACCEL_MIRROR_FILE`` the modules it had when it started the server; later it sends more
(``forkserver.protocol``). Each import is answered; one that fails is skipped, never fatal
(what it imported on the way stays, as in any process where an import failed). Before it forks
ranks the kernel says ``HOLD`` with the names the launched function needs: the server imports
those first, then no more until ``GO``, so a rank never waits for an import it does not need
beyond the one under way.

Three rules keep a rank forked from here what it would be without the mirror:

- no fork while an import runs (``os.register_at_fork``): a fork in the middle of one would give
  the rank a half-initialised module whose import lock nobody releases. A rank start waits for
  the import under way, not for the ones queued;
- no kernel-side module (IPython, ipykernel, zmq, ...) is imported by the thread: a finder
  refuses them, so a package that merely tries them falls back as in a plain interpreter;
- no CUDA: torch's availability checks answer through NVML (which a fork survives), and an
  import that loaded the CUDA driver anyway is answered ``"cuda": true`` (the kernel then
  replaces this server and no longer mirrors that package).

Importing this module anywhere but in the fork server does nothing.
"""

from __future__ import annotations

import collections
import contextlib
import gc
import importlib
import importlib.abc
import json
import os
import socket
import sys
import threading
import time
import traceback
from typing import Any

from nbaccel.core import libc
from nbaccel.forkserver.guard import in_fork_server
from nbaccel.forkserver.protocol import (
    ENV_ADDRESS,
    ENV_FILE,
    GO,
    HOLD,
    PATH,
    RELOAD,
    encode,
    kernel_side,
)

_fork_lock = threading.Lock()
_state: dict[str, Any] = {"active": False, "sock": None, "thread": None}


class _RefuseKernelSide(importlib.abc.MetaPathFinder):
    """Make the mirror thread's imports of kernel-side packages fail as if not installed."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if kernel_side(name) and threading.current_thread() is _state.get("thread"):
            raise ModuleNotFoundError(f"{name} is not mirrored into the fork server", name=name)
        return None


_FINDER = _RefuseKernelSide()


def cuda_loaded() -> bool:
    """Whether this process has loaded CUDA's driver (a fork of it could not use the GPU)."""
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    if cuda is not None and getattr(cuda, "is_initialized", lambda: False)():
        return True
    return any("libcuda.so" in path for path in libc.loaded_libraries())


def import_one(name: str, reload: bool = False) -> dict[str, Any]:
    """Import ``name`` here (no fork meanwhile; ``reload``: again, as the kernel did), with
    the collector paused; what happened."""
    started = time.monotonic()
    answer: dict[str, Any] = {"name": name, "ok": True, "error": None, "cuda": False}
    with _fork_lock:
        collecting, loaded = gc.isenabled(), len(sys.modules)
        gc.disable()
        try:
            module = importlib.import_module(name)
            if reload and loaded == len(sys.modules):  # (just imported: nothing to reload)
                importlib.reload(module)
        except BaseException as exc:  # noqa: BLE001 - even SystemExit: skipped, never fatal
            answer.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:300])
        finally:
            gc.freeze()  # lives as long as the server: the ranks' collections skip it
            if collecting:
                gc.enable()
        # (reading the memory map takes ms, and most names of a package are loaded already)
        answer["cuda"] = len(sys.modules) != loaded and cuda_loaded()
    answer["seconds"] = round(time.monotonic() - started, 4)
    return answer


class _Lines:
    """The kernel's lines, read as they come: names queued, ``HOLD`` first, ``GO``."""

    def __init__(self, sock: socket.socket, initial: bytes) -> None:
        self.sock, self.buffer = sock, b""
        self.queue: collections.deque[str] = collections.deque()
        self.first: collections.deque[str] = collections.deque()
        self.holding, self.hold_number = False, 0
        self.answered = 0  # the last hold answered "held"
        self.reload: set[str] = set()  # names in ``first`` to reload
        self._take(initial + b"\n")

    def read(self, block: bool) -> bool:
        """Take what the kernel sent (waiting for something when ``block``); False at its end."""
        self.sock.setblocking(block)
        try:
            chunk = self.sock.recv(65536)
        except BlockingIOError:
            return True
        if not chunk:
            return False
        self._take(chunk)
        return True

    def _take(self, chunk: bytes) -> None:
        *lines, self.buffer = (self.buffer + chunk).split(b"\n")
        for line in lines:
            command, _, rest = line.decode().strip().partition(" ")
            if command == PATH:  # the kernel's sys.path: where its packages are found
                sys.path[:] = json.loads(rest)
            elif command == HOLD:
                number, *names = rest.split()
                self.hold_number = int(number)
                for name in names:
                    if name in self.queue:
                        self.queue.remove(name)
                self.first.extend(names)
                self.holding = True
            elif command == RELOAD:
                names = rest.split()
                for name in names:
                    if name in self.queue:
                        self.queue.remove(name)
                self.reload.update(names)
                self.first.extend(names)
            elif command == GO:
                self.holding = False
            elif command:
                self.queue.append(command)


def _serve(sock: socket.socket, initial: bytes) -> None:
    """Answer the kernel until it closes its end. However this ends (an error included), the
    kernel hears it at once, by the socket's end, instead of waiting out its deadline for an
    answer that will not come."""
    try:
        _answer_lines(sock, initial)
    except BaseException:  # noqa: BLE001 - said on the server's stderr; the kernel goes on
        traceback.print_exc()
    finally:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)


def _answer_lines(sock: socket.socket, initial: bytes) -> None:
    lines = _Lines(sock, initial)
    try:
        while lines.read(block=False):
            if lines.first:
                name = lines.first.popleft()
            elif lines.holding:
                if lines.answered != lines.hold_number:
                    _send(sock, {"held": lines.hold_number})
                    lines.answered = lines.hold_number
                # until GO (the kernel forks its ranks meanwhile), or a new HOLD: the next
                # launch's (its GO and that HOLD can arrive in one read: a HOLD with no names
                # was never answered, and that launch waited forever) or one from a kernel that
                # gave up on this one (Ctrl-C)
                if not lines.read(block=True):
                    return
                continue
            elif lines.queue:
                name = lines.queue.popleft()
            else:
                if not lines.read(block=True):
                    return
                continue
            reload = name in lines.reload
            lines.reload.discard(name)
            if reload or name not in sys.modules:  # (one loaded already is answered at once)
                _send(sock, {"importing": name})
            answer = import_one(name, reload)
            _send(sock, answer)
            if answer["cuda"]:
                return  # the kernel replaces this server; importing more would not help
    except (OSError, ValueError):
        return  # the kernel closed its end


def _send(sock: socket.socket, answer: dict[str, Any]) -> None:
    """Send one answer, waiting while the kernel's side is full (reading left the socket
    non-blocking, where a full buffer raised and ended the mirror)."""
    sock.setblocking(True)
    sock.sendall(encode(answer))


def _before_fork() -> None:
    if _state["active"]:
        _fork_lock.acquire()


def _after_fork_in_parent() -> None:
    if _state["active"]:
        _fork_lock.release()


def _after_fork_in_child() -> None:
    """In a rank: no mirror thread, no kernel socket, no finder, no hooks that do anything."""
    if not _state["active"]:
        return
    _state["active"] = False
    _fork_lock.release()
    sock = _state.pop("sock", None)
    if sock is not None:
        sock.close()
    if _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)


def start(address: str, initial: bytes) -> None:
    """Connect to the kernel at ``address`` and serve its names in a daemon thread."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(address)
    except OSError:
        sock.close()
        return  # no kernel to mirror (it gave up waiting): a plain server
    # What the mirror imports must not pick the kernel's matplotlib backend or touch CUDA; the
    # ranks get the kernel's environment back (rank.entry), so this stays in the server.
    os.environ["MPLBACKEND"] = "Agg"
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
    thread = threading.Thread(
        target=_serve, args=(sock, initial), name="nbaccel-mirror", daemon=True
    )
    _state.update(active=True, sock=sock, thread=thread)
    sys.meta_path.insert(0, _FINDER)
    os.register_at_fork(
        before=_before_fork,
        after_in_parent=_after_fork_in_parent,
        after_in_child=_after_fork_in_child,
    )
    thread.start()


def _initial(path: str | None) -> bytes:
    if not path:
        return b""
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return b""


if in_fork_server() and os.environ.get(ENV_ADDRESS):
    start(os.environ[ENV_ADDRESS], _initial(os.environ.get(ENV_FILE)))
