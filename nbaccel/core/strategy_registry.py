"""The strategies a launch can name, by name: the one table that the config file, the
``nbaccel`` command line, the config panel, the capability checks, the ranks' settings report
and ``select_strategy`` read.

An entry names its implementation (``"module:Class"``, a
:class:`~nbaccel.training.strategies.base.Strategy` imported only in a rank) and what it needs;
nothing here imports torch. A new strategy is one module with its ``Strategy`` subclass and one
line: ``register(StrategyEntry("name", "package.module:Class"))``, in that module or another that
the kernel imports and the ranks import too (``preload=["package.module"]``). A variant of one is
a line too, with the options its class's constructor takes (Lightning Fabric's registry has the
same shape): DDP with 50 MiB buckets and gradients sent in bf16 is

>>> small = register(get("ddp").variant("ddp_bf16_hook", bucket_cap_mb=50, comm_hook="bf16"))
>>> small.implementation == get(DEFAULT).implementation, small.options
(True, {'bucket_cap_mb': 50, 'comm_hook': 'bf16'})
>>> unregister("ddp_bf16_hook")

An entry says which devices it runs on (``runs_on``) and which strategy stands in for it on
others (``instead_on``: DDP trains on XLA devices as XLA's data parallelism), and which of the
Accelerator's plugin arguments its constructor takes (``plugin``); callers ask the entry, never
compare names.

>>> DEFAULT in names() and get(DEFAULT).instead_on
{'xla': 'xla'}
>>> taking("fsdp_plugin")
'fsdp'
"""

from __future__ import annotations

import dataclasses
from typing import Any

DEFAULT = "ddp"  # the strategy a launch and an Accelerator use when none is named


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
    # The Accelerator's plugin argument its constructor takes after the process state
    # ("fsdp_plugin", "deepspeed_plugin"), if any: passing that plugin picks this strategy
    plugin: str | None = None
    # Keyword arguments for its class's constructor (a variant's bucket size, comm hook, ...)
    options: dict[str, Any] = dataclasses.field(default_factory=dict)
    runs_on: tuple[str, ...] = ("cpu", "cuda")  # the torch device types it runs on
    # device type -> the strategy that runs in its place there
    instead_on: dict[str, str] = dataclasses.field(default_factory=dict)

    def variant(self, name: str, **options: Any) -> StrategyEntry:
        """This strategy under another ``name``, its constructor given ``options`` too."""
        return dataclasses.replace(
            self, name=name, options={**self.options, **options}, accelerate_type=None
        )

    def for_device(self, device_type: str) -> StrategyEntry:
        """The entry that runs on ``device_type``: this one, or the one standing in for it;
        a ValueError naming the strategies that run there otherwise."""
        if device_type in self.runs_on:
            return self
        if device_type in self.instead_on:
            return get(self.instead_on[device_type])
        there = [e.name for e in _ENTRIES.values() if e.chosen and device_type in _devices(e)]
        raise ValueError(
            f"strategy={self.name!r} does not run on {device_type.upper()} devices; choose "
            f"{' or '.join(repr(n) for n in there) or 'another device'} there (or leave "
            "strategy unset)."
        )


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


def _devices(entry: StrategyEntry) -> tuple[str, ...]:
    return (*entry.runs_on, *entry.instead_on)


def taking(plugin: str, preferred: str | None = None) -> str:
    """The strategy whose constructor takes the Accelerator's ``plugin`` argument
    (``"fsdp_plugin"``): ``preferred`` when it does (a variant named in the config), else the
    first registered."""
    if preferred in _ENTRIES and _ENTRIES[preferred].plugin == plugin:
        return preferred
    name = next((e.name for e in _ENTRIES.values() if e.plugin == plugin), None)
    if name is None:
        raise ValueError(f"no registered strategy takes {plugin}=")
    return name


def by_accelerate_type(kind: str) -> str | None:
    """The strategy that Accelerate's ``DistributedType`` value ``kind`` means, if one does."""
    return next((e.name for e in _ENTRIES.values() if e.accelerate_type == kind), None)


DEEPSPEED_INSTALL = (
    "run `pip install deepspeed` (from nbaccel's clone: `pip install -e '.[deepspeed]'`)"
)

register(
    StrategyEntry(DEFAULT, "nbaccel.training.strategies.ddp:DDPStrategy", instead_on={"xla": "xla"})
)
register(
    StrategyEntry(
        "fsdp",
        "nbaccel.training.strategies.fsdp:FSDPStrategy",
        accelerate_type="FSDP",
        plugin="fsdp_plugin",
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
        plugin="deepspeed_plugin",
    )
)
register(
    StrategyEntry(
        "xla",
        "nbaccel.training.strategies.xla:XLAStrategy",
        accelerate_type="XLA",
        chosen=False,
        runs_on=("xla",),
    )
)
