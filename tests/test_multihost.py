"""Across hosts with addresses of their own: two network namespaces joined by veth.

Each host is a namespace (:mod:`tests.netns_helpers`: private 10.x addresses that exist only
here, loopback of its own); ``nbaccel launch`` agents and real kernels run inside them with
``ip netns exec``, so ranks meet over a real interface, not loopback. What nbaccel promises:

* static and c10d rendezvous: 2 hosts x 2 ranks form one group of 4; with static, host 0 holds
  ranks 0-1;
* every listener of a multi-host launch (stores, gloo) is on the host's own address, also
  after a restart;
* ``--max_restarts`` (static): a rank killed mid-run restarts every rank on both hosts; a
  whole host lost (its agent SIGKILLed) fails the other host's launch within
  ``NBACCEL_RESTART_TIMEOUT`` seconds, naming the machine that did not rejoin, and the lost
  host's ranks are gone too (by pid); losing machine 0 (its store) stops the other host at
  once, saying so;
* ``notebook_launcher(num_nodes=2, node_rank=i)`` from a kernel on each host: both cells return.

Single-machine launches probed from another namespace: ``tests/test_rendezvous_exposure.py``.
c10d with a lost host is not tested: torch's own timeouts (about 60 s) decide it, see
``docs/multi_machine.md``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from tests import netns_helpers
from tests.test_cli_support import cli_env, free_port

pytestmark = pytest.mark.slow

GATHER = textwrap.dedent(
    """
    import json, os, signal, socket, sys, time
    import psutil, torch, torch.distributed as dist

    dist.init_process_group("gloo")
    rank, restart = dist.get_rank(), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    mine = sorted(a.address for v in psutil.net_if_addrs().values() for a in v
                  if a.family == socket.AF_INET and not a.address.startswith("127."))
    got = [None] * dist.get_world_size()
    dist.all_gather_object(got, [rank, mine, restart])
    print("READY", restart, rank, flush=True)
    if "--die" in sys.argv and restart == 0 and rank == 3:
        os.kill(os.getpid(), signal.SIGKILL)  # mid-run: the others are in the loop below
    deadline = time.monotonic() + float(sys.argv[-1] if "--hold" in sys.argv else 0)
    while time.monotonic() < deadline:
        dist.all_reduce(torch.ones(1))
        time.sleep(0.2)
    if rank == 0:
        print("RESULT", json.dumps({"world": dist.get_world_size(), "sum": total.item(),
                                    "ranks": got}), flush=True)
    dist.destroy_process_group()
    """
)


@pytest.fixture(scope="module")
def hosts():
    reason = netns_helpers.unavailable()
    if reason:
        pytest.skip(f"no network namespaces here: {reason}")
    try:
        net = netns_helpers.Network.hosts(2)
    except OSError as exc:  # e.g. a container that may not make namespaces
        pytest.skip(f"no network namespaces here: {exc}")
    try:
        yield net
    finally:
        left = net.still_running()  # each test checks its own; this catches what a failure left
        net.close()
        assert net.left() == [], f"namespaces left behind: {net.left()}"
        assert left == [], f"processes left in the hosts' namespaces: {left}"


@pytest.fixture(scope="module")
def script(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("multihost") / "gather.py"
    path.write_text(GATHER)
    return path


class Agents:
    """One ``nbaccel launch`` per host, output in a file each."""

    def __init__(self, net, folder: Path, backend: str, *script_args: str, **env: str) -> None:
        self.net, self.port = net, free_port()
        self.logs = [folder / f"host{i}.log" for i in range(2)]
        self.args = (backend, script_args, env)
        self.procs = [self.start(i) for i in range(2)]

    def start(self, host: int) -> subprocess.Popen:
        backend, script_args, env = self.args
        argv = [
            sys.executable, "-m", "nbaccel", "launch", "--num_machines", "2",
            "--machine_rank", str(host), "--main_process_ip", self.net.address(0),
            "--main_process_port", str(self.port), "--num_processes", "2",
            "--rdzv_backend", backend, *script_args,
        ]  # fmt: skip
        with open(self.logs[host], "w") as log:
            return self.net.popen(
                host, argv, stdout=log, stderr=subprocess.STDOUT, env=cli_env(**env)
            )

    def output(self, host: int) -> str:
        return self.logs[host].read_text()

    def wait_for(self, host: int, text: str, count: int = 1, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        while self.output(host).count(text) < count:
            assert time.monotonic() < deadline, f"no {text!r} in {timeout} s:\n{self.output(host)}"
            assert self.procs[host].poll() is None, self.output(host)
            time.sleep(0.1)

    def finish(self, timeout: float = 120) -> list[int]:
        deadline = time.monotonic() + timeout
        codes = []
        for host, proc in enumerate(self.procs):
            try:
                codes.append(proc.wait(timeout=max(deadline - time.monotonic(), 1)))
            except subprocess.TimeoutExpired:
                self.kill()
                pytest.fail(f"host {host} still running after {timeout} s:\n{self.output(host)}")
        return codes

    def kill(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    def result(self) -> dict:
        line = next(x for x in self.output(0).splitlines() if "RESULT" in x)
        return json.loads(line.split("RESULT", 1)[1])


@pytest.fixture
def agents(hosts, tmp_path):
    started = []

    def start(*args: str, **env: str) -> Agents:
        started.append(Agents(hosts, tmp_path, *args, **env))
        return started[-1]

    yield start
    for a in started:
        a.kill()
    left = hosts.still_running()  # ranks below a killed agent's guard end just after it
    assert left == [], f"processes left in the hosts' namespaces: {left}"


@pytest.mark.parametrize("backend", ["static", "c10d"])
def test_two_hosts_two_ranks_each_form_one_group(hosts, agents, script, backend):
    run = agents(backend, str(script), "--hold", "3")
    run.wait_for(0, "READY 0 ", count=2)
    run.wait_for(1, "READY 0 ", count=2)
    for host in range(2):  # stores and meshes: only the launch runs there
        assert set(hosts.listening(host)) == {hosts.address(host)}, hosts.listening(host)
    assert run.finish() == [0, 0], run.output(0) + run.output(1)
    result = run.result()
    assert result["world"] == 4 and result["sum"] == 10.0
    on = {rank: addresses for rank, addresses, _ in result["ranks"]}
    assert sorted(on) == [0, 1, 2, 3]
    per_host = [[r for r in on if on[r] == [hosts.address(i)]] for i in range(2)]
    assert [len(p) for p in per_host] == [2, 2], on
    if backend == "static":
        assert per_host == [[0, 1], [2, 3]], on
    assert f"rendezvous on {hosts.address(0)}:{run.port} (only that interface)" in run.output(0)


def test_a_killed_rank_restarts_both_hosts_and_a_lost_host_fails_the_launch(hosts, agents, script):
    run = agents(
        "static", "--max_restarts", "2", str(script), "--die", "--hold", "60",
        NBACCEL_RESTART_TIMEOUT="10",
    )  # fmt: skip
    # Rank 3 (host 1) kills itself once all four are running: every rank restarts, on both.
    run.wait_for(0, "READY 1 ", count=2)
    run.wait_for(1, "READY 1 ", count=2)
    for host in range(2):  # the restart's stores and meshes too
        assert set(hosts.listening(host)) == {hosts.address(host)}, hosts.listening(host)
    lost = [p for p in hosts.pids() if _in_namespace(p, hosts.names[1])]
    os.kill(run.procs[1].pid, signal.SIGKILL)
    started = time.monotonic()
    assert run.procs[0].wait(timeout=60) == 1, run.output(0)
    took = time.monotonic() - started
    assert took < 10 + 30, f"host 0 took {took:.0f} s to give up"
    assert "machine 1 of 2 did not rejoin for restart 2 within 10 s" in run.output(0)
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in lost) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in lost if _alive(p)], "host 1's ranks outlived its agent"


def test_losing_machine_zero_stops_the_other_host_at_once(hosts, agents, script):
    run = agents("static", "--max_restarts", "1", str(script), "--hold", "60")
    run.wait_for(1, "READY 0 ", count=2)
    os.kill(run.procs[0].pid, signal.SIGKILL)
    started = time.monotonic()
    assert run.procs[1].wait(timeout=60) == 1, run.output(1)
    assert time.monotonic() - started < 30, "host 1 took long to notice"
    out = run.output(1)
    assert f"machine 0's rendezvous store at {hosts.address(0)}:{run.port} cannot be reached" in out
    # One line, not a Python traceback (torch's C++ store logs its own warning before it).
    assert "Traceback (most recent call last)" not in out, out


def _in_namespace(pid: int, ns: str) -> bool:
    out = subprocess.run(["ip", "netns", "identify", str(pid)], capture_output=True, text=True)
    return out.stdout.strip() == ns


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


NOTEBOOK_CELL = """
import nbaccel

