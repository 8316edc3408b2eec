"""The fork server's side of the mirror (``forkserver.importer``) speaking to a kernel that is busy: run
in this process over a socket pair, with modules already loaded, so it is quick."""

from __future__ import annotations

import gc
import socket
import threading
import time

from nbaccel.forkserver import importer as mirror
from nbaccel.forkserver.protocol import GO, HOLD, parse_line


def _answers(sock: socket.socket, count: int, timeout: float = 30) -> list[dict]:
    sock.settimeout(timeout)
    buffer, answers = b"", []
    while len(answers) < count:
        chunk = sock.recv(65536)
        if not chunk:
            break  # the server's side ended
        *lines, buffer = (buffer + chunk).split(b"\n")
        answers += [parse_line(line) for line in lines]
    return answers


def test_answers_wait_for_a_kernel_that_reads_late_and_a_hold_is_still_answered():
    # The kernel reads answers only between its cells: thousands of them (a kernel with
    # transformers) outgrow the socket's buffer. The server must wait, not end its mirror.
    names = 6000  # each answer is ~80 bytes: several times a Unix socket's buffer
    kernel, server = socket.socketpair()
    thread = threading.Thread(
        target=mirror._serve, args=(server, "\n".join(["json"] * names).encode()), daemon=True
    )
    thread.start()
    try:
        time.sleep(1.0)  # the kernel runs a cell meanwhile; the server's writes fill up
        answers = _answers(kernel, names)
        assert len(answers) == names and all(a["ok"] for a in answers)
        kernel.sendall(f"{HOLD} 1 json\n".encode())
        held = _answers(kernel, 2)
        assert [a.get("name") for a in held] == ["json", None] and held[1] == {"held": 1}
        kernel.sendall(f"{GO}\nos\n".encode())
        assert _answers(kernel, 1)[0]["name"] == "os"
    finally:
        kernel.close()
        thread.join(10)
        gc.unfreeze()  # each import froze this process's objects, as it does in the server
    assert not thread.is_alive()  # the kernel's end closed: the server's side ends


def test_a_hold_that_arrives_with_the_previous_launchs_go_is_answered():
    # Two launches in a row (two background launches at once): the first's GO and the second's
    # HOLD, which names nothing, reach the server in one read. It once went on waiting for a GO
    # without answering, and the second launch stayed "starting" for good.
    kernel, server = socket.socketpair()
    thread = threading.Thread(target=mirror._serve, args=(server, b""), daemon=True)
    thread.start()
    try:
        kernel.sendall(f"{HOLD} 1\n".encode())
        assert _answers(kernel, 1) == [{"held": 1}]
        kernel.sendall(f"{GO}\n{HOLD} 2\n".encode())
        assert _answers(kernel, 1, timeout=10) == [{"held": 2}]
        kernel.sendall(f"{GO}\njson\n".encode())
        assert _answers(kernel, 1)[0]["name"] == "json"
    finally:
        kernel.close()
        thread.join(10)
        gc.unfreeze()
    assert not thread.is_alive()
