"""torchrun's flag names on ``nbaccel launch``: the same meaning under nbaccel's name.

A command line written for torchrun mostly runs as is: ``--nproc_per_node``, ``--nnodes``,
``--node_rank``, ``--master_addr``, ``--master_port``, ``--rdzv_endpoint``, ``--rdzv_backend``
and ``--max_restarts`` (with ``_`` or ``-``) set nbaccel's own settings, and ``--standalone``
is what ``nbaccel launch`` does anyway. A torchrun flag that nbaccel has no setting for is
refused in one line that says what ``nbaccel launch`` does instead.

>>> import argparse
>>> p = argparse.ArgumentParser()
>>> add_torchrun_flags(p)
>>> a = p.parse_args(["--nproc-per-node", "2", "--rdzv_endpoint", "10.0.0.1:29400"])
>>> a.num_processes, a.main_process_ip, a.main_process_port
(2, '10.0.0.1', 29400)
"""

from __future__ import annotations

import argparse
from typing import Any

# torchrun's name -> (nbaccel's dest, nbaccel's flag) for flags that mean the same thing.
SAME_MEANING = {
    "nproc_per_node": ("num_processes", "--num_processes"),
    "nnodes": ("num_machines", "--num_machines"),
    "node_rank": ("machine_rank", "--machine_rank"),
    "master_addr": ("main_process_ip", "--main_process_ip"),
    "master_port": ("main_process_port", "--main_process_port"),
}
# What nbaccel does instead of a count torchrun takes in words (auto, gpu) or as a range.
COUNT_INSTEAD = {
    "nproc_per_node": "without it nbaccel launch starts one process per GPU, one on CPU",
    "nnodes": "elastic MIN:MAX ranges are not supported",
}
# torchrun flags with no nbaccel setting: what nbaccel launch does instead.
INSTEAD = {
    "rdzv_id": "the launch names its rendezvous itself",
    "rdzv_conf": "the rendezvous needs no options (--main_process_ip/--main_process_port)",
    "monitor_interval": "the agent checks the ranks every 0.1 s",
    "log_dir": "output is relayed labelled per rank ([rankN]) instead of kept in files",
    "redirects": "output is relayed labelled per rank ([rankN])",
    "tee": "output is relayed labelled per rank ([rankN])",
    "role": "every rank runs the same script",
    "local_ranks_filter": "every rank's output is shown, labelled [rankN]",
    "start_method": "ranks are started as processes by torch elastic",
    "no_python": "SCRIPT is run by Python (pass -m for a module)",
    "run_path": "SCRIPT is run by path; pass -m for a module",
    "local_addr": "each machine uses its own address on the route to --main_process_ip",
    "logs_specs": "output is relayed labelled per rank ([rankN])",
}


def _refuse(parser: argparse.ArgumentParser, message: str) -> None:
    """One line and exit status 2, like nbaccel's other usage errors (no usage dump)."""
    parser.exit(2, f"{parser.prog}: error: {message}\n")


def _spellings(name: str) -> list[str]:
    return [f"--{name}", f"--{name.replace('_', '-')}"]


class _Count(argparse.Action):
    """An integer, as torchrun's flag gives it; ``auto``/``gpu`` or an elastic ``MIN:MAX``
    range is refused with what to give instead."""

    def __init__(self, *args: Any, nbaccel_flag: str, instead: str, **kwargs: Any) -> None:
        self.nbaccel_flag, self.instead = nbaccel_flag, instead
        super().__init__(*args, **kwargs)

    def __call__(self, parser: Any, namespace: Any, value: Any, option: Any = None) -> None:
        try:
            setattr(namespace, self.dest, int(value))
        except ValueError:
            _refuse(
                parser, f"{option} {value}: give a number ({self.nbaccel_flag} N); {self.instead}."
            )


class _Endpoint(argparse.Action):
    """``HOST:PORT`` (``[v6]:PORT``) into ``--main_process_ip`` and ``--main_process_port``."""

    def __call__(self, parser: Any, namespace: Any, value: Any, option: Any = None) -> None:
        host, _, port = str(value).rpartition(":")
        if not host or not port.isdigit():
            _refuse(
                parser,
                f"{option} {value}: give HOST:PORT, e.g. {option} 10.0.0.1:29500 (or "
                "--main_process_ip HOST --main_process_port PORT).",
            )
        namespace.main_process_ip = host.strip("[]")
        namespace.main_process_port = int(port)


class _Instead(argparse.Action):
    """A torchrun flag nbaccel has no setting for: one line saying what nbaccel does."""

    def __init__(self, *args: Any, instead: str, **kwargs: Any) -> None:
        self.instead = instead
        super().__init__(*args, **{**kwargs, "nargs": "?"})

    def __call__(self, parser: Any, namespace: Any, value: Any, option: Any = None) -> None:
        _refuse(
            parser, f"{option} is torchrun's; nbaccel launch has no such option: {self.instead}."
        )


def add_torchrun_flags(parser: argparse.ArgumentParser) -> None:
    """Add torchrun's names to ``nbaccel launch``'s ``parser``, hidden from ``--help`` (which
    says they work). ``--rdzv_backend`` and ``--max_restarts`` are nbaccel's own flags."""
    hidden = argparse.SUPPRESS
    for name, (dest, flag) in SAME_MEANING.items():
        kwargs: dict[str, Any] = {"dest": dest, "help": hidden}
        if name in COUNT_INSTEAD:
            kwargs.update(action=_Count, nbaccel_flag=flag, instead=COUNT_INSTEAD[name])
        elif name in ("node_rank", "master_port"):
            kwargs["type"] = int
        parser.add_argument(*_spellings(name), **kwargs)
    parser.add_argument(*_spellings("rdzv_endpoint"), action=_Endpoint, help=hidden)
    parser.add_argument(
        "--standalone", action="store_const", const=1, dest="num_machines", help=hidden
    )
    for name, instead in INSTEAD.items():
        parser.add_argument(*_spellings(name), action=_Instead, instead=instead, help=hidden)
