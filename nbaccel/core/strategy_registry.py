"""The strategies a launch can name, by name: the one table that the config file, the
``nbaccel`` command line, the config panel, the capability checks, the ranks' settings report
and ``select_strategy`` read.

An entry names its implementation (``"module:Class"``, a
:class:`~nbaccel.training.strategies.base.Strategy` imported only in a rank) and what it needs;
nothing here imports torch. A new strategy is one module with its ``Strategy`` subclass and one
line: ``register(StrategyEntry("name", "package.module:Class"))``, in that module or another that
the kernel imports and the ranks import too (``preload=["package.module"]``).

>>> names()
('ddp', 'fsdp', 'deepspeed')
>>> get("fsdp").implementation
'nbaccel.training.strategies.fsdp:FSDPStrategy'
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class StrategyEntry:
    """One strategy as the launch side knows it."""

    name: str  # what config files, flags and strategy= say
    implementation: str  # "module:Class" of its Strategy, imported in the rank
    needs_package: str | None = None  # a package it imports (checked before any rank starts)
    install: str = ""  # how to install that package, said when it is missing
    # Mixed precisions it runs; None: every one this machine runs
    precisions: tuple[str, ...] | None = None
    # Accelerate's DistributedType value that means this strategy (for its Accelerator's report)
    accelerate_type: str | None = None
    chosen: bool = True  # offered as a choice (False: picked by the device, e.g. XLA's)
    # The Accelerator's plugin its constructor takes after the process state ("fsdp" for
    # FullyShardedDataParallelPlugin, "deepspeed" for DeepSpeedPlugin), if any
    plugin: str | None = None


_ENTRIES: dict[str, StrategyEntry] = {}


def register(entry: StrategyEntry) -> StrategyEntry:
    """Add ``entry`` (or replace the one of that name); returns it."""
    _ENTRIES[entry.name] = entry
    return entry


def unregister(name: str) -> None:
    """Remove the strategy called ``name`` (a test's toy, say); no error if there is none."""
    _ENTRIES.pop(name, None)


def names() -> tuple[str, ...]:
    """The strategies a launch can choose, in the order they were registered."""
    return tuple(name for name, entry in _ENTRIES.items() if entry.chosen)


def get(name: str) -> StrategyEntry:
    """The entry called ``name``; a ValueError that lists the choices for an unknown one."""
    entry = _ENTRIES.get(name)
    if entry is None:
        listed = ", ".join(repr(n) for n in names())
        raise ValueError(f"strategy={name!r} is not known; choose one of {listed}.")
    return entry


def by_accelerate_type(kind: str) -> str | None:
    """The strategy that Accelerate's ``DistributedType`` value ``kind`` means, if one does."""
    return next((e.name for e in _ENTRIES.values() if e.accelerate_type == kind), None)


DEEPSPEED_INSTALL = (
    "run `pip install deepspeed` (from nbaccel's clone: `pip install -e '.[deepspeed]'`)"
)

register(StrategyEntry("ddp", "nbaccel.training.strategies.ddp:DDPStrategy"))
register(
    StrategyEntry(
        "fsdp",
        "nbaccel.training.strategies.fsdp:FSDPStrategy",
        accelerate_type="FSDP",
        plugin="fsdp",
    )
)
register(
    StrategyEntry(
        "deepspeed",
        "nbaccel.training.strategies.deepspeed:DeepSpeedStrategy",
        needs_package="deepspeed",
        install=DEEPSPEED_INSTALL,
        precisions=("no", "bf16", "fp16"),
        accelerate_type="DEEPSPEED",
        plugin="deepspeed",
    )
)
register(
    StrategyEntry(
        "xla", "nbaccel.training.strategies.xla:XLAStrategy", accelerate_type="XLA", chosen=False
    )
)
