"""The kernel<->rank contract: what a rank is given, the messages it sends back, the channel.

Events flow one way, worker -> kernel, each pickled on its own over a pipe that belongs to one
rank. Output does not travel here: stdout/stderr go through their own per-rank pipes at the file
descriptor level, so C libraries' writes and crashes are caught too.

Worker code never imports this directly; ``nbaccel.progress``/``nbaccel.log`` call
:func:`emit`, which is a no-op outside a launch.
"""

from __future__ import annotations

import dataclasses
import pickle
import select
import signal
import threading
from typing import Any

# The kernel sends this signal to a rank to have every thread's Python stack written to the
# rank's diagnostic pipe (faulthandler, so it works while the rank is stuck in C code). A
# real-time signal no scheduler or library claims: SIGUSR1/SIGUSR2 are SLURM's `--signal`
# warnings and Lightning's or submitit's requeue handlers, which a rank must keep as theirs.
# Without real-time signals (macOS) it is SIGUSR1, the only free one there.
STACK_DUMP_SIGNAL = signal.SIGRTMIN + 6 if hasattr(signal, "SIGRTMIN") else signal.SIGUSR1


@dataclasses.dataclass
class RankSpec:
    """Everything a rank needs to know about itself; plain data, cheap to pickle."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    env: dict[str, str]
    function: bytes
    args: list[bytes]
    kwargs: dict[str, bytes]
    send_result: bool
    sources: dict[str, tuple] = dataclasses.field(default_factory=dict)
    # The kernel's view of the world at the launch (a rank is its twin): ``sys.path`` exactly
    # as the kernel has it ('' included), its working directory, and the global RNG states a
    # fork of the kernel would inherit ({"torch": bytes, "torch_seed": int, "numpy": tuple}).
    # ``None``/empty: leave what the process already has.
    sys_path: list[str] | None = None
    cwd: str | None = None
    rng_state: dict[str, Any] = dataclasses.field(default_factory=dict)
    # The kernel's warnings filters, logger levels and progress-bar switches
    # (``core.kernel_settings.capture``); empty: leave the process's own.
    settings: dict[str, Any] = dataclasses.field(default_factory=dict)
    # Large tensors/arrays of the arguments (one shared block) and the launch token that names
    # result files: a ``shared_tensors.Transfer``, or ``None`` (everything pickled above).
    transfer: Any = None


@dataclasses.dataclass
class Started:
    rank: int
    pid: int


@dataclasses.dataclass
class Progress:
    rank: int
    bar_id: int
    n: int
    total: int | None
    desc: str | None
    elapsed: float
    closed: bool = False
    unit_scale: float | None = None  # samples per step, where the caller knows it


@dataclasses.dataclass
class Metrics:
    rank: int
    step: int | None
    values: dict[str, float]


@dataclasses.dataclass
class Result:
    rank: int
    payload: bytes | None  # cloudpickled return value; None when the kernel did not ask for it
    exit_code: int | None = None  # set when the function ended by ``sys.exit(0)``, not return


@dataclasses.dataclass
class Leftovers:
    """Processes the rank started that were still running when its function ended; the rank
    stops them right after sending this (``processes``: (pid, command line) pairs)."""

    rank: int
    processes: list[tuple[int, str]]


@dataclasses.dataclass
class Failure:
    rank: int
    exc_type: str  # qualified name, e.g. "builtins.ValueError"
    message: str
    traceback: str  # formatted, user frames only
    exception: bytes | None  # the pickled exception, when it pickles
    copy_follows: bool = False  # a FailureCopy comes after it (NBACCEL_POST_MORTEM is on)


@dataclasses.dataclass
class FailureCopy:
    """The user's frames and their locals when the rank failed, for a post-mortem in the
    kernel (``core.snapshot``). Sent after its :class:`Failure`, so the failure is reported
    however long its copy takes (the copy has a time budget of its own)."""

    rank: int
    frames: bytes


@dataclasses.dataclass
class RankSettings:
    """What a rank's Accelerator actually runs, which may differ from the launch's settings
    (``Accelerator(mixed_precision="bf16")`` in the function overrides the launch's "no")."""

    rank: int
    mixed_precision: str
    strategy: str
    device: str
    gradient_accumulation_steps: int
    # N-D parallelism: the mesh ("dp_shard 2 × tp 2") and this rank's place ("dp_shard 1, tp 0")
    parallelism: str = ""
    coordinates: str = ""


@dataclasses.dataclass
class Compiling:
    """``torch.compile`` started (``active``) or finished compiling in the rank: a long first
    step that is no stall."""

    rank: int
    active: bool


@dataclasses.dataclass
class Paused:
    """The rank waits for a person: its ``breakpoint()`` or ``input()`` asks the kernel for
    lines (``rank.debugger``). The rank listens at ``address``, a Unix socket opened for this
    pause only; the kernel connects with ``authkey`` and relays the conversation
    (``launch.debugging``). ``reason`` ("breakpoint()", "input()") and where the rank stopped
    are for the views."""

    rank: int
    reason: str
    file: str
    line: int
    function: str
    address: str
    authkey: bytes


Event = (
    Started
    | Progress
    | Metrics
    | Result
    | Failure
    | FailureCopy
    | Leftovers
    | RankSettings
    | Compiling
    | Paused
)


class _Channel:
    """The sending end of one rank's event pipe; thread-safe, used only inside a rank."""

    def __init__(self, connection: Any, rank: int) -> None:
        self._conn = connection
        self._lock = threading.Lock()
        self.rank = rank

    def send(self, event: Event) -> None:
        data = pickle.dumps(event, protocol=pickle.HIGHEST_PROTOCOL)
        with self._lock:
            self._conn.send_bytes(data)

    def has_room(self) -> bool:
        """Whether a small event can be written now without waiting for the kernel to read.

        A pipe polls writable while at least PIPE_BUF (4 KiB) bytes are free; progress and
        metric events are smaller than that.
        """
        try:
            return bool(select.select([], [self._conn.fileno()], [], 0)[1])
        except (OSError, ValueError):
            return True  # let send() find out and report it


_channel: _Channel | None = None


def install_channel(connection: Any, rank: int) -> None:
    global _channel
    _channel = _Channel(connection, rank)


def current_rank() -> int | None:
    """The rank this process runs as under a notebook launch, else ``None``."""
    return _channel.rank if _channel is not None else None


def emit(event: Event, block: bool = True) -> bool:
    """Send ``event`` to the kernel if this process is a launched rank; report whether it was sent.

    With ``block=False`` an event that would have to wait for the kernel (pipe full) is not sent.
    """
    channel = _channel
    if channel is None:
        return False
    if not block and not channel.has_room():
        return False
    try:
        channel.send(event)
    except (BrokenPipeError, OSError):
        return False  # the kernel has gone; the rank is about to be stopped anyway
    return True
