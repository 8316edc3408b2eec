"""Drive a real ipykernel through jupyter_client and record what a notebook would render.

Example::

    with KernelSession() as kernel:
        cell = kernel.execute("print(1 + 1)")
        assert cell.stdout == "2\\n"
"""

from __future__ import annotations

import dataclasses
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import psutil
from jupyter_client.manager import KernelManager

from tests.conftest import CLOSING_KERNELS, LONG_LIVED

STDIN_POLL = 0.05  # s between looks at the stdin channel while a cell may ask for input


@dataclasses.dataclass
class Cell:
    """Everything the kernel published on iopub for one executed cell, in arrival order."""

    messages: list[dict[str, Any]]
    reply: dict[str, Any]
    # The prompts of the kernel's input_requests, in order, when the cell ran with ``answer``.
    prompts: list[str] = dataclasses.field(default_factory=list)

    def _streams(self, name: str) -> str:
        return "".join(
            m["content"]["text"]
            for m in self.messages
            if m["msg_type"] == "stream" and m["content"]["name"] == name
        )

    @property
    def stdout(self) -> str:
        return self._streams("stdout")

    @property
    def stderr(self) -> str:
        return self._streams("stderr")

    @property
    def error(self) -> dict[str, Any] | None:
        """The ``error`` message content (ename, evalue, traceback), if the cell raised."""
        return next((m["content"] for m in self.messages if m["msg_type"] == "error"), None)

    @property
    def error_text(self) -> str:
        """The error as the notebook shows it, without ANSI colour codes."""
        import re

        err = self.error
        if err is None:
            return ""
        return re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(err["traceback"]))

    @property
    def results(self) -> list[dict[str, Any]]:
        """``data`` bundles of execute_result and display_data messages."""
        return [
            m["content"]["data"]
            for m in self.messages
            if m["msg_type"] in ("execute_result", "display_data")
        ]

    def of_type(self, *types: str) -> list[dict[str, Any]]:
        return [m for m in self.messages if m["msg_type"] in types]


