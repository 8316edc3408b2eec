"""The paused rank's socket (``core.private_socket``) with real peers: a client of this user
that sends junk, one that stays silent, another user's process (made with ``setpriv``), and
then the genuine client, who is served as if nobody else had come."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import threading
from multiprocessing.connection import Client

import pytest

from nbaccel.core import private_socket
from nbaccel.core.private_socket import PrivateListener

NOBODY = 65534


def accept_in_thread(listener: PrivateListener) -> tuple[threading.Thread, list]:
    got: list = []
    thread = threading.Thread(target=lambda: got.append(listener.accept()), daemon=True)
    thread.start()
    return thread, got


def test_junk_and_silence_of_this_user_are_dropped_and_the_genuine_client_served(
    monkeypatch, capfd
):
    monkeypatch.setattr(private_socket, "AUTH_SECONDS", 0.5)
    key = os.urandom(32)
    with PrivateListener(key) as listener:
        thread, got = accept_in_thread(listener)
        junk = socket.socket(socket.AF_UNIX)
        junk.connect(listener.address)
        junk.sendall(b"\x00\x00\x00\x10" + b"x" * 16)
        silent = socket.socket(socket.AF_UNIX)
        silent.connect(listener.address)  # and says nothing
        genuine = Client(listener.address, family="AF_UNIX", authkey=key)
        thread.join(10)
        assert got, "the genuine client was never accepted"
        genuine.send("hello")
        assert got[0].recv() == "hello"
        for conn in (junk, silent, genuine, got[0]):
            conn.close()
    assert not os.path.exists(listener.folder)
    noted = capfd.readouterr().err
    assert noted.count("nbaccel: ignored a connection") == 1, noted  # noted once


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None or not os.path.exists("/usr/bin/python3"),
    reason="making a process of another user needs root and setpriv",
)
def test_another_user_is_dropped_before_a_byte_is_read_even_where_the_folder_lets_it_in(capfd):
    key = os.urandom(32)
    with PrivateListener(key) as listener:
        os.chmod(listener.folder, 0o755)  # the first wall down: the peer's uid still holds
        os.chmod(listener.address, 0o777)
        thread, got = accept_in_thread(listener)
        stranger = subprocess.run(
            ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
            + ["/usr/bin/python3", "-I", "-c", CONNECT, listener.address],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert stranger.returncode == 0, stranger.stderr
        genuine = Client(listener.address, family="AF_UNIX", authkey=key)
        thread.join(10)
        assert got, "the genuine client was never accepted"
        genuine.close()
        got[0].close()
    assert "closed by the listener" in stranger.stdout, stranger.stdout
    assert f"from a process of user id {NOBODY}" in capfd.readouterr().err


CONNECT = """
import socket, sys
s = socket.socket(socket.AF_UNIX)
s.connect(sys.argv[1])
s.settimeout(10)
try:
    s.sendall(b"junk")
    answer = s.recv(100)
except (BrokenPipeError, ConnectionResetError):  # closed before (or with) its junk unread
    answer = b""
print("closed by the listener" if answer == b"" else "answered")
"""
