"""A toy cluster backend: one module, passed as ``cluster=`` (tests/test_extension_points.py).

Its "cluster" is this machine, its ranks spawned processes: enough to see the plan, the launch,
the banner and the crash reports ask the object what they need."""

from __future__ import annotations

from nbaccel.core.events import RankSpec
from nbaccel.launch.group import RankGroup


class ToyCluster:
    start_method = "spawn"
    placement = "on a toy cluster"
    rank_entry_file = "/multiprocessing/spawn.py"  # a spawned rank's process starts there
    uses_gpus = False

    def __init__(self) -> None:
        self.groups: list[RankGroup] = []

    def check_available(self) -> None:
        pass

    def make_group(self, specs: list[RankSpec]) -> RankGroup:
        group = RankGroup(specs, "spawn")
        self.groups.append(group)
        return group