def where():
    import socket, psutil, torch.distributed as dist
    dist.init_process_group("gloo")
    mine = sorted(a.address for v in psutil.net_if_addrs().values() for a in v
                  if a.family == socket.AF_INET and not a.address.startswith("127."))
    got = [None] * dist.get_world_size()
    dist.all_gather_object(got, (dist.get_rank(), mine))
    dist.destroy_process_group()
    return got

result = nbaccel.notebook_launcher(
    where, num_processes=2, num_nodes=2, node_rank={node_rank}, master_addr="{master}",
    use_port={port}, progress=False,
)
print("RETURNED", result)
"""


def test_notebook_launcher_with_a_kernel_on_each_host(hosts, tmp_path):
    from tests.kernel_helpers import KernelSession

    port = free_port()
    kernels = [KernelSession(prefix=hosts.prefix(i), ipc=str(tmp_path / f"k{i}")) for i in range(2)]
    cells: dict[int, object] = {}
    try:
        for k in kernels:
            k.__enter__()

        def run(i: int) -> None:
            code = NOTEBOOK_CELL.format(node_rank=i, master=hosts.address(0), port=port)
            cells[i] = kernels[i].execute(code, timeout=120)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(150)
        for i in range(2):
            assert cells[i].error is None, cells[i].error_text
        a, b = hosts.address(0), hosts.address(1)
        expected = [(0, [a]), (1, [a]), (2, [b]), (3, [b])]
        assert f"RETURNED {expected}" in cells[0].stdout
        assert "RETURNED None" in cells[1].stdout  # rank 0's value is returned on node 0
        for k in kernels:
            assert k.leftovers() == []
    finally:
        for k in kernels:
            if k.client is not None:
                k.__exit__(None, None, None)
    # By pid, in the namespaces: the kernels' fork servers and trackers end with the kernels.
    left = hosts.still_running()
    assert left == [], f"processes left in the hosts' namespaces: {left}"
