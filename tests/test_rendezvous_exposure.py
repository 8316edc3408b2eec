"""Single-machine launches listen on loopback only: nothing off this machine reaches a store.

torch's TCPStore listens on every interface by default (``*:port``); a process that reaches
it can write keys into a launch's rendezvous. Each test connects to the store's port from a
network namespace of its own (a veth pair with private 10.x addresses, where ``ip netns`` is
allowed) and from this machine's own non-loopback addresses, during a real launch, and must
be refused; every listening socket of the launch's processes must be on loopback.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

import nbaccel
from tests import netns_helpers
from tests.test_cli_support import free_port, start_cli

LOOPBACK = ("127.0.0.1", "::1")
CONNECT = (
    "import socket, sys\n"
    "s = socket.socket(socket.AF_INET6 if ':' in sys.argv[1] else socket.AF_INET)\n"
    "s.settimeout(3)\n"
    "print(s.connect_ex((sys.argv[1], int(sys.argv[2]))))\n"
)


class Outside:
    """The ways to this machine other than loopback: its own non-loopback addresses, and a
    network namespace of this test's own (``None`` where ``ip netns`` is not allowed)."""

    def __init__(self, addresses: list[str], netns: str | None, host_side: str | None) -> None:
        self.addresses, self.netns, self.host_side = addresses, netns, host_side

    def reached(self, port: int) -> list[str]:
        """The routes by which a connection to ``port`` was accepted (none is the goal)."""
        found = [f"{a}:{port}" for a in self.addresses if self._connects(a, port)]
        if self.netns and self.host_side:
            run = ["ip", "netns", "exec", self.netns, sys.executable, "-c", CONNECT]
            out = subprocess.run(
                [*run, self.host_side, str(port)], capture_output=True, text=True, timeout=30
            )
            if out.stdout.strip() == "0":
                found.append(f"netns {self.netns} -> {self.host_side}:{port}")
        return found

    @staticmethod
    def _connects(address: str, port: int) -> bool:
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.settimeout(3)
            return s.connect_ex((address, port)) == 0


def _own_addresses() -> list[str]:
    found = []
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            inet = a.family in (socket.AF_INET, socket.AF_INET6)
            # (link-local fe80:: addresses need a scope id to connect to)
            if inet and a.address not in LOOPBACK and not a.address.startswith("fe80"):
                found.append(a.address)
    return found


@pytest.fixture(scope="module")
def outside():
    net = None
    if netns_helpers.unavailable() is None:
        try:
            net = netns_helpers.Network.hosts(1, with_root=True)
        except OSError:
            net = None
    try:
        host_side = net.address(0) if net else None
        addresses = [a for a in _own_addresses() if a != host_side]
        if not addresses and not net:
            pytest.skip("no way off loopback here: no non-loopback address, no `ip netns` (root)")
        yield Outside(addresses, net.names[1] if net else None, host_side)
    finally:
        if net:
            net.close()


@pytest.mark.slow
def test_outside_reaches_a_store_torch_starts_itself(outside):
    """The probe works: torch's own store (every interface) is reached from outside."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    try:
        assert outside.reached(store.port)
    finally:
        del store


def listening(pids: list[int]) -> list[tuple[int, str, int]]:
    found = []
    for pid in pids:
        for c in psutil.Process(pid).net_connections(kind="inet"):
            if c.status == psutil.CONN_LISTEN:
                found.append((pid, c.laddr.ip, c.laddr.port))
    return found


def store_seen_from_outside(outside):
    """A rank function: the user's own init_process_group (env://), then rank 0 probes."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    port = int(os.environ["MASTER_PORT"])
    reached = outside.reached(port) if dist.get_rank() == 0 else []
    ours = listening([os.getpid()])
    dist.barrier()
    return port, reached, ours


@pytest.mark.slow
def test_notebook_launch_store_refuses_outside(outside):
    results = nbaccel.notebook_launcher(
        store_seen_from_outside, args=(outside,), num_processes=2, progress=False, return_all=True
    )
    port, reached, _ = results[0]
    assert reached == [], f"the store on port {port} was reached from outside: {reached}"
    for _, _, ours in results:
        assert ours and all(ip in LOOPBACK for _, ip, _ in ours), ours
    assert any(p == port for _, _, p in results[0][2])  # rank 0 does listen there


