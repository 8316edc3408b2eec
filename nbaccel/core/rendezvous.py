"""Where ranks meet, and the environment rules every launcher gives its ranks.

Used by ``notebook_launcher`` and ``nbaccel launch`` alike, so both pick ports and set
``NBACCEL_*``/gloo variables the same way.

>>> env = launcher_environment({"NBACCEL_STRATEGY": "ddp"}, "cli", "127.0.0.1", one_machine=True)
>>> env["NBACCEL_LAUNCHER"], env["GLOO_SOCKET_IFNAME"] in ("lo", "lo0")
('cli', True)
"""

from __future__ import annotations

import os
import socket

from nbaccel.core import hardware
from nbaccel.core.config import ENV_LAUNCHER


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


def launcher_environment(
    settings: dict[str, str], launcher: str, master_addr: str, one_machine: bool
) -> dict[str, str]:
    """Variables every rank gets from its launcher (``"notebook"`` or ``"cli"``): the launch
    settings for ``Accelerator()``, who launched it, and gloo kept on loopback on one machine."""
    env = dict(settings)
    env[ENV_LAUNCHER] = launcher
    if one_machine and master_addr in hardware.LOOPBACK_HOSTS:
        env["GLOO_SOCKET_IFNAME"] = os.environ.get(
            "GLOO_SOCKET_IFNAME", hardware.loopback_interface()
        )
    return env
