"""A rank that waits for a person: ``breakpoint()`` and ``input()`` talk to the notebook.

A rank's stdin is empty (nobody types into N processes), so a rank that needs lines asks the
kernel for them. :class:`Console` is this rank's end of that conversation: it opens a Unix socket
only when it is needed, tells the kernel on the event pipe (``events.Paused``: where the rank
stopped and how to reach it), and then sends what the person should read (``out``) and asks for
each line (``ask``); the kernel answers each from the notebook's own ``input()``
(``launch.debugging``). The pdb that runs is the rank's own (:class:`RankPdb`), on its real
frames; the kernel only relays text.

Why a socket the rank opens, not a fifth pipe made for every rank at its start: almost no launch
ever debugs, and a socket made at the pause costs nothing until then; it needs no change to how
ranks are started (local, XLA or ``%ranks`` ranks alike), and the answers travel the one way
the ranks' pipes do not (kernel to rank) without a second channel kept open for the whole run.
The event pipe stays one-way; the socket is in a folder only this user can enter, and is
authenticated with a key only the event carried (``core.private_socket``).

The messages, as pickled tuples on a ``multiprocessing.connection.Connection``:

- kernel to rank: ``("labels", {file: "Cell In[4]"})`` first, then ``("line", text)`` per
  ``ask``, or ``("unavailable", why)`` where the notebook cannot prompt, or ``("eof",)``, or
  ``("interrupt",)`` once the ``%%ranks`` cell was interrupted (:class:`Interrupted`: ``input()``
  raises it, pdb quits);
- rank to kernel: ``("out", text)``, ``("ask", prompt)``, ``("end",)`` (the rank runs on), and
  ``("quit",)`` (pdb's ``q``: the kernel stops the launch as its Stop button does).

Never imports IPython.

>>> split_prompt("> f(3)\\n-> x = 1\\n(Pdb) ")
('> f(3)\\n-> x = 1\\n', '(Pdb) ')
"""

from __future__ import annotations

import contextlib
import io
import os
import pdb
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from multiprocessing.connection import Client, Connection
from types import FrameType
from typing import Any

from nbaccel.core import events
from nbaccel.core.private_socket import PrivateListener

# Under ``nbaccel launch`` (no event pipe) a rank reaches the launcher's terminal here
# (``cli.debugging``): a Unix socket address and the hex key that authenticates to it.
ENV_ADDRESS = "NBACCEL_DEBUG_ADDRESS"
ENV_KEY = "NBACCEL_DEBUG_KEY"
# Set for ranks the kernel cannot reach by a Unix socket (a Ray cluster's nodes): their
# breakpoint() is skipped with a line saying so, and input() refuses as a rank without a kernel.
ENV_UNREACHABLE = "NBACCEL_DEBUG_UNREACHABLE"

# The modules whose frames call the user's code; the first user frame below them is where a
# rank's pdb stack starts (``up`` goes no further), and returning from it ends the debugging.
PLUMBING_MODULES = frozenset(
    {
        "nbaccel.rank.entry",
        "nbaccel.persistent.serve",
        "nbaccel.rank.script_entry",
        "nbaccel.rank.xla",
        "runpy",
    }
)


class NoKeyboard(Exception):
    """The notebook cannot prompt (a frontend without stdin, a launch in the background with
    nobody debugging it); the message says why."""


class Interrupted(KeyboardInterrupt):
    """The kernel answered a question with the cell's interrupt (a ``%%ranks`` cell stopped
    while this rank asked, or before it asked again)."""


def split_prompt(text: str) -> tuple[str, str]:
    """``text`` cut into its whole lines and the unfinished last line (a prompt)."""
    head, sep, tail = text.rpartition("\n")
    return head + sep, tail