class KernelSession:
    """A real ipykernel for one test module; its pid is exempt from the leftover check, and
    :meth:`leftovers` lists what the kernel itself left running."""

    def __init__(
        self,
        env: dict[str, str] | None = None,
        startup: str | None = None,
        prefix: list[str] | None = None,
        ipc: str | None = None,
        background_shutdown: bool = False,
        python: str | None = None,
    ) -> None:
        """``prefix`` runs the kernel below a command (e.g. ``ip netns exec NS``); ``ipc``, a
        path prefix, connects over Unix sockets instead of TCP (they reach into a network
        namespace, which the kernel's 127.0.0.1 does not).

        ``background_shutdown``: for a kernel whose shutdown no test checks (a module's shared
        kernel; a test's own kernel when nothing after its ``with`` depends on the kernel being
        gone). Leaving the ``with`` shuts it down the same way, in a thread, so the next test
        need not wait for it (~0.2 s; tests/test_kernel_shutdown.py). Its pid stays exempt
        from the leftover check until it is gone, and the test session waits for it before it
        ends (conftest).

        ``python``: the kernel runs on that interpreter (another virtual environment's), in its
        own folder and without this checkout on its path, so it imports what was installed
        there."""
        if ipc:
            self.manager = KernelManager(kernel_name="python3", transport="ipc", ip=ipc)
        else:
            self.manager = KernelManager(kernel_name="python3")
        self._python = python
        if python:
            self.manager.kernel_spec.argv[0] = python
        if prefix:
            import sys

            argv = self.manager.kernel_spec.argv
            # jupyter_client puts its own Python in place of a leading "python" only
            argv[:] = [*prefix, sys.executable, *argv[1:]]
        self._env = env or {}
        self._startup = startup
        self._background_shutdown = background_shutdown
        self.client = None
        # iopub messages of earlier requests that arrived while a later cell ran (a background
        # launch's output), in arrival order: see messages_of
        self.other_messages: list[dict[str, Any]] = []
        self.statuses: list[dict[str, Any]] = []  # the busy/idle statuses of executed cells

    def __enter__(self) -> KernelSession:
        env = {**os.environ, **self._env}
        env.pop("NBACCEL_NO_WARMUP", None)  # the kernel behaves as a user's would
        if self._python:
            env.pop("PYTHONPATH", None)
            self.manager.start_kernel(env=env, cwd=os.path.dirname(self._python))
        else:
            env["PYTHONPATH"] = os.pathsep.join(
                p for p in [os.getcwd(), env.get("PYTHONPATH")] if p
            )
            self.manager.start_kernel(env=env)
        self.client = self.manager.client()
        self.client.start_channels()
        self.client.wait_for_ready(timeout=120)
        LONG_LIVED.add(self.pid)
        if self._startup:
            cell = self.execute(self._startup)
            assert cell.error is None, cell.error_text
        return self

    def __exit__(self, *exc: object) -> None:
        pid = self.pid
        self.client.stop_channels()
        if not self._background_shutdown:
            self._shut_down(pid)
            return
        closing = threading.Thread(target=self._shut_down, args=(pid,), name=f"kernel {pid}")
        closing.start()
        CLOSING_KERNELS.append(closing)

    def _shut_down(self, pid: int) -> None:
        try:
            self.manager.shutdown_kernel(now=False)
        finally:
            LONG_LIVED.discard(pid)

    @property
    def pid(self) -> int:
        return self.manager.provisioner.process.pid

    def execute(
        self,
        code: str,
        timeout: float = 180,
        on_message=None,
        answer: Callable[[str], str | None] | None = None,
    ) -> Cell:
        """Run ``code`` as a cell; return once the kernel is idle again for it.

        ``on_message(msg)`` sees each iopub message as it arrives (e.g. to interrupt the kernel
        once some output has appeared). ``answer``: the cell may ask for input (``input()``,
        pdb), as a frontend allows; each ``input_request`` is answered with ``answer(prompt)``
        in an ``input_reply``, as JupyterLab's input box does (``None``: leave it unanswered,
        e.g. to interrupt or shut the kernel down at the prompt).
        """
        msg_id = self.last_msg_id = self.client.execute(code, allow_stdin=answer is not None)
        deadline = time.monotonic() + timeout
        messages: list[dict[str, Any]] = []
        prompts: list[str] = []
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"cell did not finish in {timeout} s:\n{code}")
            if answer is not None:
                self._answer_stdin(answer, prompts)
            try:
                wait = remaining if answer is None else min(remaining, STDIN_POLL)
                msg = self.client.get_iopub_msg(timeout=wait)
            except queue.Empty:
                continue
            msg["received_at"] = time.monotonic()
            if msg["parent_header"].get("msg_id") != msg_id:
                self.other_messages.append(msg)
                continue
            if msg["msg_type"] == "status":
                self.statuses.append(msg)
                if msg["content"]["execution_state"] == "idle":
                    break
                continue
            messages.append(msg)
            if on_message is not None:
                on_message(msg)
        return Cell(messages, self.shell_reply(msg_id, timeout)["content"], prompts)

    def _answer_stdin(self, answer: Callable[[str], str | None], prompts: list[str]) -> None:
        """Reply to the kernel's pending input_request, if there is one."""
        try:
            request = self.client.get_stdin_msg(timeout=0)
        except queue.Empty:
            return
        if request["msg_type"] != "input_request":
            return
        prompt = request["content"]["prompt"]
        prompts.append(prompt)
        line = answer(prompt)
        if line is not None:
            self.client.input(line)

    def messages_of(self, msg_id: str) -> Cell:
        """What arrived for request ``msg_id`` after its cell went idle (so far), as a Cell."""
        mine = [m for m in self.other_messages if m["parent_header"].get("msg_id") == msg_id]
        return Cell([m for m in mine if m["msg_type"] != "status"], {})

    def drain_iopub(self, seconds: float) -> None:
        """Keep what arrives on iopub for ``seconds`` (see :meth:`messages_of`)."""
        deadline = time.monotonic() + seconds
        while (remaining := deadline - time.monotonic()) > 0:
            try:
                msg = self.client.get_iopub_msg(timeout=remaining)
            except queue.Empty:
                return
            msg["received_at"] = time.monotonic()
            self.other_messages.append(msg)

    def shell_reply(self, msg_id: str, timeout: float = 30) -> dict[str, Any]:
        """The shell reply to request ``msg_id``, skipping replies to earlier requests, which
        would otherwise answer this one: jupyter_client's ``wait_for_ready`` re-sends
        kernel_info every second while a loaded kernel starts and reads only one reply."""
        deadline = time.monotonic() + timeout
        while True:
            reply = self.client.get_shell_msg(timeout=max(deadline - time.monotonic(), 0.1))
            if reply["parent_header"].get("msg_id") == msg_id:
                return reply

    def interrupt(self) -> None:
        self.manager.interrupt_kernel()

    def leftovers(self) -> list[psutil.Process]:
        """Processes below the kernel other than nbaccel's fork server and resource tracker
        (and zombies), asked of the kernel itself."""
        cell = self.execute(
            "import psutil as _p, nbaccel.forkserver.server as _np\n"
            "_h = _np.SERVER.helper_pids()\n"
            "_left = [c.pid for c in _p.Process().children(recursive=True)\n"
            "         if c.pid not in _h and c.status() != _p.STATUS_ZOMBIE]\n"
            "print(_left)"
        )
        assert cell.error is None, cell.error_text
        pids = eval(cell.stdout.strip() or "[]")  # a list of ints printed by the kernel
        return [psutil.Process(p) for p in pids if psutil.pid_exists(p)]


def text_view_kernel(startup: str = "import nbaccel, os, time") -> Iterator[KernelSession]:
    """A kernel shared by a test module whose launches show the plain text view (the lines a
    test reads); use as ``yield from text_view_kernel()`` in a module-scoped fixture."""
    with KernelSession(env={"NBACCEL_VIEW": "text"}, startup=startup) as kernel:
        yield kernel


def typed(*lines: str, then: str = "c") -> tuple[Callable[[str], str], list[str]]:
    """An ``answer`` for :meth:`KernelSession.execute` that types ``lines``, one per prompt
    (``then`` at any prompt after them), and the list of prompts it was asked."""
    answers, prompts = list(lines), []

    def answer(prompt: str) -> str:
        prompts.append(prompt)
        return answers.pop(0) if answers else then

    return answer, prompts
