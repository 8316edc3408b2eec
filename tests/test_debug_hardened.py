"""The rank debugger against what can go wrong around it, in one real kernel answered on its stdin
channel as a frontend does: another local user at a paused rank's socket, ``q`` with an
``except Exception`` around ``breakpoint()``, a failing rank's locals that cannot be copied
cheaply, a rank failing while another is paused, two failed ranks debugged in turn."""

from __future__ import annotations

import datetime
import os
import re
import shutil
import subprocess
import tempfile
import textwrap
import time

import pytest

from tests.kernel_helpers import KernelSession, typed

pytestmark = pytest.mark.slow  # a real kernel

NOBODY = 65534
# Another local user's client: connects to every address given, as it is told (a stranger
# cannot drive pdb without the key, but before, whatever it sent reached the rank).
STRANGER = textwrap.dedent("""
    import socket, sys, time
    held = []
    for address in sys.argv[1:]:
        for how in ("junk", "close", "silent"):
            s = socket.socket(socket.AF_UNIX)
            try:
                s.connect(address)
            except OSError as exc:
                print("refused", how, type(exc).__name__, flush=True)
                continue
            print("connected", how, flush=True)
            if how == "junk":
                s.sendall(b"\\x00\\x00\\x00\\x10" + b"x" * 16)
                time.sleep(0.3)
                s.close()
            elif how == "close":
                s.close()
            else:
                held.append(s)
    time.sleep(float(__import__("os").environ.get("HOLD", "3")))
""")


@pytest.fixture(scope="module")
def tmp_root():
    folder = tempfile.mkdtemp(prefix="debug-hardened-")
    os.chmod(folder, 0o755)  # another user must be able to reach what the kernel would share
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def kernel(tmp_root):
    env = {"NBACCEL_VIEW": "text", "TMPDIR": tmp_root}
    with KernelSession(env=env, startup="import nbaccel, os, time") as kernel:
        yield kernel
    # Shut down (cleanly, as a person's notebook is): nothing of nbaccel's is left behind
    # (before, each shutdown left its fork server's nbaccel-mirror-* folder).
    left = [n for n in os.listdir(tmp_root) if n.startswith("nbaccel-")]
    assert left == [], left


@pytest.fixture(autouse=True)
def nothing_left_in_kernel(kernel):
    yield
    assert kernel.leftovers() == [], "rank processes outlived a test"


def cell(code: str) -> str:
    return textwrap.dedent(code).strip()


def unix_sockets_of(pid: int) -> list[str]:
    """The addresses of the Unix sockets ``pid`` holds, as /proc/net/unix lists them (world
    readable: what another user sees); abstract names with their NUL."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with_target = os.readlink(f"/proc/{pid}/fd/{fd}") if fd.isdigit() else ""
        found = re.fullmatch(r"socket:\[(\d+)\]", with_target)
        if found:
            inodes.add(found.group(1))
    addresses = []
    with open("/proc/net/unix") as table:
        next(table)
        for line in table:
            fields = line.split()
            if len(fields) >= 8 and fields[6] in inodes and "nbaccel" in fields[7]:
                path = fields[7]
                addresses.append("\0" + path[1:] if path.startswith("@") else path)
    return addresses


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None,
    reason="making a process of another user needs root and setpriv",
)
def test_another_user_at_a_paused_ranks_socket_neither_fails_nor_holds_it(kernel):
    started = kernel.execute(
        cell("""
        def train():
            values = [int(os.environ["RANK"]), 5]
            if values[0] == 1:
                breakpoint()
                values.append(6)
            return sum(values)

        launch = nbaccel.notebook_launcher(train, num_processes=2, block=False)
        while not any(r.paused for r in (launch.state.ranks.values() if launch.state else [])):
            time.sleep(0.05)
        print("pid", launch.state.ranks[1].pid)
        """),
        timeout=60,
    )
    assert started.error is None, started.error_text
    pid = int(re.search(r"pid (\d+)", started.stdout).group(1))
    addresses = unix_sockets_of(pid)
    assert addresses, "the paused rank listens on no Unix socket"
    stranger = subprocess.Popen(
        ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
        + ["/usr/bin/python3", "-c", STRANGER, *addresses],
        stdout=subprocess.PIPE,
        text=True,
        env={"HOLD": "20", "PATH": "/usr/bin:/bin"},
    )
    try:
        time.sleep(1.0)  # its junk, its closed and its silent connection are in
        answer, prompts = typed("p values", "c")
        began = time.monotonic()
        served = kernel.execute("launch.debug()", answer=answer, timeout=60)
        took = time.monotonic() - began
        assert served.error is None, served.error_text
        assert prompts == ["(Pdb rank 1)"] * 2  # as the frontends get it: they add the space
        assert took < 4, f"the prompt came {took:.1f} s late"  # not held by the silent peer
        result = kernel.execute("launch.result(timeout=30)")
        assert result.error is None, result.error_text  # not AuthenticationError, not EOFError
        assert result.results[-1]["text/plain"] == "5"
    finally:
        stranger.kill()
        said = stranger.communicate()[0]
    assert "connected" not in said, said  # the private folder turned it away at connect


def test_q_at_launch_debug_runs_nothing_after_it_whatever_the_except(kernel, tmp_root):
    marker = os.path.join(tmp_root, "ran-on")
    started = kernel.execute(
        cell(f"""
        def train():
            rank = int(os.environ["RANK"])
            if rank == 1:
                try:
                    breakpoint()
                    x = 1
                except Exception as exc:
                    open({marker!r}, "a").write("caught " + type(exc).__name__ + "\\n")
                open({marker!r}, "a").write("ran on\\n")
            time.sleep(0.5)
            return rank

        launch = nbaccel.notebook_launcher(train, num_processes=2, block=False)
        while not any(r.paused for r in (launch.state.ranks.values() if launch.state else [])):
            time.sleep(0.05)
        """),
        timeout=60,
    )
    assert started.error is None, started.error_text
    answer, _ = typed("q")
    assert kernel.execute("launch.debug()", answer=answer).error is None
    ended = kernel.execute("print(launch.status, launch.ranks)")
    assert not os.path.exists(marker), open(marker).read()
    assert "interrupted" in ended.stdout and "failed" not in ended.stdout, ended.stdout


FAILING_WITH_HANDLES = cell("""
    import socket

    class Stuck:
        def __repr__(self):
            time.sleep(3600)
        def __reduce__(self):
            time.sleep(3600)

    def train(path):
        rank = int(os.environ["RANK"])
        if rank == 1:
            big = open(path)                    # a 512 MiB file: described, never read
            big.seek(100)
            sock = socket.socket()
            numbers = iter([1, 2])
            lines = (line for line in big)
            stuck = Stuck()
            kept = {"file": big, "n": 3}
            raise KeyError("labels")
        time.sleep(600)
