"""``notebook_launcher``: run a function on N ranks from a notebook cell (or a script).

Validation happens before anything starts, so bad input never leaves a half-started launch.
Then the function and its arguments are cloudpickled, the ranks are started (from the fork
server by default), and :class:`~nbaccel.relay.Relay` follows them to the end.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from nbaccel import _pickling, hardware
from nbaccel._worker import RankSpec
from nbaccel.config import ENV_LAUNCHER, ConfigError, LaunchConfig, check_int
from nbaccel.launch_state import LaunchInfo, LaunchState, RankState
from nbaccel.processes import RankGroup, ensure_server, resolve_start_method
from nbaccel.relay import Relay, load_payload
from nbaccel.ui import View, choose_view

_UNSET: Any = object()


def notebook_launcher(
    function: Callable[..., Any],
    args: Sequence[Any] = (),
    num_processes: int | None = _UNSET,
    mixed_precision: str | None = _UNSET,
    use_port: int | str = "auto",
    master_addr: str = "127.0.0.1",
    node_rank: int = 0,
    num_nodes: int = 1,
    start_method: str = "auto",
    timeout: float | None = None,
    *,
    kwargs: dict[str, Any] | None = None,
    return_all: bool = False,
    config: LaunchConfig | None = None,
    progress: bool | str = True,
    preload: Sequence[str] = (),
    env: dict[str, str] | None = None,
    view: View | None = None,
) -> Any:
    """Run ``function(*args)`` on ``num_processes`` ranks and return rank 0's return value.

    Parameters shared with Hugging Face Accelerate's ``notebook_launcher`` keep its names and
    meanings. ``num_processes=None`` means every visible GPU, else 1. Settings not given here
    come from ``config``, else from the saved default config (``nbaccel.configure()``/
    ``nbaccel config``). ``return_all=True`` returns every rank's value as a list. ``timeout``
    (seconds) stops a launch that runs too long with a ``TimeoutError`` that shows where each
    rank was. ``progress``: True (dashboard where widgets render, text elsewhere), "text", or
    False. ``preload`` names modules the fork server imports once so ranks start with them.

    Example::

        def train(lr):
            acc = nbaccel.Accelerator()
            acc.print(f"{acc.num_processes} ranks, lr={lr}")
            return acc.process_index

        nbaccel.notebook_launcher(train, args=(0.1,), num_processes=2)   # -> 0
    """
    _refuse_nested_launch()
    if not callable(function):
        raise TypeError(
            f"function must be callable (the training function to run on every rank), "
            f"got {type(function).__name__}."
        )
    cfg = _resolve_config(config, num_processes, mixed_precision, start_method)
    nprocs = _resolve_num_processes(cfg.num_processes)
    check_int("node_rank", node_rank, 0)
    check_int("num_nodes", num_nodes, 1)
    if node_rank >= num_nodes:
        raise ValueError(f"node_rank={node_rank} must be below num_nodes={num_nodes}.")
    if timeout is not None and (not isinstance(timeout, (int, float)) or timeout <= 0):
        raise ValueError(f"timeout must be a positive number of seconds or None, got {timeout!r}.")
    method = resolve_start_method(cfg.start_method)
    if method == "fork" and hardware.cuda_initialized():
        raise RuntimeError(
            "start_method='fork' cannot be used after CUDA was initialised in this kernel "
            "(forked ranks would fail with 'Cannot re-initialize CUDA in forked subprocess'). "
            "Use the default start_method='auto' (a fork server), or restart the kernel."
        )
    gpus = hardware.detect().gpu_count
    _check_precision(cfg.mixed_precision, gpus)
    port = _resolve_port(use_port, master_addr, node_rank, num_nodes)

    function_bytes, arg_bytes, kwarg_bytes = _serialize(function, args, kwargs or {})
    sources = _pickling.notebook_sources()

    world_size = nprocs * num_nodes
    device = "cuda" if gpus else "cpu"
    info = LaunchInfo(
        world_size=world_size,
        num_processes=nprocs,
        node_rank=node_rank,
        first_rank=node_rank * nprocs,
        device=device,
        backend="nccl" if gpus else "gloo",
        mixed_precision=cfg.mixed_precision,
        strategy=cfg.strategy,
        gradient_accumulation_steps=cfg.gradient_accumulation_steps,
        master_addr=master_addr,
        master_port=port,
        start_method=method,
    )
    base_env = _worker_env(info, cfg, env)
    specs = [
        RankSpec(
            rank=info.first_rank + local,
            local_rank=local,
            world_size=world_size,
            local_world_size=nprocs,
            node_rank=node_rank,
            env={**base_env, "RANK": str(info.first_rank + local), "LOCAL_RANK": str(local)},
            function=function_bytes,
            args=arg_bytes,
            kwargs=kwarg_bytes,
            sources=sources,
            send_result=return_all or info.first_rank + local == 0,
        )
        for local in range(nprocs)
    ]

    if method == "forkserver":
        ensure_server(tuple(preload))
    state = LaunchState(info, {s.rank: RankState(s.rank) for s in specs})
    group = RankGroup(specs, method)
    chosen_view = view if view is not None else choose_view(progress)
    group.start()
    try:
        payloads = Relay(group, state, chosen_view, timeout).run()
    except KeyboardInterrupt:
        # Every rank is stopped and reaped by now; the relay's frames would only be noise.
        raise KeyboardInterrupt(f"launch interrupted; all {nprocs} ranks were stopped") from None
    if return_all:
        return [load_payload(s.rank, payloads.get(s.rank)) for s in specs]
    return load_payload(0, payloads.get(0)) if node_rank == 0 else None


# -- validation -----------------------------------------------------------------------------


def _refuse_nested_launch() -> None:
    """A rank that launches would start ranks of ranks; say what to do instead."""
    if os.environ.get(ENV_LAUNCHER) or os.environ.get("TORCHELASTIC_RUN_ID"):
        rank = os.environ.get("RANK", "?")
        raise RuntimeError(
            f"notebook_launcher() was called inside rank {rank} of a running launch, which "
            "would start ranks of ranks. Call the training function directly here; in a script, "
            "guard the launcher call with `if __name__ == '__main__'` (nbaccel export writes "
            "such a guard)."
        )


def _resolve_config(
    config: LaunchConfig | None, num_processes: Any, mixed_precision: Any, start_method: str
) -> LaunchConfig:
    if config is not None and not isinstance(config, LaunchConfig):
        raise TypeError(f"config must be a nbaccel.LaunchConfig, got {type(config).__name__}.")
    base = config or LaunchConfig.load_default() or LaunchConfig()
    changes: dict[str, Any] = {}
    if num_processes is not _UNSET:
        changes["num_processes"] = num_processes
    if mixed_precision is not _UNSET:
        changes["mixed_precision"] = mixed_precision
    if start_method != "auto":
        changes["start_method"] = start_method
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
        stacklevel=3,
    )
    return 1


def _check_precision(mixed_precision: str, gpus: int) -> None:
    """Refuse, before starting anything, precisions this machine cannot run."""
    if mixed_precision == "fp8" and not gpus:
        raise ConfigError(
            "mixed_precision='fp8' needs a CUDA GPU with compute capability 8.9 or newer "
            "(Ada, Hopper) and none is visible; use 'bf16' on CPU."
        )
    if gpus:
        hw = hardware.detect()
        if mixed_precision == "bf16" and not all(g.supports_bf16 for g in hw.gpus):
            raise ConfigError(
                "mixed_precision='bf16' needs GPUs of compute capability 8.0 or newer "
                f"({hw.describe()}); use 'fp16' instead."
            )
        if mixed_precision == "fp8" and not all(g.supports_fp8 for g in hw.gpus):
            raise ConfigError(
                "mixed_precision='fp8' needs GPUs of compute capability 8.9 or newer "
                f"({hw.describe()}); use 'bf16' or 'fp16' instead."
            )


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _resolve_port(use_port: int | str, master_addr: str, node_rank: int, num_nodes: int) -> int:
    if use_port == "auto":
        if num_nodes > 1:
            raise ValueError(
                "use_port='auto' only works on one machine: every node must be given the same "
                "port. Pass use_port=<port> on all nodes."
            )
        return free_port(master_addr)
    try:
        port = int(use_port)
    except (TypeError, ValueError):
        raise ValueError(f"use_port must be 'auto' or a port number, got {use_port!r}.") from None
    if not 0 < port < 65536:
        raise ValueError(f"use_port={port} is not a valid port (1-65535).")
    if node_rank == 0:
        family = socket.AF_INET6 if ":" in master_addr else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as s:
            try:
                s.bind((master_addr, port))
            except OSError as exc:
                raise ValueError(
                    f"port {port} on {master_addr} is not available ({exc.strerror}); "
                    "another launch or program uses it. Pass use_port='auto' to pick a free port."
                ) from None
    return port


def _serialize(
    function: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]
) -> tuple[bytes, list[bytes], dict[str, bytes]]:
    """Cloudpickle the function and each argument on its own, so an error names the culprit."""
    if isinstance(args, (str, bytes)) or not isinstance(args, Sequence):
        raise TypeError(f"args must be a tuple or list of arguments, got {type(args).__name__}.")
    name = getattr(function, "__qualname__", repr(function))
    try:
        function_bytes = _pickling.dumps(function)
    except Exception as exc:
        raise TypeError(
            f"the function {name} cannot be sent to the ranks: {type(exc).__name__}: {exc}. "
            "Something it refers to (a global, a closure variable) cannot be pickled; create "
            "that object inside the function instead."
        ) from exc

    def dump(value: Any, label: str) -> bytes:
        try:
            return _pickling.dumps(value)
        except Exception as exc:
            raise TypeError(
                f"{label} ({type(value).__name__}) cannot be sent to the ranks: "
                f"{type(exc).__name__}: {exc}. Pass something picklable (e.g. a path or the "
                "parameters to build it) and create the object inside the function."
            ) from exc

    arg_bytes = [dump(a, f"args[{i}]") for i, a in enumerate(args)]
    kwarg_bytes = {k: dump(v, f"kwargs[{k!r}]") for k, v in kwargs.items()}
    return function_bytes, arg_bytes, kwarg_bytes


def _worker_env(
    info: LaunchInfo, cfg: LaunchConfig, extra: dict[str, str] | None
) -> dict[str, str]:
    """The kernel's environment now (the fork server's is older), plus the rendezvous."""
    env = dict(os.environ)
    if "matplotlib_inline" in env.get("MPLBACKEND", "") or "ipykernel" in env.get("MPLBACKEND", ""):
        # ipykernel points matplotlib at its inline backend; in a rank that would import
        # IPython and try to display into a kernel the rank is not part of.
        env["MPLBACKEND"] = "Agg"
    env.update({k: str(v) for k, v in (extra or {}).items()})
    env.update(cfg.worker_env())
    env.update(
        WORLD_SIZE=str(info.world_size),
        LOCAL_WORLD_SIZE=str(info.num_processes),
        GROUP_RANK=str(info.node_rank),
        NODE_RANK=str(info.node_rank),
        MASTER_ADDR=info.master_addr,
        MASTER_PORT=str(info.master_port),
    )
    env[ENV_LAUNCHER] = "notebook"
    if info.world_size == info.num_processes and info.master_addr in hardware.LOOPBACK_HOSTS:
        # One machine: keep gloo's sockets on the loopback interface.
        env.setdefault("GLOO_SOCKET_IFNAME", hardware.loopback_interface())
    return env
