"""A toy cluster backend in one module, passed as ``cluster=`` (tests/test_extension_points.py):
nothing else in nbaccel, its tests or its docs was edited to add it.

Its "cluster" is this machine, its ranks processes it spawns itself with pipes it makes, in a
rank group of its own: the lifecycle (start, stop, reap) is ``RankGroupBase``'s, the rest the
few methods a backend supplies. The plan, the launch, the banner and the crash reports ask the
object what they need."""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing
import os
from typing import Any

from nbaccel.core.events import RankSpec
from nbaccel.launch.protocols import RankGroupBase
from nbaccel.rank.entry import run_rank


@dataclasses.dataclass
class ToyRank:
    """One spawned rank: a ``RankHandle``."""

    rank: int
    process: Any
    stdout: Any
    stderr: Any
    diag: Any
    events: Any
    ended: int | None = None

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def sentinel(self) -> int:
        return self.process.sentinel

    def exitcode(self) -> int | None:
        return self.ended if self.ended is not None else self.process.exitcode

    def reap(self) -> None:
        self.process.join()
        self.ended = self.process.exitcode

    def close_pipes(self) -> None:
        for end in (self.stdout, self.stderr, self.diag, self.events):
            end.close()


class ToyGroup(RankGroupBase):
    start_method = "spawn"

    def __init__(self, specs: list[RankSpec]) -> None:
        self.specs = specs
        self.ranks: list[ToyRank] = []
        self.strays: list[tuple[int, str]] = []
        self.stopped: set[int] = set()

    def _start_ranks(self) -> None:
        context = multiprocessing.get_context("spawn")
        for spec in self.specs:
            pipes = [context.Pipe(duplex=False) for _ in range(4)]
            process = context.Process(target=run_rank, args=(spec, *(w for _, w in pipes)))
            process.start()
            for _, writer in pipes:  # the rank holds them now: our closing lets EOF arrive
                writer.close()
            readers = [r for r, _ in pipes]
            for reader in readers[:3]:
                os.set_blocking(reader.fileno(), False)
            self.ranks.append(ToyRank(spec.rank, process, *readers))

    def alive(self) -> list[ToyRank]:
        return [r for r in self.ranks if r.exitcode() is None]

    def _signal_trees(self, sig: int) -> None:
        for r in self.alive():
            self.stopped.add(r.rank)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(r.pid, sig)  # a rank leads a session of its own once it runs
            self.send_signal([r], sig)

    def send_signal(self, ranks: list[ToyRank], sig: int) -> None:
        for r in ranks:
            with contextlib.suppress(ProcessLookupError):
                os.kill(r.pid, sig)

    def was_stopped(self, rank: int, exitcode: int | None = None) -> bool:
        return rank in self.stopped

    def reap(self) -> None:
        for r in self.ranks:
            if r.ended is None:
                r.reap()


class ToyCluster:
    start_method = "spawn"
    placement = "on a toy cluster"
    rank_entry_file = "/multiprocessing/spawn.py"  # a spawned rank's process starts there
    uses_gpus = False
    same_machine = True

    def __init__(self) -> None:
        self.groups: list[ToyGroup] = []

    def check_available(self) -> None:
        pass

    def make_group(self, specs: list[RankSpec]) -> ToyGroup:
        group = ToyGroup(specs)
        self.groups.append(group)
        return group
