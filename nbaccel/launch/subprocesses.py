"""Ranks as plain subprocesses of the kernel, on this machine: a rank group shipped beside the
fork server's, as a cluster backend (``notebook_launcher(..., cluster=Subprocesses())``).

Each rank is ``python -m nbaccel.rank.subprocess_entry`` (a fresh interpreter: nothing of the
kernel's imports, as ``start_method="spawn"`` but without multiprocessing), given its spec and
its four pipes' write ends through a pipe; its exit is watched through a pidfd (Linux 5.3+).
Start, stop and reap are :class:`~nbaccel.launch.protocols.RankGroupBase`'s.

>>> Subprocesses().same_machine, Subprocesses().start_method
(True, 'subprocess')
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing.connection
import os
import pickle
import subprocess
import sys
from typing import Any

import psutil

from nbaccel.core import process_table
from nbaccel.core.events import RankSpec
from nbaccel.launch.protocols import RankGroupBase


@dataclasses.dataclass
class SubprocessRank:
    """One rank subprocess and the kernel's (reading) ends of its pipes: a ``RankHandle``."""

    rank: int
    process: subprocess.Popen[bytes]
    stdout: Any
    stderr: Any
    diag: Any
    events: Any
    pidfd: int

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def sentinel(self) -> int:
        return self.pidfd  # readable once the process has ended

    def exitcode(self) -> int | None:
        return self.process.poll()

    def reap(self) -> None:
        self.process.wait()
        if self.pidfd >= 0:
            os.close(self.pidfd)
            self.pidfd = -1

    def close_pipes(self) -> None:
        for end in (self.stdout, self.stderr, self.diag, self.events):
            end.close()


class SubprocessGroup(RankGroupBase):
    """The ranks of one launch attempt, each a subprocess of the kernel."""

    start_method = "subprocess"

    def __init__(self, specs: list[RankSpec]) -> None:
        self.specs = specs
        self.ranks: list[SubprocessRank] = []
        self.strays: list[tuple[int, str]] = []
        self._stop_signals: dict[int, set[int]] = {}

    def _start_ranks(self) -> None:
        for spec in self.specs:
            self.ranks.append(self._start_one(spec))

    def _start_one(self, spec: RankSpec) -> SubprocessRank:
        pipes = [multiprocessing.Pipe(duplex=False) for _ in range(4)]
        writers = [w for _, w in pipes]
        spec_read, spec_write = os.pipe()
        ends = [w.fileno() for w in writers]
        try:
            process = subprocess.Popen(
                [sys.executable, "-m", "nbaccel.rank.subprocess_entry", str(spec_read)],
                pass_fds=(spec_read, *ends),
                stdin=subprocess.DEVNULL,
            )
            with os.fdopen(spec_write, "wb") as sink:  # a spec fits the pipe: it never blocks
                pickle.dump((spec, ends), sink)
        finally:
            os.close(spec_read)
            for w in writers:  # the rank holds them now: our closing lets EOF arrive
                w.close()
        readers = [r for r, _ in pipes]
        for reader in readers[:3]:
            os.set_blocking(reader.fileno(), False)
        out, err, diag, events = readers
        return SubprocessRank(
            spec.rank, process, out, err, diag, events, os.pidfd_open(process.pid)
        )

    def alive(self) -> list[SubprocessRank]:
        return [r for r in self.ranks if r.exitcode() is None]

    def was_stopped(self, rank: int, exitcode: int | None = None) -> bool:
        sent = self._stop_signals.get(rank, set())
        return bool(sent) and (exitcode is None or exitcode >= 0 or -exitcode in sent)

    def send_signal(self, ranks: list[SubprocessRank], sig: int) -> None:
        for r in ranks:
            with contextlib.suppress(ProcessLookupError):
                r.process.send_signal(sig)

    def _signal_trees(self, sig: int) -> None:
        for r in self.alive():
            try:
                children = psutil.Process(r.pid).children(recursive=True)
            except psutil.Error:
                children = []
            self._stop_signals.setdefault(r.rank, set()).add(sig)
            self.send_signal([r], sig)
            process_table.signal_all(children, sig)

    def reap(self) -> None:
        for r in self.ranks:
            r.reap()


class Subprocesses:
    """A cluster backend whose "cluster" is this machine and whose ranks are subprocesses."""

    start_method = "subprocess"
    placement = ""  # this machine: the banner names the start method and the address
    rank_entry_file = "/nbaccel/rank/subprocess_entry.py"
    uses_gpus = False
    same_machine = True

    def check_available(self) -> None:
        """Refuse where the kernel cannot watch a subprocess's exit (no pidfd: not Linux 5.3+)."""
        if not hasattr(os, "pidfd_open"):
            raise RuntimeError("Subprocesses() needs os.pidfd_open (Linux 5.3 or later).")

    def make_group(self, specs: list[RankSpec]) -> SubprocessGroup:
        return SubprocessGroup(specs)