class Console:
    """This rank's end of its conversation with the kernel (one per process; threads take
    turns through :meth:`session`)."""

    def __init__(self) -> None:
        self._conn: Connection | None = None
        self._send_lock = threading.Lock()
        self.turn = threading.RLock()  # held for a whole conversation by the thread having it
        self.labels: dict[str, str] = {}  # cell files -> "Cell In[4]", from the kernel
        self._saved_streams: tuple[Any, Any] | None = None

    @property
    def rank(self) -> int | None:
        if os.environ.get(ENV_UNREACHABLE):
            return None
        rank = events.current_rank()
        if rank is None and os.environ.get(ENV_ADDRESS):
            return int(os.environ.get("RANK", "0"))
        return rank

    @property
    def is_open(self) -> bool:
        return self._conn is not None

    def available(self) -> bool:
        """Whether a kernel can be asked: this process is a notebook launch's rank."""
        return self.rank is not None

    @contextlib.contextmanager
    def session(self, reason: str, frame: FrameType) -> Iterator[Console]:
        """A conversation (opened here unless this thread already has one, then closed)."""
        with self.turn:
            opened = not self.is_open and self.open(reason, frame)
            try:
                yield self
            finally:
                if opened:
                    self.close()

    def open(self, reason: str, frame: FrameType) -> bool:
        """Tell the kernel this rank is paused at ``frame`` and wait until it connects; whether
        it could be told (``False`` outside a notebook launch)."""
        rank = self.rank
        if rank is None:
            return False
        for stream in (sys.stdout, sys.stderr):  # what it printed before reads before the prompt
            with contextlib.suppress(Exception):
                stream.flush()
        if events.current_rank() is None:
            conn = self._call_launcher(rank, reason, frame)
            if conn is None:
                return False
        else:
            conn = self._wait_for_kernel(rank, reason, frame)
            if conn is None:
                return False
        kind, labels = conn.recv()
        self.labels = labels if kind == "labels" else {}
        self._conn = conn
        self._redirect_streams()
        return True

    @staticmethod
    def _call_launcher(rank: int, reason: str, frame: FrameType) -> Connection | None:
        """``nbaccel launch``: connect to the launcher's terminal, which serves one rank at a
        time (this waits in its queue)."""
        try:
            conn = Client(
                os.environ[ENV_ADDRESS],
                family="AF_UNIX",
                authkey=bytes.fromhex(os.environ.get(ENV_KEY, "")),
            )
        except (OSError, ValueError, EOFError):
            return None
        code = frame.f_code
        conn.send(("paused", rank, reason, code.co_filename, frame.f_lineno, code.co_name))
        return conn

    @staticmethod
    def _wait_for_kernel(rank: int, reason: str, frame: FrameType) -> Connection | None:
        """A notebook's rank: listen (this user only, ``core.private_socket``), tell the
        kernel on the event pipe, wait for it."""
        authkey = os.urandom(32)
        with PrivateListener(authkey) as listener:
            code = frame.f_code
            paused = events.Paused(
                rank,
                reason,
                code.co_filename,
                frame.f_lineno,
                code.co_name,
                listener.address,
                authkey,
            )
            if not events.emit(paused):
                return None
            return listener.accept()  # until the kernel (or launch.debug()) comes

    def _redirect_streams(self) -> None:
        """What the rank prints while a person talks to it reads in the conversation (pdb's
        ``interact``, code run by ``n``), not in the rank's output lines."""
        self._saved_streams = (sys.stdout, sys.stderr)
        sys.stdout = _ConsoleStream(self, sys.stdout)
        sys.stderr = _ConsoleStream(self, sys.stderr)

    def _restore_streams(self) -> None:
        if self._saved_streams is not None:
            sys.stdout, sys.stderr = self._saved_streams
            self._saved_streams = None

    def _send(self, message: tuple[Any, ...]) -> None:
        conn = self._conn
        if conn is None:
            raise EOFError("this rank's debugging conversation has ended")
        with self._send_lock:
            conn.send(message)

    def write(self, text: str) -> None:
        if text:
            self._send(("out", text))

    def ask(self, prompt: str) -> str:
        """One line typed in the notebook (without its newline); ``EOFError`` where the kernel
        has gone or sent end-of-file, :class:`NoKeyboard` where it cannot prompt."""
        self._send(("ask", prompt))
        assert self._conn is not None
        try:
            kind, *rest = self._conn.recv()
        except (OSError, EOFError):
            raise EOFError("the kernel has gone") from None
        except KeyboardInterrupt:
            self._stopped_by_launcher()
            raise
        if kind == "line":
            return str(rest[0])
        if kind == "unavailable":
            raise NoKeyboard(str(rest[0]))
        if kind == "interrupt":
            raise Interrupted("the cell was interrupted")
        raise EOFError

    def close(self) -> None:
        """The rank runs on: the kernel stops relaying (its hang timeout counts again)."""
        self._restore_streams()
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(OSError, ValueError), self._send_lock:
                conn.send(("end",))
            conn.close()

    def quit(self) -> None:
        """pdb's ``q``: ask the kernel to stop the launch and wait for it to (this rank is
        stopped with the others; it never runs on half-debugged)."""
        self._restore_streams()
        conn = self._conn
        if conn is None:
            return
        try:
            with contextlib.suppress(OSError, ValueError, EOFError):
                self._send(("quit",))
                while True:
                    conn.recv()  # until the kernel stops this rank, or lets it go (%%ranks)
        except KeyboardInterrupt:
            self._stopped_by_launcher()  # the stop may come as SIGINT (nbaccel launch)
        self._conn = None
        conn.close()

    def _stopped_by_launcher(self) -> None:
        """SIGINT while a rank of ``nbaccel launch`` waits at its prompt: the launcher is
        stopping every rank (Ctrl-C at its terminal, or q), and torch elastic forwards the
        signal to each. The rank dies of it at once, as a rank without a prompt does: pdb
        would take it for a Ctrl-C at its prompt and ask again, and the launch waited 30 s
        for elastic's SIGKILL."""
        if events.current_rank() is not None or not os.environ.get(ENV_ADDRESS):
            return  # a notebook's rank: the kernel stops it its own way
        with contextlib.suppress(Exception):
            self._restore_streams()
            sys.stdout.flush()
            sys.stderr.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)


