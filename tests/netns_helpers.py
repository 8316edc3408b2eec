"""Hosts with addresses of their own on this machine: network namespaces joined by veth.

Each namespace gets its loopback up and one private address (a 10.x.y.0/24 that exists only
inside these namespaces: no route leads off the machine). Names are unique per run (the pid
and a random suffix, short enough for interface names) and everything is removed on
:meth:`Network.close`, also after a failure: the processes still in the namespaces (by pid,
``ip netns pids``) are killed, then the links and namespaces deleted. No tests here.

Example::

    with Network.hosts(2) as net:  # two hosts joined by one veth pair
        net.run(1, ["ping", "-c1", net.address(0)])
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import time
from collections.abc import Sequence


def _ip(*args: str) -> bool:
    return subprocess.run(["ip", *args], capture_output=True, timeout=30).returncode == 0


def unavailable() -> str | None:
    """Why namespaces cannot be made here (a skip reason), or ``None`` when they can."""
    if not shutil.which("ip"):
        return "`ip` (iproute2) is not installed"
    if os.geteuid() != 0:
        return "`ip netns` needs root"
    return None


def unique_name() -> str:
    return f"nb{os.getpid() % 100000}{random.randrange(16**3):03x}"  # short: interface names


class Network:
    """Namespaces named ``{name}{i}`` and the veth pair between them (``None`` in
    :attr:`names` stands for this machine's own namespace)."""

    def __init__(self) -> None:
        self.name = unique_name()
        self.net = f"10.{random.randrange(100, 250)}.{random.randrange(256)}"
        self.names: list[str | None] = []
        self.addresses: list[str] = []
        self.links: list[str] = []

    @classmethod
    def hosts(cls, count: int = 2, with_root: bool = False) -> Network:
        """Two hosts joined by one veth pair: ``count`` namespaces, or this machine's own
        namespace and one more when ``with_root``."""
        if count + with_root != 2:
            raise ValueError("two hosts: Network.hosts(2) or Network.hosts(1, with_root=True)")
        net = cls()
        try:
            if with_root:
                net.names.append(None)
            for i in range(count):
                ns = f"{net.name}{i}"
                if not _ip("netns", "add", ns):
                    raise OSError(f"ip netns add {ns} failed")
                net.names.append(ns)
                net._in(ns, "link", "set", "lo", "up")
            ends = [f"{net.name}a", f"{net.name}b"]
            net.links.append(ends[0])
            net._in(None, "link", "add", ends[0], "type", "veth", "peer", "name", ends[1])
            for ns, end in zip(net.names, ends):
                if ns:
                    net._in(None, "link", "set", end, "netns", ns)
                address = f"{net.net}.{len(net.addresses) + 1}"
                net._in(ns, "addr", "add", f"{address}/24", "dev", end)
                net._in(ns, "link", "set", end, "up")
                net.addresses.append(address)
        except BaseException:
            net.close()
            raise
        return net

    def _in(self, ns: str | None, *args: str) -> None:
        command = ("netns", "exec", ns, "ip", *args) if ns else args
        if not _ip(*command):
            raise OSError(f"ip {' '.join(command)} failed")

    def address(self, host: int) -> str:
        return self.addresses[host]

    def prefix(self, host: int) -> list[str]:
        """The argv prefix that runs a command on ``host`` (``ip netns exec`` execs it: the
        process keeps the pid it was started with)."""
        ns = self.names[host]
        return ["ip", "netns", "exec", ns] if ns else []

    def popen(self, host: int, argv: Sequence[str], **kwargs) -> subprocess.Popen:
        return subprocess.Popen([*self.prefix(host), *argv], **kwargs)

    def run(self, host: int, argv: Sequence[str], **kwargs) -> subprocess.CompletedProcess:
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        kwargs.setdefault("timeout", 60)
        return subprocess.run([*self.prefix(host), *argv], **kwargs)

    def pids(self) -> list[int]:
        """Every process in these namespaces (this machine's own excluded)."""
        found = []
        for ns in filter(None, self.names):
            out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
            found += [int(p) for p in out.stdout.split()]
        return found

    def still_running(self, timeout: float = 10) -> list[str]:
        """What still runs in these namespaces once ``timeout`` s have passed (``"PID cmdline"``),
        [] as soon as nothing does: a kernel's fork server ends just after the kernel does."""
        deadline = time.monotonic() + timeout
        while (left := self.pids()) and time.monotonic() < deadline:
            time.sleep(0.1)
        return [f"{pid} {_cmdline(pid)}" for pid in left]

    def listening(self, host: int) -> list[str]:
        """The addresses TCP sockets listen on in ``host`` (``*`` for every interface).
        psutil cannot tell: it reads this namespace's socket table, so ask ``ss`` there."""
        out = self.run(host, ["ss", "-ltnH"]).stdout
        return [line.split()[3].rsplit(":", 1)[0].strip("[]") for line in out.splitlines()]

    def close(self) -> None:
        """Kill what still runs in the namespaces, then remove links and namespaces."""
        deadline = time.monotonic() + 10
        while (left := self.pids()) and time.monotonic() < deadline:
            for pid in left:
                try:
                    os.kill(pid, 9)
                except ProcessLookupError:
                    pass
            time.sleep(0.1)
        for link in self.links:
            _ip("link", "del", link)  # in the root namespace only; the others go with theirs
        for ns in filter(None, self.names):
            _ip("netns", "del", ns)

    def left(self) -> list[str]:
        """This network's namespaces that still exist (none after :meth:`close`)."""
        out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        listed = {line.split()[0] for line in out.splitlines() if line.strip()}
        return sorted(ns for ns in self.names if ns in listed)

    def __enter__(self) -> Network:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "(gone)"
