"""The options of a launch, declared once: :class:`LaunchOptions`.

Every entry point reads them from here: ``notebook_launcher`` (whose keywords are these fields,
checked field for field by a test), :func:`~nbaccel.launch.plan.resolve_plan` (which checks them
and reads each by name), :class:`~nbaccel.launch.handle.Launch` (view, progress, return_all),
``%ranks start`` (:class:`~nbaccel.persistent.session.Ranks`) and, for the settings a config file
also holds, :class:`~nbaccel.core.config.LaunchConfig`, whose Accelerate spellings
(``main_process_port`` for ``use_port``...) are listed in :data:`CONFIG_FILE_NAMES`.

>>> LaunchOptions(num_processes=2, mixed_precision="bf16").mixed_precision
'bf16'
>>> LaunchOptions.accepting_aliases(main_process_port=29500).use_port
29500
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from nbaccel.core.config import LaunchConfig

if TYPE_CHECKING:
    from nbaccel.launch.protocols import Cluster, View

UNSET: Any = object()  # "not given": the config (or its default) decides

# The options whose name in Accelerate's config file and `accelerate launch` differs from
# ``notebook_launcher``'s (Accelerate's own notebook_launcher spells them as here):
# LaunchConfig and the `nbaccel launch` flags keep Accelerate's spelling of the same setting.
CONFIG_FILE_NAMES = {
    "use_port": "main_process_port",
    "master_addr": "main_process_ip",
    "node_rank": "machine_rank",
    "num_nodes": "num_machines",
}
ALIASES = {config_name: option for option, config_name in CONFIG_FILE_NAMES.items()}


def _option(default: Any, doc: str) -> Any:
    return dataclasses.field(default=default, metadata={"doc": doc})


@dataclasses.dataclass(frozen=True)
class LaunchOptions:
    """How one launch runs: the keywords of ``notebook_launcher``, as one typed value.

    Fields left ``UNSET`` come from ``config``, else from the saved default config. Each
    field's documentation: ``LaunchOptions.doc("timeout")``.

    >>> LaunchOptions().use_port, LaunchOptions.doc("use_port").startswith("Port on machine 0")
    ('auto', True)
    """

    # -- Accelerate's notebook_launcher: its names, order and meanings -------------------------
    num_processes: int | None = _option(
        UNSET,
        "Ranks (processes) on this machine; None: one per visible GPU, else 1; not given: the "
        "config's.",
    )
    mixed_precision: str | None = _option(
        UNSET, "'no', 'fp16', 'bf16' or 'fp8'; not given: the config's."
    )
    use_port: int | str = _option(
        "auto", "Port on machine 0 where ranks meet; 'auto' picks a free one on one machine."
    )
    master_addr: str = _option("127.0.0.1", "Address of machine 0, where the ranks meet.")
    node_rank: int = _option(0, "Index of this machine (0 is the main one).")
    num_nodes: int = _option(1, "Machines taking part.")
    rdzv_backend: str = _option(
        "static",
        "How the ranks meet: 'static', or torch elastic's 'c10d' (in a notebook launch, on "
        "one machine only; across machines: nbaccel launch).",
    )
    rdzv_endpoint: str = _option("", "Elastic rendezvous only (nbaccel launch); ignored here.")
    rdzv_conf: dict[str, Any] | None = _option(None, "Elastic rendezvous only; ignored here.")
    rdzv_id: str = _option("none", "Elastic rendezvous only; ignored here.")
    max_restarts: int = _option(
        UNSET,
        "Relaunch every rank after a rank fails, that many times at most; not given: the config's.",
    )
    monitor_interval: float = _option(
        0.1, "Accepted for Accelerate; ranks are followed by events, so it changes nothing."
    )
    log_line_prefix_template: str | None = _option(
        None, "Label of the ranks' lines in text output, torch elastic's form: '[${rank}]: '."
    )
    # -- nbaccel's own -------------------------------------------------------------------------
    start_method: str = _option(
        "auto", "'auto' (a fork server), 'forkserver', 'spawn' or 'fork' (config's if 'auto')."
    )
    timeout: float | None = _option(
        None, "Seconds after which the launch stops with a TimeoutError showing each rank's stack."
    )
    return_all: bool = _option(False, "Return every rank's value as a list, not rank 0's.")
    config: LaunchConfig | None = _option(
        None, "A LaunchConfig for the settings not given here (default: the saved one)."
    )
    progress: bool | str = _option(
        True, "True (dashboard where widgets render, text elsewhere), 'text', or False."
    )
    preload: Sequence[str] = _option((), "Modules the fork server imports once for every rank.")
    env: dict[str, str | None] | None = _option(
        None, "Environment variables to add to the ranks' (None as a value removes one)."
    )
    view: View | None = _option(None, "A view to show the launch in (default: from progress).")
    block: bool = _option(True, "False returns a Launch at once and trains in the background.")
    cluster: Cluster | None = _option(
        None, "Where the ranks run instead of this machine, e.g. nbaccel.RayCluster()."
    )
    # -- not notebook_launcher keywords -----------------------------------------------------
    cpu: bool = _option(False, "CPU ranks (gloo) even where GPUs are visible (debug_launcher).")
    strategy: str | None = _option(
        None,
        "'ddp', 'fsdp', 'deepspeed' or another registered strategy, for the ranks' "
        "Accelerator; None: the config's.",
    )

    @classmethod
    def doc(cls, name: str) -> str:
        """The documentation of the field ``name``."""
        return str(next(f for f in dataclasses.fields(cls) if f.name == name).metadata["doc"])

    @classmethod
    def accepting_aliases(cls, **values: Any) -> LaunchOptions:
        """Options from keywords that may use Accelerate's config-file spellings
        (``main_process_port``, ``main_process_ip``, ``machine_rank``, ``num_machines``)."""
        named: dict[str, Any] = {}
        for key, value in values.items():
            name = ALIASES.get(key, key)
            if name in named:
                given = [k for k in values if ALIASES.get(k, k) == name]
                raise TypeError(f"{given[0]}= and {given[1]}= name the same option; pass one.")
            named[name] = value
        return cls(**named)

    def given(self, name: str) -> bool:
        """Whether the option ``name`` was given (not left to the config)."""
        return getattr(self, name) is not UNSET
