"""The kernel's end of a paused rank: its pdb (or ``input()``) reads lines from the notebook.

A rank whose ``breakpoint()`` or ``input()`` waits for a person says so on its event pipe
(``events.Paused``, sent by ``rank.debugger``). The relay hands the event to
:meth:`Debugging.on_paused`: the rank's state says where it is paused (the views show it), and
where this thread may prompt (the kernel's main thread, inside a blocking launch or a ``%%ranks``
cell) the kernel connects to the rank and the loop (``launch.loop``) watches the connection.
:meth:`Debugging.answer` prints what the rank's pdb prints and answers each of its questions with
the notebook's own ``input()``: in a kernel, ipykernel's ``input_request`` on the stdin channel,
the input box JupyterLab, Notebook 7, VS Code and Colab show. Ctrl-C (the Stop button) at the
prompt, and pdb's ``q``, end the launch as Stop does (a ``KeyboardInterrupt`` in the loop).
In a ``%%ranks`` cell they interrupt the cell instead, and then (:meth:`Debugging.interrupt`)
the notebook is asked nothing more for that cell: a question a rank had sent already, or asks
on its way out (pdb asks again after its ``--KeyboardInterrupt--``), is answered
``("interrupt",)``, which ends that rank's ``input()`` or pdb with a ``KeyboardInterrupt``.

While any rank is paused the loop holds the hang timeout and the stall detection still
(:meth:`Debugging.holding`). Two ranks that pause are answered in the order they ask.
"""

from __future__ import annotations

import builtins
import contextlib
import linecache
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Client, Connection

from nbaccel.core import events
from nbaccel.core.local_traceback import cell_label
from nbaccel.core.private_socket import SOCKET_FOLDER_PREFIX
from nbaccel.launch.state import LaunchState

# Seconds the rank answered last keeps the notebook's keyboard while it runs between prompts
# (another rank's question waits that long before it is asked).
STAY_WITH_CURRENT = 0.5
DEBUG_HINT = "run launch.debug() in a cell to debug it"


def where(event: events.Paused, label: Callable[[str], str | None] = cell_label) -> str:
    """What the views say of a paused rank, after "rank 1 paused in".

    >>> e = events.Paused(1, "breakpoint()", "/tmp/x.py", 9, "train", "", b"")
    >>> where(e, label=lambda f: "Cell In[4]")
    'breakpoint() at Cell In[4], line 9'
    """
    return f"{event.reason} at {label(event.file) or event.file}, line {event.line}"


def cell_labels() -> dict[str, str]:
    """``Cell In[n]`` for each notebook cell the kernel knows (for the rank's pdb to show)."""
    labels = {}
    for filename in list(linecache.cache):
        label = cell_label(filename)
        if label:
            labels[filename] = label
    return labels


def _jupyter_echoes_a_space() -> bool:
    """Whether ``input`` is ipykernel's, whose frontends (JupyterLab, Notebook 7) show an answer
    as the prompt, a space and the answer: pdb's ``"(Pdb rank 1) "`` read ``(Pdb rank 1)  p x``."""
    owner = getattr(builtins.input, "__self__", None)
    return type(owner).__module__.startswith("ipykernel.")


def can_prompt() -> bool:
    """Whether this thread may ask the notebook for a line: only the kernel's main thread runs
    a cell whose ``input()`` the frontend answers."""
    return threading.current_thread() is threading.main_thread()


