"""Where ranks meet, and the environment rules every launcher gives its ranks.

Used by ``notebook_launcher`` and ``nbaccel launch`` alike, so both pick ports and set
``NBACCEL_*``/gloo variables the same way, and both listen only where ranks need it.

torch's TCPStore server listens on every interface of the machine whatever address it is
given (torch 2.13: ``*:port``), and any process that reaches the port can write keys into it.
So every rendezvous store nbaccel starts comes from :func:`serve_store`, from a socket bound to
:func:`listen_address` (loopback on one machine); torch's own ``init_process_group`` (env://,
tcp://) then shares that server, because it asks for a *multi-tenant* store on the same port.

>>> env = launcher_environment({"NBACCEL_STRATEGY": "ddp"}, "cli", "127.0.0.1", one_machine=True)
>>> env["NBACCEL_LAUNCHER"], env["GLOO_SOCKET_IFNAME"] in ("lo", "lo0")
('cli', True)
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket
from typing import Any

from nbaccel.core import hardware
from nbaccel.core.config import ENV_LAUNCHER

# The address rank 0's store listens on ("" = every interface), set by the launcher.
ENV_LISTEN_ADDR = "NBACCEL_LISTEN_ADDR"
STORE_TIMEOUT = datetime.timedelta(minutes=30)  # as torch's default process-group timeout
_hosted: list[Any] = []  # this rank's store: it lives as long as the process


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now."""
    with socket.socket(_family(host), socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def unusable_address(name: str, host: str, exc: OSError) -> str:
    """What to say when ``host`` (given as ``name``) cannot serve the rendezvous.

    >>> unusable_address("master_addr", "nohost", OSError(-2, "Name or service not known"))[:40]
    "master_addr='nohost' cannot be used for "
    """
    return (
        f"{name}={host!r} cannot be used for the rendezvous ({exc.strerror or exc}). On one "
        "machine leave the default '127.0.0.1'; across machines pass the address of machine 0 "
        "as the other machines reach it."
    )


def check_port(host: str, port: int) -> None:
    """Raise a ValueError that says what to do when ``port`` cannot be bound on ``host``."""
    with socket.socket(_family(host), socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError as exc:
            raise ValueError(
                f"port {port} on {host} is not available ({exc.strerror}); another launch or "
                "program uses it. Pass use_port='auto' to pick a free port."
            ) from None


def listen_address(master_addr: str, one_machine: bool = True) -> str:
    """Where the rendezvous listens: ``master_addr``'s own address when it is one of this
    machine's (loopback for a single-machine launch, the interface the other machines reach on
    several), else ``""``, every interface: machine 0 behind NAT knows no address of its own
    that the others use, and a machine name that ``/etc/hosts`` maps to loopback (Debian's
    127.0.1.1) is reached elsewhere by the other machines.

    >>> listen_address("127.0.0.1"), listen_address("localhost", one_machine=False)
    ('127.0.0.1', '127.0.0.1')
    """
    try:
        found = socket.getaddrinfo(master_addr, None, type=socket.SOCK_STREAM)
    except OSError:
        return ""
    # IPv4 first: "localhost" names both, and a client tries 127.0.0.1 first.
    for family, _, _, _, sockaddr in sorted(found, key=lambda f: f[0] != socket.AF_INET):
        address = str(sockaddr[0])
        if _is_loopback(address) and not one_machine and master_addr not in hardware.LOOPBACK_HOSTS:
            return ""
        with socket.socket(family, socket.SOCK_STREAM) as s:
            try:
                s.bind((address, 0))
            except OSError:
                continue
        return address
    return ""


def _is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address.split("%")[0]).is_loopback
    except ValueError:
        return False


def describe_listening(host: str, port: int) -> str:
    """How a banner says where the rendezvous listens.

    >>> describe_listening("127.0.0.1", 29500)
    '127.0.0.1:29500 (loopback only)'
    """
    if not host:
        return f"port {port} on every interface (machine 0 has no address of its own to bind)"
    if _is_loopback(host):
        return f"{host}:{port} (loopback only)"
    return f"{host}:{port} (only that interface)"


def serve_store(host: str, port: int, timeout: datetime.timedelta = STORE_TIMEOUT) -> Any:
    """Start a torch ``TCPStore`` server that listens on ``host`` only (``""``: every
    interface) and ``port`` (0: a free one, see ``.port``); multi-tenant, so torch's own stores
    on that port in this process share it (and count the ranks that join, this one counts none).
    Raises ``OSError`` when the address is taken."""
    import torch.distributed as dist

    options: dict[str, Any] = dict(
        is_master=True, timeout=timeout, wait_for_workers=False, multi_tenant=True
    )
    if not host:
        return dist.TCPStore("127.0.0.1", port, **options)
    sock = socket.socket(_family(host), socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart's TIME_WAIT
        sock.bind((host, port))
        sock.listen(socket.SOMAXCONN)
        port = sock.getsockname()[1]
        store = dist.TCPStore(host, port, master_listen_fd=sock.fileno(), **options)
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store owns the descriptor now
    return store


def host_rank_store() -> None:
    """In rank 0 of a notebook launch or ``%ranks`` session: start the store the ranks meet
    at, on the address the launcher allows, before the user's code creates the process group.
    Elsewhere (other ranks, one process, torch elastic's workers, plain torchrun) nothing."""
    env = os.environ
    host = env.get(ENV_LISTEN_ADDR)
    if (
        host is None
        or _hosted
        or env.get("RANK") != "0"
        or int(env.get("WORLD_SIZE", "1")) < 2
        or env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # the agent hosts it
    ):
        return
    port = int(env["MASTER_PORT"])
    try:
        _hosted.append(serve_store(host, port))
    except OSError as exc:
        raise RuntimeError(
            f"rank 0 cannot listen on {host or '*'}:{port} for the rendezvous "
            f"({exc.strerror or exc}): another program took the port after the launch picked "
            "it. Launch again (use_port='auto' picks a new port)."
        ) from None
    if not _is_loopback(host):
        print(f"nbaccel: the rendezvous listens on {describe_listening(host, port)}", flush=True)


def launcher_environment(
    settings: dict[str, str], launcher: str, master_addr: str, one_machine: bool
) -> dict[str, str]:
    """Variables every rank gets from its launcher (``"notebook"`` or ``"cli"``): the launch
    settings for ``Accelerator()``, who launched it, where rank 0's store listens, and gloo and
    NCCL kept on loopback on one machine (their own listeners bind to that interface)."""
    env = dict(settings)
    env[ENV_LAUNCHER] = launcher
    env[ENV_LISTEN_ADDR] = listen_address(master_addr, one_machine)
    if one_machine and master_addr in hardware.LOOPBACK_HOSTS:
        interface: str | None = hardware.loopback_interface()
    else:
        interface = route_interface(master_addr)
        if interface == hardware.loopback_interface() and not one_machine:
            interface = None  # a name mapped to loopback (127.0.1.1): the others reach it elsewhere
    if interface:
        for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            env[name] = os.environ.get(name, interface)
    return env


def route_address(master_addr: str) -> str | None:
    """This machine's own address on the route to ``master_addr`` (``None``: no route).

    >>> route_address("127.0.0.1")
    '127.0.0.1'
    """
    try:
        with socket.socket(_family(master_addr), socket.SOCK_DGRAM) as s:
            s.connect((master_addr, 9))  # UDP: picks the route, sends nothing
            return str(s.getsockname()[0])
    except OSError:
        return None


def route_interface(master_addr: str) -> str | None:
    """The network interface this machine reaches ``master_addr`` through (machine 0: the one
    that holds it), or ``None`` when there is no route or no address of it is this machine's.

    Across machines gloo otherwise takes the address the machine's *name* resolves to, which on
    Debian-like systems is loopback (127.0.1.1 in /etc/hosts): every other machine is then told
    to connect to 127.0.0.1 and the mesh fails with ``Connection refused``.

    >>> route_interface("127.0.0.1") in ("lo", "lo0")
    True
    """
    import psutil

    local = route_address(master_addr)
    if local is None:
        return None
    for name, addresses in psutil.net_if_addrs().items():
        if any(a.address.split("%")[0] == local for a in addresses):
            return name
    return None