@pytest.mark.slow
def test_ranks_session_store_refuses_outside(outside):
    ranks = nbaccel.Ranks(num_processes=2, progress=False)
    try:
        port = ranks.run("import os\nint(os.environ['MASTER_PORT'])")[0]
        ours = listening(ranks.pids)
        assert (ranks.pids[0], "127.0.0.1", port) in ours
        assert all(ip in LOOPBACK for _, ip, _ in ours), ours
        assert outside.reached(port) == []
    finally:
        ranks.stop()


HOLD = textwrap.dedent(
    """
    import os, sys, time
    import torch.distributed as dist
    dist.init_process_group("gloo")
    print("READY", os.environ["MASTER_PORT"], flush=True)
    deadline = time.monotonic() + 120
    while not os.path.exists(sys.argv[1]) and time.monotonic() < deadline:
        time.sleep(0.1)
    dist.barrier()
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["static", "c10d"])
def test_cli_launch_stores_refuse_outside(outside, tmp_path, backend):
    script = tmp_path / "hold.py"
    script.write_text(HOLD)
    go = tmp_path / "go"
    agent_port = free_port()
    proc = start_cli(
        "launch", "--num_processes", "2", "--main_process_port", str(agent_port),
        "--rdzv_backend", backend, str(script), str(go), cwd=tmp_path,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        seen = [""]
        while "READY" not in seen[-1] and time.monotonic() < deadline:
            seen.append(proc.stdout.readline())
            assert seen[-1] or proc.poll() is None, proc.stderr.read()
        worker_port = int(seen[-1].split()[-1])
        tree = [proc.pid] + [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
        ours = listening(tree)
        ports = {p for _, _, p in ours}
        assert {agent_port, worker_port} <= ports
        assert all(ip in LOOPBACK for _, ip, _ in ours), ours
        assert outside.reached(agent_port) == [] and outside.reached(worker_port) == []
        go.touch()
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, out + err
        assert f"rendezvous on 127.0.0.1:{agent_port} (loopback only)" in "".join(seen) + out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.slow  # imports torch.distributed
def test_across_machines_the_store_listens_on_machine_zeros_address_only():
    from nbaccel.core import rendezvous

    own = [a for a in _own_addresses() if ":" not in a]
    if not own:
        pytest.skip("this machine has no non-loopback IPv4 address")
    address = own[0]
    assert rendezvous.listen_address(address) == address
    assert rendezvous.listen_address("203.0.113.9") == ""  # not this machine's (NAT): every one
    # A machine name /etc/hosts maps to loopback: the other machines reach it at another address.
    name = socket.gethostname()
    if _name_is_loopback(name):
        assert rendezvous.listen_address(name, one_machine=False) == ""
        assert rendezvous.listen_address(name, one_machine=True) == socket.gethostbyname(name)
    store = rendezvous.serve_store(address, 0)
    try:
        assert Outside._connects(address, store.port)
        assert not Outside._connects("127.0.0.1", store.port)
        assert rendezvous.describe_listening(address, store.port).endswith("(only that interface)")
    finally:
        del store


def test_across_machines_gloo_and_nccl_use_the_interface_routing_to_machine_zero(monkeypatch):
    from nbaccel.core import rendezvous

    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        monkeypatch.delenv(name, raising=False)
    own = [a for a in _own_addresses() if ":" not in a]
    if not own:
        pytest.skip("this machine has no non-loopback IPv4 address")
    holder = next(
        n for n, addrs in psutil.net_if_addrs().items() if own[0] in {a.address for a in addrs}
    )
    env = rendezvous.launcher_environment({}, "cli", own[0], one_machine=False)
    assert env["GLOO_SOCKET_IFNAME"] == env["NCCL_SOCKET_IFNAME"] == holder
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "mine0")  # the user's choice wins
    assert (
        rendezvous.launcher_environment({}, "cli", own[0], False)["GLOO_SOCKET_IFNAME"] == "mine0"
    )
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    # A name /etc/hosts maps to loopback: pinning gloo to lo would cut the other machines off.
    name = socket.gethostname()
    if _name_is_loopback(name):
        assert "GLOO_SOCKET_IFNAME" not in rendezvous.launcher_environment({}, "cli", name, False)


def _name_is_loopback(name: str) -> bool:
    """Whether ``name`` resolves to a loopback address (not at all: a chroot or container whose
    /etc/hosts lacks its own name)."""
    try:
        return ipaddress.ip_address(socket.gethostbyname(name)).is_loopback
    except OSError:
        return False
