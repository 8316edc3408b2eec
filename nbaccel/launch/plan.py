"""Everything a launch decides before it starts a process: settings, checks, the serialized job.

:func:`resolve_plan` raises a clear error for any bad input (a non-callable, a bad count or
port, more processes than this machine can hold, a precision this machine cannot run, an argument that cannot be pickled, ``fork`` after
CUDA) and otherwise returns a :class:`LaunchPlan`: the launch's facts and one
:class:`~nbaccel.core.events.RankSpec` per local rank.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import multiprocessing
import os
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from nbaccel.core import (
    capabilities,
    hardware,
    kernel_settings,
    local_traceback,
    parallelism_settings,
    pickling,
    rendezvous,
    shared_tensors,
)
from nbaccel.core.config import ENV_LAUNCHER, LaunchConfig, check_int, third_party_env
from nbaccel.core.events import RankSpec
from nbaccel.forkserver.protocol import kernel_side
from nbaccel.forkserver.server import resolve_start_method
from nbaccel.launch import capacity, payload, xla
from nbaccel.launch.kernel_objects import kernel_containers_changed
from nbaccel.launch.options import UNSET, LaunchOptions
from nbaccel.launch.protocols import Cluster
from nbaccel.launch.state import DEFAULT_LINE_PREFIX, LaunchInfo

__all__ = ["UNSET", "LaunchOptions", "LaunchPlan", "check_start_method", "resolve_plan"]

DEFAULTS = LaunchOptions()  # notebook_launcher's defaults
# How many times torch elastic has restarted the workers; every rank of an attempt reads it
RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"


@dataclasses.dataclass(frozen=True)
class LaunchPlan:
    info: LaunchInfo
    specs: list[RankSpec]
    timeout: float | None
    xla_threads: bool = False  # XLA devices as threads of one host process (launch.xla)
    max_restarts: int = 0  # relaunches of the whole group after a rank fails
    preload: tuple[str, ...] = ()  # modules the fork server imports once for every rank
    # Where the ranks run when not here (its make_group starts them), e.g. cluster.RayCluster
    cluster: Cluster | None = None

    def attempt(self, restart: int) -> LaunchPlan:
        """The plan of the attempt after ``restart`` restarts (0: the first): each rank's
        environment says which it is, as torch elastic's workers' does, so a function can tell
        a restart from a first run (``TORCHELASTIC_RESTART_COUNT``, and
        ``TORCHELASTIC_MAX_RESTARTS``).

        >>> plan = resolve_plan(print, (), {}, LaunchOptions(num_processes=2, max_restarts=2))
        >>> [s.env["TORCHELASTIC_RESTART_COUNT"] for s in plan.attempt(1).specs]
        ['1', '1']
        >>> plan.attempt(1).specs[0].env["TORCHELASTIC_MAX_RESTARTS"]
        '2'
        """
        marks = {RESTART_COUNT: str(restart), "TORCHELASTIC_MAX_RESTARTS": str(self.max_restarts)}
        specs = [dataclasses.replace(s, env={**s.env, **marks}) for s in self.specs]
        return dataclasses.replace(self, specs=specs)


def resolve_plan(
    function: Callable[..., Any],
    args: Sequence[Any],
    kwargs: dict[str, Any],
    options: LaunchOptions = DEFAULTS,
) -> LaunchPlan:
    """Check the inputs and build the plan; nothing is started. ``options`` are
    ``notebook_launcher``'s keywords (one machine, settings from the config or its default by
    default); ``options.cpu`` runs on CPU processes (gloo) even where GPUs are visible
    (``debug_launcher``).

    >>> plan = resolve_plan(print, ("hi",), {}, LaunchOptions(num_processes=2, cpu=True))
    >>> plan.info.world_size, plan.info.backend, [s.rank for s in plan.specs]
    (2, 'gloo', [0, 1])
    """
    _refuse_nested_launch()
    if not callable(function):
        raise TypeError(
            f"function must be callable (the training function to run on every rank), "
            f"got {type(function).__name__}."
        )
    _refuse_generator_and_async(function)
    preload = _check_preload(options.preload)
    cfg = _resolve_config(options)
    nprocs = _resolve_num_processes(cfg.num_processes)
    if nprocs == 1 and options.num_nodes == 1 and options.cluster is None:
        _name_what_stays_in_the_worker(function)
    node_rank, num_nodes, cluster = options.node_rank, options.num_nodes, options.cluster
    check_int("node_rank", node_rank, 0)
    check_int("num_nodes", num_nodes, 1)
    if node_rank >= num_nodes:
        raise ValueError(f"node_rank={node_rank} must be below num_nodes={num_nodes}.")
    _check_elastic_options(
        options.rdzv_backend, num_nodes, options.monitor_interval, options.log_line_prefix_template
    )
    timeout = options.timeout
    if timeout is not None and (not isinstance(timeout, (int, float)) or timeout <= 0):
        raise ValueError(f"timeout must be a positive number of seconds or None, got {timeout!r}.")
    method = check_start_method(resolve_start_method(cfg.start_method))
    cpu, env = options.cpu, options.env
    if cluster is not None:
        _check_cluster(cluster, num_nodes)
        cpu = cpu or not cluster.uses_gpus
        method = cluster.start_method  # the cluster starts the ranks: no fork server here
    gpus = () if cpu else hardware.detect().gpus
    if cluster is None:  # this machine's capacity; a cluster's is its placement's to find
        capacity.check_process_count(nprocs, nprocs * num_nodes, on_cpu=not gpus)
    if cpu:
        env = {**(env or {}), "CUDA_VISIBLE_DEVICES": ""}  # the ranks' torch sees no GPU either
    capabilities.check_precision(cfg.mixed_precision, gpus)
    parallelism_settings.check_launch(cfg.to_dict(), nprocs * num_nodes, on_gpus=bool(gpus))
    capabilities.check_strategy(cfg.strategy, cfg.mixed_precision)  # e.g. deepspeed missing
    master_addr = options.master_addr
    port = _resolve_port(options.use_port, master_addr, node_rank, num_nodes)
    function_bytes, arg_bytes, kwarg_bytes, sealed = payload.serialize(function, args, kwargs)
    transfer: shared_tensors.Transfer | None = sealed
    if cluster is not None:
        payload.refuse_shared_memory(sealed)
        transfer = None  # results come back pickled too, not through this machine's /dev/shm

    info = LaunchInfo(
        world_size=nprocs * num_nodes,
        num_processes=nprocs,
        node_rank=node_rank,
        first_rank=node_rank * nprocs,
        device="cuda" if gpus else "cpu",
        backend="nccl" if gpus else "gloo",
        mixed_precision=cfg.mixed_precision,
        strategy=cfg.strategy,
        gradient_accumulation_steps=cfg.gradient_accumulation_steps,
        master_addr=master_addr,
        master_port=port,
        start_method=method,
        placement=cluster.placement if cluster is not None else "",
        parallelism=parallelism_settings.launch_description(cfg.to_dict()),
        line_prefix=(
            DEFAULT_LINE_PREFIX
            if options.log_line_prefix_template is None
            else options.log_line_prefix_template
        ),
    )
    base_env = _worker_env(info, cfg, env)
    sources = pickling.notebook_sources()
    rng_state = kernel_rng_state()
    settings = kernel_settings.capture(stays=kernel_side)
    specs = [
        RankSpec(
            rank=info.first_rank + local,
            local_rank=local,
            world_size=info.world_size,
            local_world_size=nprocs,
            node_rank=node_rank,
            env={**base_env, "RANK": str(info.first_rank + local), "LOCAL_RANK": str(local)},
            function=function_bytes,
            args=arg_bytes,
            kwargs=kwarg_bytes,
            sources=sources,
            send_result=options.return_all or info.first_rank + local == 0,
            sys_path=list(sys.path),
            cwd=_kernel_cwd(),
            rng_state=rng_state,
            settings=settings,
            transfer=transfer,
        )
        for local in range(nprocs)
    ]
    # -- XLA (PJRT_DEVICE set, or a TPU host): ranks as PJRT expects them (nbaccel.launch.xla)
    info, specs, xla_threads = xla.adapt_plan(info, specs)
    return LaunchPlan(info, specs, timeout, xla_threads, cfg.max_restarts, preload, cluster)


def _refuse_generator_and_async(function: Callable[..., Any]) -> None:
    """A rank calls ``function`` and sends back what it returns: a generator or coroutine
    function would only make the generator (or coroutine) there, run none of its body, and
    fail to send it back, after every rank started. Refuse it here, saying what to write.

    >>> def steps():
    ...     yield 1
    >>> _refuse_generator_and_async(steps)
    Traceback (most recent call last):
    TypeError: function steps is a generator function (it yields), ...
    """
    target = function
    while isinstance(target, functools.partial):  # its name is the wrapped function's
        target = target.func
    name = getattr(target, "__qualname__", None) or type(target).__name__
    if inspect.isasyncgenfunction(function):
        kind, fix = (
            "an async generator function (async def with yield)",
            "Make it a plain def that returns a list of what it yielded",
        )
    elif inspect.iscoroutinefunction(function):
        kind, fix = (
            "an async function (async def)",
            "Make it a plain def; to await inside it, wrap the awaiting part: "
            "def train(): return asyncio.run(main())",
        )
    elif inspect.isgeneratorfunction(function):
        kind, fix = (
            "a generator function (it yields)",
            "Return the values instead (e.g. collect them in a list and return it)",
        )
    else:
        return
    raise TypeError(
        f"function {name} is {kind}, so each rank would only create "
        f"{'a coroutine' if 'async' in kind else 'a generator'} and never run its body. "
        f"{fix}. Nothing was started."
    )


def _check_cluster(cluster: Cluster, num_nodes: int) -> None:
    """``cluster=`` is a cluster nbaccel can place ranks on, with what it needs installed."""
    if not isinstance(cluster, Cluster):  # the members launch.protocols.Cluster declares
        raise TypeError(
            f"cluster must be a cluster to run the ranks on, e.g. nbaccel.RayCluster(), "
            f"got {type(cluster).__name__}."
        )
    if num_nodes != 1:
        raise ValueError(
            f"cluster= places the ranks itself; leave num_nodes (got {num_nodes}) and node_rank "
            "out and pass the number of ranks as num_processes."
        )
    cluster.check_available()


def _check_preload(preload: Any) -> tuple[str, ...]:
    """``preload`` as module names, or a TypeError saying what it must be.

    >>> _check_preload(["transformers", "datasets"])
    ('transformers', 'datasets')
    """
    names = (preload,) if isinstance(preload, str) else preload
    try:
        names = tuple(names)
    except TypeError:
        names = None
    if names is None or not all(
        isinstance(n, str) and all(p.isidentifier() for p in n.split(".")) for n in names
    ):
        raise TypeError(
            f"preload must be a list of module names, e.g. preload=['transformers'], got "
            f"{preload!r}."
        )
    return names


def _check_elastic_options(
    rdzv_backend: Any, num_nodes: Any, monitor_interval: Any, line_prefix: Any
) -> None:
    """Accelerate's torch-elastic options, as far as a notebook launch has them. On one machine
    ``c10d`` is accepted as Accelerate accepts it: a fixed set of local ranks meets the same way
    either way, so the launch uses the static rendezvous."""
    one_machine_c10d = rdzv_backend == "c10d" and num_nodes == 1
    if rdzv_backend != "static" and not one_machine_c10d:
        across = " across machines" if rdzv_backend == "c10d" else ""
        raise ValueError(
            f"rdzv_backend={rdzv_backend!r}{across}: notebook launches meet at "
            "master_addr:use_port (a static rendezvous; 'c10d' is accepted on one machine). "
            "For an elastic rendezvous across machines run the same function as a script: "
            f"nbaccel launch --rdzv_backend {rdzv_backend} script.py (nbaccel export writes "
            "the script)."
        )
    if isinstance(monitor_interval, bool) or not isinstance(monitor_interval, (int, float)):
        raise TypeError(f"monitor_interval must be a number of seconds, got {monitor_interval!r}.")
    if monitor_interval <= 0:
        raise ValueError(f"monitor_interval must be positive, got {monitor_interval!r}.")
    if line_prefix is not None and not isinstance(line_prefix, str):
        raise TypeError(
            "log_line_prefix_template must be a string such as '[${rank}]: ', got "
            f"{type(line_prefix).__name__}."
        )


def _kernel_cwd() -> str | None:
    """The kernel's working directory; ``None`` when it was deleted (ranks keep the server's)."""
    try:
        return os.getcwd()
    except OSError:
        return None


def kernel_rng_state() -> dict[str, Any]:
    """The kernel's torch and numpy global RNG states, for ranks to start from (as a fork would).

    Only for libraries the kernel has imported; a rank seeds the others as a fresh process does.

    >>> sorted(kernel_rng_state()) in ([], ["numpy"], ["numpy", "torch", "torch_seed"])
    True
    """
    state: dict[str, Any] = {}
    torch = sys.modules.get("torch")
    if torch is not None and hasattr(torch, "get_rng_state"):
        state["torch"] = torch.get_rng_state().numpy().tobytes()
        state["torch_seed"] = torch.initial_seed()
    numpy = sys.modules.get("numpy")
    if numpy is not None and hasattr(numpy, "random"):
        state["numpy"] = numpy.random.get_state()
    return state


def check_start_method(method: str) -> str:
    """Refuse ``fork`` once this process holds a CUDA context, saying what to do instead."""
    if method == "fork" and hardware.cuda_initialized():
        raise RuntimeError(
            "start_method='fork' cannot be used after CUDA was initialised in this kernel "
            "(forked ranks would fail with 'Cannot re-initialize CUDA in forked subprocess'). "
            "Use the default start_method='auto' (a fork server), or restart the kernel."
        )
    return method


def _refuse_nested_launch() -> None:
    """A rank that launches would start ranks of ranks; say what to do instead."""
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        # A spawned rank runs the launching script's top level again while it starts.
        raise RuntimeError(
            "notebook_launcher() was called at the top level of a script that a starting rank "
            "runs again (start_method='spawn' does that; the default fork server does not). "
            "Put the call under `if __name__ == '__main__':`, or leave start_method='auto'."
        )
    if os.environ.get(ENV_LAUNCHER) or os.environ.get("TORCHELASTIC_RUN_ID"):
        rank = os.environ.get("RANK", "?")
        raise RuntimeError(
            f"notebook_launcher() was called inside rank {rank} of a running launch, which "
            "would start ranks of ranks. Call the training function directly here; in a script, "
            "guard the launcher call with `if __name__ == '__main__'` (nbaccel export writes "
            "such a guard)."
        )


def _resolve_config(options: LaunchOptions) -> LaunchConfig:
    """The config (given, else saved, else the defaults) with the options given over it."""
    config = options.config
    if config is not None and not isinstance(config, LaunchConfig):
        raise TypeError(f"config must be a nbaccel.LaunchConfig, got {type(config).__name__}.")
    base = config or LaunchConfig.load_default() or LaunchConfig()
    changes: dict[str, Any] = {}
    if options.given("num_processes"):
        changes["num_processes"] = options.num_processes
    if options.given("mixed_precision"):
        changes["mixed_precision"] = options.mixed_precision
    if options.start_method != "auto":
        changes["start_method"] = options.start_method
    if options.given("max_restarts"):
        changes["max_restarts"] = options.max_restarts
    if options.strategy is not None:
        changes["strategy"] = options.strategy
    return dataclasses.replace(base, **changes)  # LaunchConfig validates every field


def _resolve_num_processes(requested: int | None) -> int:
    if requested is not None:
        return requested
    gpus = hardware.detect().gpu_count
    if gpus:
        return gpus
    warnings.warn(
        "num_processes=None and no GPU is visible, so 1 process is started. For several CPU "
        "processes pass num_processes explicitly, e.g. notebook_launcher(fn, num_processes=2).",
        stacklevel=local_traceback.user_stacklevel(),
    )
    return 1


def _name_what_stays_in_the_worker(function: Callable[..., Any]) -> None:
    """One line where a one-process launch changes a notebook list or dict in place: under
    Accelerate that function runs in the kernel; here it runs in a worker, so the change stays
    there (Accelerate's own tutorial collects results this way)."""
    names = kernel_containers_changed(function)
    if names:
        shown = ", ".join(f"`{n}`" for n in names)
        warnings.warn(
            f"{getattr(function, '__name__', 'the function')} changes {shown} in place, but "
            "num_processes=1 runs it in a worker process (so the kernel never touches CUDA): "
            "those changes stay in the worker. Return the values instead; notebook_launcher "
            "returns what rank 0 returns.",
            stacklevel=local_traceback.user_stacklevel(),
        )


def _resolve_port(use_port: int | str, master_addr: str, node_rank: int, num_nodes: int) -> int:
    try:
        return _check_port(use_port, master_addr, node_rank, num_nodes)
    except OSError as exc:  # socket.gaierror: a name that does not resolve; or not this host's
        raise ValueError(rendezvous.unusable_address("master_addr", master_addr, exc)) from None


def _check_port(use_port: int | str, master_addr: str, node_rank: int, num_nodes: int) -> int:
    if use_port == "auto":
        if num_nodes > 1:
            raise ValueError(
                "use_port='auto' only works on one machine: every node must be given the same "
                "port. Pass use_port=<port> on all nodes."
            )
        return rendezvous.free_port(master_addr)
    try:
        port = int(use_port)
    except (TypeError, ValueError):
        raise ValueError(f"use_port must be 'auto' or a port number, got {use_port!r}.") from None
    if not 0 < port < 65536:
        raise ValueError(f"use_port={port} is not a valid port (1-65535).")
    if node_rank == 0:
        rendezvous.check_port(master_addr, port)
    return port


def _worker_env(
    info: LaunchInfo, cfg: LaunchConfig, extra: dict[str, str | None] | None
) -> dict[str, str]:
    """The kernel's environment now (the fork server's is older), plus the rendezvous."""
    env = dict(os.environ)
    if "matplotlib_inline" in env.get("MPLBACKEND", "") or "ipykernel" in env.get("MPLBACKEND", ""):
        # ipykernel points matplotlib at its inline backend; in a rank that would import
        # IPython and try to display into a kernel the rank is not part of.
        env["MPLBACKEND"] = "Agg"
    for key, value in (extra or {}).items():
        if value is None:
            env.pop(key, None)  # env={"X": None} removes X, as subprocess users expect
        else:
            env[key] = str(value)
    one_machine = info.world_size == info.num_processes
    for key, value in third_party_env(info.device, info.mixed_precision).items():
        env.setdefault(key, value)  # the user's own setting (env= or the kernel's) wins
    env.update(
        rendezvous.launcher_environment(cfg.worker_env(), "notebook", info.master_addr, one_machine)
    )
    env.update(
        WORLD_SIZE=str(info.world_size),
        LOCAL_WORLD_SIZE=str(info.num_processes),
        GROUP_RANK=str(info.node_rank),
        NODE_RANK=str(info.node_rank),
        MASTER_ADDR=info.master_addr,
        MASTER_PORT=str(info.master_port),
    )
    return env