class Debugging:
    """The debugging conversations of one launch's (or one ``%ranks`` session's) ranks."""

    def __init__(self, state: LaunchState) -> None:
        self.state = state
        # Made by the thread that follows the ranks: the kernel's main thread prompts itself; a
        # background launch's thread keeps paused ranks waiting for ``launch.debug()``.
        self.prompts = can_prompt()
        self.connections: dict[int, Connection] = {}
        self.waiting: dict[int, events.Paused] = {}  # paused where nobody may prompt yet
        self._quit = False  # q in a conversation served by serve_here
        self._current: int | None = None  # the rank answered last, and when
        self._answered_at = 0.0
        # A %%ranks cell was interrupted: nobody is asked for it any more (see interrupt)
        self.interrupted = False
        # The private folders of the ranks' sockets (``core.private_socket``): a rank removes
        # its own once connected, the kernel those of ranks stopped before (see close).
        self._folders: set[str] = set()

    def interrupt(self) -> None:
        """The ``%%ranks`` cell these ranks run was interrupted (Stop or Ctrl-C, at a prompt or
        not; pdb's ``q``): ask the notebook nothing more for it. Each question a rank asks from
        now on, or had asked already, is answered ``("interrupt",)``, and pdb's ``q`` (how a
        rank's pdb ends then) only ends that rank's conversation. Without this, a question
        another rank had sent before the interrupt was asked next, of a rank that had already
        left its ``input()``, and pdb, which catches the interrupt and asks again, asked again:
        a second Stop there broke the ranks and lost their state."""
        self.interrupted = True

    def resume(self) -> None:
        """A new cell: its ranks' questions are the notebook's again."""
        self.interrupted = False

    def holding(self) -> bool:
        """Whether a rank is paused for a person (the timeout and stall detection wait)."""
        return bool(self.connections or self.waiting)

    def on_paused(self, event: events.Paused, watch: Callable[[int], None]) -> None:
        """A rank paused: show where; connect now if this thread can prompt (``watch`` the
        connection's descriptor for the loop), else keep it waiting for someone who can."""
        if self.prompts:
            self.state.ranks[event.rank].paused = where(event)
            self.connect(event, watch)
        else:
            self.state.ranks[event.rank].paused = f"{where(event)}: {DEBUG_HINT}"
            self.waiting[event.rank] = event

    def serve_here(self, on_quit: Callable[[], None]) -> int:
        """Relay the waiting ranks' conversations in this thread, one rank after the other,
        until none waits (a background launch's ``launch.debug()``, in the cell that calls
        it); how many were served. pdb's ``q``, and Ctrl-C at the prompt, call ``on_quit``
        (the launch stops)."""
        served = 0
        while self.waiting:
            rank, event = next(iter(self.waiting.items()))
            self.state.ranks[rank].paused = where(event)
            self.connect(event, watch=lambda fd: None)
            conn = self.connections.get(rank)
            if conn is None:
                continue
            served += 1
            # The connection closes only after on_quit has stopped the ranks: a rank whose
            # conversation ended without a stop runs on (its pdb quits), and its user's code
            # (an ``except Exception`` around breakpoint()) ran after q or Stop.
            try:
                while self._relay_one(conn):
                    pass
                if self._quit:  # q: the launch stops (this rank waits to be stopped with it)
                    self._quit = False
                    on_quit()
                    return served
            except KeyboardInterrupt:
                on_quit()
                raise
            except (OSError, EOFError):
                pass
            finally:
                self._close(rank, unwatch=lambda fd: None)
        return served

    def _relay_one(self, conn: Connection) -> bool:
        """One message of a conversation relayed here (blocking); whether it goes on."""
        kind, *rest = conn.recv()
        if kind == "out":
            sys.stdout.write(rest[0])
            sys.stdout.flush()
        elif kind == "ask":
            conn.send(self._ask(rest[0]))
        elif kind == "quit":
            self._quit = True
            return False
        else:
            return False
        return True

    def connect(self, event: events.Paused, watch: Callable[[int], None]) -> None:
        self.waiting.pop(event.rank, None)
        self._folders.add(os.path.dirname(event.address))
        try:
            conn = Client(event.address, family="AF_UNIX", authkey=event.authkey)
            conn.send(("labels", cell_labels()))
        except (OSError, EOFError):  # the rank ended (stopped) before it could be answered
            self._ended(event.rank)
            return
        self.connections[event.rank] = conn
        watch(conn.fileno())

    def answer(
        self,
        rank: int,
        unwatch: Callable[[int], None],
        meanwhile: Callable[[], contextlib.AbstractContextManager[None]] = contextlib.nullcontext,
    ) -> None:
        """Relay what ``rank`` sent: print its output, answer its questions from the notebook
        (``meanwhile``: what runs while the person types, e.g. reading the other ranks).

        Raises ``KeyboardInterrupt`` for pdb's ``q`` and for Ctrl-C at the prompt: the launch
        stops as it does for the Stop button."""
        conn = self.connections.get(rank)
        if conn is None:
            return
        current = self.connections.get(self._current) if self._current is not None else None
        if current is not None and self._current != rank and not self.interrupted:
            # One conversation at a time: the rank answered last usually asks again at once
            # (its next prompt); only one that runs on (a long `n`) lets another rank in.
            wait = STAY_WITH_CURRENT - (time.monotonic() - self._answered_at)
            if wait > 0 and current.poll(wait):
                assert self._current is not None
                self.answer(self._current, unwatch, meanwhile)
                return
        try:
            while conn.poll(0):
                kind, *rest = conn.recv()
                if kind == "out":
                    sys.stdout.write(rest[0])
                    sys.stdout.flush()
                elif kind == "ask" and self.interrupted:
                    conn.send(("interrupt",))  # nobody is asked: the cell was interrupted
                elif kind == "ask":
                    with meanwhile():
                        reply = self._ask(rest[0])
                    conn.send(reply)
                    self._current, self._answered_at = rank, time.monotonic()
                elif kind == "quit" and self.interrupted:
                    self._close(rank, unwatch)  # its pdb ends with the cell's interrupt
                    return
                elif kind == "quit":
                    sys.stdout.flush()
                    raise KeyboardInterrupt(f"q in the debugger of rank {rank}")
                else:  # "end": the rank runs on
                    self._close(rank, unwatch)
                    return
        except (OSError, EOFError):  # the rank ended meanwhile
            self._close(rank, unwatch)

    @staticmethod
    def _ask(prompt: str) -> tuple[str, ...]:
        if _jupyter_echoes_a_space():
            prompt = prompt.removesuffix(" ")
        try:
            return ("line", builtins.input(prompt))
        except EOFError:
            return ("eof",)
        except NotImplementedError:  # IPython's StdinNotImplementedError: no input box
            return ("unavailable", "this frontend does not send input to the kernel")
        except OSError as exc:  # a stdin that cannot be read (captured, closed)
            return ("unavailable", f"the launching process cannot read input ({exc})")

    def _close(self, rank: int, unwatch: Callable[[int], None]) -> None:
        if self._current == rank:
            self._current = None
        conn = self.connections.pop(rank, None)
        if conn is not None:
            with contextlib.suppress(OSError, ValueError):
                unwatch(conn.fileno())
            conn.close()
        self._ended(rank)

    def _ended(self, rank: int) -> None:
        if rank in self.state.ranks:
            self.state.ranks[rank].paused = None

    def close(self) -> None:
        """End every conversation (the ranks have been stopped and reaped)."""
        for conn in self.connections.values():
            with contextlib.suppress(OSError):
                conn.close()
        self.connections.clear()
        for event in self.waiting.values():
            self._folders.add(os.path.dirname(event.address))
        self.waiting.clear()
        for folder in self._folders:  # of a rank stopped while it listened
            if os.path.basename(folder).startswith(SOCKET_FOLDER_PREFIX):
                shutil.rmtree(folder, ignore_errors=True)
        self._folders.clear()