class _ConsoleStream(io.TextIOBase):
    """``sys.stdout``/``sys.stderr`` while a conversation is open: text goes to the notebook;
    once it is over (a stream kept by the user's code), to the rank's own output again."""

    def __init__(self, console: Console, original: Any) -> None:
        self._console, self._original = console, original

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        if self._console.is_open:
            try:
                self._console.write(text)
                return len(text)
            except (OSError, EOFError):
                pass
        return self._original.write(text)

    def flush(self) -> None:
        if not self._console.is_open:
            self._original.flush()

    def fileno(self) -> int:
        return self._original.fileno()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self._original, "encoding", "utf-8")


class _PdbOutput(io.TextIOBase):
    """pdb's stdout: whole lines go to the notebook as they are flushed; the unfinished line
    is the prompt the next ``readline`` asks with."""

    def __init__(self, console: Console) -> None:
        self._console = console
        self._pending = ""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        self._pending += text
        return len(text)

    def flush(self) -> None:
        lines, self._pending = split_prompt(self._pending)
        if lines and self._console.is_open:
            self._console.write(lines)

    def take_prompt(self) -> str:
        self.flush()
        prompt, self._pending = self._pending, ""
        return prompt


class _PdbInput:
    """pdb's stdin: each line is asked of the notebook, with what pdb printed as the prompt."""

    def __init__(self, console: Console, output: _PdbOutput, unavailable: Callable[[str], str]):
        self._console, self._output, self._unavailable = console, output, unavailable

    def readline(self) -> str:
        prompt = self._output.take_prompt()
        try:
            return self._console.ask(prompt) + "\n"
        except NoKeyboard as why:
            return self._unavailable(str(why))
        except (EOFError, Interrupted):  # pdb would catch the interrupt and ask again
            return ""  # pdb's end of input: it quits