""")


def test_a_failure_is_reported_at_once_whatever_its_locals(kernel, tmp_root):
    path = os.path.join(tmp_root, "big.txt")
    with open(path, "w") as f:
        f.truncate(512 << 20)  # sparse: costs no disk
    assert kernel.execute(FAILING_WITH_HANDLES).error is None
    began = time.monotonic()
    failed = kernel.execute(f"nbaccel.notebook_launcher(train, args=({path!r},), num_processes=2)")
    took = time.monotonic() - began
    assert failed.error is not None and failed.error["ename"] == "RankFailedError"
    assert "KeyError" in failed.error_text
    assert took < 20, f"the failure took {took:.1f} s"
    answer, _ = typed("p big", "p sock", "p lines", "p stuck", "p kept", "q")
    debugged = kernel.execute("%debug", answer=answer)
    out = debugged.stdout
    assert f"_io.TextIOWrapper name {path!r} mode 'r' position 100" in out, out
    assert "socket.socket" in out and "a handle: described, not read" in out, out
    assert "generator <genexpr> not started" in out, out
    assert "Stuck" in out and "not copied: its pickling or repr took over" in out, out
    assert "'n': 3" in out and "'file': <not sent from the rank: _io.TextIOWrapper" in out, out


def test_another_ranks_failure_shows_while_a_prompt_waits_and_the_paused_line_once(kernel):
    code = cell("""
        def train():
            rank = int(os.environ["RANK"])
            if rank == 1:
                breakpoint()
                x = 1
            else:
                time.sleep(1)
                raise ValueError("rank 0 broke")
            return rank

        nbaccel.notebook_launcher(train, num_processes=2, timeout=120)
    """)
    answered = []

    def answer(prompt: str) -> str:
        time.sleep(4)  # the person reads (past the text view's 3 s); rank 0 fails meanwhile
        answered.append(datetime.datetime.now(datetime.timezone.utc))
        return "c"

    result = kernel.execute(code, answer=answer)
    assert result.error is not None and "rank 0 broke" in result.error_text
    told = [
        m
        for m in result.messages
        if m["msg_type"] == "stream"
        and "rank 0 failed while this prompt waits" in m["content"]["text"]
    ]
    assert told, result.stdout + result.stderr
    assert told[0]["header"]["date"] < answered[0], "said only once the prompt was answered"
    assert (result.stdout + result.stderr).count("rank 1 paused in") == 1, result.stdout


def test_two_failed_ranks_are_debugged_in_turn(kernel):
    failed = kernel.execute(
        cell("""
        import signal

        def train():
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # both fail, whichever is first
            rank = int(os.environ["RANK"])
            mine = f"rank {rank}'s"
            time.sleep(0.5)
            raise ValueError(mine)

        nbaccel.notebook_launcher(train, num_processes=2)
        """)
    )
    assert failed.error is not None
    named = int(re.search(r"rank (\d) \(of 2\)", failed.error_text).group(1))
    other = 1 - named
    answer, _ = typed("p mine", "q")
    first = kernel.execute("%debug", answer=answer)
    assert f"post-mortem of rank {named}" in first.stdout
    assert f"rank {other} failed too" in first.stdout, first.stdout
    assert f"nbaccel.debug(rank={other})" in first.stdout
    assert f"rank {named}'s" in first.stdout
    answer, _ = typed("p mine", "q")
    second = kernel.execute(f"nbaccel.debug(rank={other})", answer=answer)
    assert second.error is None, second.error_text
    assert f"post-mortem of rank {other}" in second.stdout
    assert f"rank {other}'s" in second.stdout, second.stdout


def test_no_nbaccel_folder_is_left_in_the_temporary_directory(kernel, tmp_root):
    """Last in the module: every launch above, a paused one stopped included, has ended."""
    stopped = kernel.execute(
        cell("""
        def train():
            if os.environ["RANK"] == "1":
                breakpoint()
            return 1

        launch = nbaccel.notebook_launcher(train, num_processes=2, block=False)
        while not any(r.paused for r in (launch.state.ranks.values() if launch.state else [])):
            time.sleep(0.05)
        launch.stop()
        """)
    )
    assert stopped.error is None, stopped.error_text
    left = [n for n in os.listdir(tmp_root) if n.startswith("nbaccel-")]
    assert left == [], left