class RankPdb(pdb.Pdb):
    """The rank's own pdb on its real frames, talking to the notebook through a :class:`Console`.

    Its stack starts at the user's function (nbaccel's frames above it are not shown and
    ``up`` stops there), it never stops inside nbaccel, returning from the user's function ends
    the debugging, and ``q`` stops the launch (the kernel's Stop) instead of failing this rank
    with ``BdbQuit``.
    """

    def __init__(self, console: Console, post_mortem: bool = False) -> None:
        self.console = console
        self.post_mortem = post_mortem  # q ends the post-mortem only: the rank has failed
        self._output = _PdbOutput(console)
        super().__init__(
            stdin=_PdbInput(console, self._output, self._unavailable),  # type: ignore[arg-type]
            stdout=self._output,  # type: ignore[arg-type]
            skip=["nbaccel.*"],
            nosigint=True,
            readrc=False,
        )
        self.use_rawinput = False
        self.prompt = f"(Pdb rank {console.rank}) "
        self._top: FrameType | None = None
        self._reason = "breakpoint()"  # what the views say the rank paused in
        self._let_go = False  # q answered without this rank being stopped

    def start(self, frame: FrameType, reason: str = "breakpoint()") -> None:
        """Stop at the line after ``frame``'s current one, as ``pdb.set_trace`` does. The kernel
        is told where only once pdb stops (``interaction``): the line pdb shows, not the line of
        the ``breakpoint()`` call before it (the banner said line 9 while pdb showed line 10)."""
        with self.console.turn:
            if not self.console.is_open and not self.console.available():
                return
            self._reason = reason
            self._top = user_top(frame)
            self.set_trace(frame)
            if self._top is not None:
                self.botframe = self._top

    # -- the conversation ends where the debugging does -------------------------------------

    def interaction(self, frame: FrameType | None, traceback: Any) -> None:
        with self.console.turn:
            if not self.console.is_open and frame is not None:
                # the first stop after start(), or a breakpoint set with `b`
                self.console.open(self._reason, frame)
            if not self.console.is_open:
                return
            super().interaction(frame, traceback)
            self._output.flush()
            if self._let_go:  # q, and the kernel did not stop this rank: see _quit
                self._let_go = False
                self.set_continue()
                sys.settrace(None)
                self.console.close()
                raise Interrupted(f"q in the debugger of rank {self.console.rank}")
            if sys.gettrace() is None:  # `c` with no breakpoints left: the rank runs on
                self.console.close()

    def dispatch_return(self, frame: FrameType, arg: Any) -> Any:
        result = super().dispatch_return(frame, arg)
        if frame is self._top and self._top is not None:
            self._end()  # back in nbaccel's frames: nothing of the user's is left to step
        return result

    def _end(self) -> None:
        self._top = None
        self.clear_all_breaks()
        self.set_continue()
        sys.settrace(None)
        self._output.flush()
        self.console.close()

    def _unavailable(self, why: str) -> str:
        print(f"nbaccel: breakpoint() skipped on rank {self.console.rank}: {why}", file=sys.stderr)
        self.clear_all_breaks()
        return "continue\n"

    def _quit(self, arg: str) -> Any:
        self._output.flush()
        if self.post_mortem:
            return super().do_quit(arg)
        # Returns only if the kernel let go without stopping the rank (a %%ranks cell, whose
        # ranks stay alive): the rank then leaves pdb with the cell's interrupt, raised where
        # it stopped. Not pdb's BdbQuit: that is an Exception, and an ``except Exception``
        # around breakpoint() caught it and ran the user's code on after q.
        self.console.quit()
        self._let_go = True
        return super().do_quit(arg)

    def _eof(self, arg: str) -> Any:
        self.message("")
        return self._quit(arg)

    do_quit = do_q = do_exit = _quit  # pdb aliases them at class level
    do_EOF = _eof

    def format_stack_entry(self, frame_lineno: Any, lprefix: str = ": ") -> str:
        text = super().format_stack_entry(frame_lineno, lprefix)
        frame, lineno = frame_lineno
        filename = frame.f_code.co_filename
        label = self.console.labels.get(filename)
        if label:
            where = f"{label}, line {lineno}, in "  # as IPython names a cell's line
            text = text.replace(f"{self.canonic(filename)}({lineno})", where, 1)
        return text


def user_top(frame: FrameType | None) -> FrameType | None:
    """The outermost frame of the user's code: the one nbaccel's rank entry called."""
    top = None
    while frame is not None:
        back = frame.f_back
        if (
            back is not None
            and frame.f_globals.get("__name__") not in PLUMBING_MODULES
            and back.f_globals.get("__name__") in PLUMBING_MODULES
        ):
            top = frame
        frame = back
    return top


CONSOLE = Console()


def post_mortem(exc: BaseException) -> None:
    """pdb in the notebook on ``exc``'s traceback: the real frames of this rank (a ``%ranks``
    rank, alive after its cell failed), from the user's first frame."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_globals.get("__name__", "").startswith("nbaccel."):
        tb = tb.tb_next
    if tb is None:
        raise LookupError("the failure has no frames of the user's code to debug")
    last = tb
    while last.tb_next is not None:
        last = last.tb_next
    debugger = RankPdb(CONSOLE, post_mortem=True)
    with CONSOLE.session("post-mortem", last.tb_frame) as console:
        if not console.is_open:
            raise RuntimeError("no kernel to talk to: this process is not a notebook's rank")
        debugger.reset()
        debugger.interaction(None, tb)


def breakpointhook(*args: Any, **kwargs: Any) -> Any:
    """``sys.breakpointhook`` of a rank: pdb in the notebook, unless ``PYTHONBREAKPOINT`` says
    otherwise (``0`` turns ``breakpoint()`` off, another hook is used as it would be)."""
    chosen = os.environ.get("PYTHONBREAKPOINT", "")
    if chosen == "0":
        return None
    if os.environ.get(ENV_UNREACHABLE) and chosen in ("", "pdb.set_trace"):
        print(
            f"nbaccel: breakpoint() skipped on rank {events.current_rank()}: the notebook cannot "
            "reach a rank on a Ray cluster to debug it",
            file=sys.stderr,
            flush=True,
        )
        return None
    if chosen not in ("", "pdb.set_trace") or not CONSOLE.available():
        return sys.__breakpointhook__(*args, **kwargs)
    frame = sys._getframe(1)
    header = kwargs.get("header")
    debugger = RankPdb(CONSOLE)
    if header is not None:
        debugger.message(header)
    debugger.start(frame)
    return None


def install(fallback_input: Callable[..., str]) -> None:
    """Make ``breakpoint()`` and ``input()`` of this rank ask the notebook (``fallback_input``:
    what ``input()`` does where no kernel can be asked)."""
    import builtins

    def input(prompt: object = "") -> str:  # noqa: A001 - it replaces the builtin
        if not CONSOLE.available():
            return fallback_input(prompt)
        frame = sys._getframe(1)
        with CONSOLE.session("input()", frame) as console:
            if not console.is_open:
                return fallback_input(prompt)
            try:
                return console.ask(f"[rank {console.rank}] {prompt}")
            except NoKeyboard as why:
                reason = (
                    f"input({prompt!r}) cannot read in a rank (rank {console.rank}): {why}. Ask "
                    "before the launch and pass the answer in, e.g. "
                    "notebook_launcher(train, args=(answer,))."
                )
        sys.stdout.write(str(prompt))  # the prompt still shows, as with the builtin
        sys.stdout.flush()
        raise EOFError(reason)

    builtins.input = input
    sys.breakpointhook = breakpointhook
