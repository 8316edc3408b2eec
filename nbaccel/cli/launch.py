"""``nbaccel launch``: run a script on N processes through torch.distributed.run.

Settings come from the config file and the flags (flags win); they become arguments of
torch.distributed.run's own parser and its ``run()`` is called in this process, so elastic's
agent, rendezvous and restarts are torchrun's, not a copy. What nbaccel adds around it:

* every rank runs ``nbaccel.rank.script_entry SCRIPT ARGS`` which records a failing rank's exception
  in torch elastic's error file;
* output is labelled ``[rankN] text`` like notebook launches (torch's tee + line prefix);
* a failure ends with the notebook's summary (:class:`~nbaccel.core.errors.RankFailedError`: the rank,
  its exception and traceback) instead of torchrun's ChildFailedError dump, and exit status 1;
* nothing outlives the launch (Linux): each rank runs below a guard (:mod:`nbaccel.rank.script_guard`)
  that stops what the script started, also when this process is SIGKILLed, and this process is
  a child subreaper for what a SIGKILLed guard leaves;
* a free port is picked for single-machine launches, OMP_NUM_THREADS is shared out between the
  ranks, and NBACCEL_* variables carry precision, strategy and accumulation to ``Accelerator()``;
* the static rendezvous (also for ``--rdzv_backend c10d`` on one machine) listens only on the
  address ranks meet at (loopback on one machine) and gives each restart a fresh store
  (:mod:`nbaccel.cli.elastic_rendezvous`).

Example::

    $ nbaccel launch --num_processes 2 --mixed_precision bf16 train.py --epochs 3
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any

from nbaccel.core import (
    deepspeed_settings,
    fsdp_settings,
    hardware,
    parallelism_settings,
    rendezvous,
)
from nbaccel.core.config import LaunchConfig, third_party_env
from nbaccel.core.errors import RankFailedError, UsageError
from nbaccel.launch import capacity
from nbaccel.launch.failures import describe_exit, describe_raise
from nbaccel.launch.state import DEFAULT_LINE_PREFIX
from nbaccel.rank import containment

ENTRY_MODULE = "nbaccel.rank.script_entry"
_STOPPED_BY_AGENT = (-signal.SIGTERM, -signal.SIGKILL)


def resolve_config(args: argparse.Namespace) -> LaunchConfig:
    """The config file (``--config_file``, else the shared one if it exists) with flags applied."""
    if args.config_file:
        base = LaunchConfig.load(args.config_file)
    else:
        base = LaunchConfig.load_default() or LaunchConfig()
    return base.replace(
        num_processes=args.num_processes,
        num_machines=args.num_machines,
        machine_rank=args.machine_rank,
        main_process_ip=args.main_process_ip,
        main_process_port=args.main_process_port,
        mixed_precision=args.mixed_precision,
        strategy=args.strategy,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        rdzv_backend=args.rdzv_backend,
        max_restarts=args.max_restarts,
        **{k: getattr(args, k, None) for k in fsdp_settings.ENV},  # validated by LaunchConfig
        **{k: getattr(args, k, None) for k in deepspeed_settings.ENV},
        **{k: getattr(args, k, None) for k in parallelism_settings.ENV},
    )


def uses_static_rendezvous(cfg: LaunchConfig) -> bool:
    """Whether the launch meets through nbaccel's static rendezvous: asked for, or on one
    machine, where c10d's elastic membership changes nothing (and its stores would listen on
    every interface)."""
    return cfg.rdzv_backend == "static" or cfg.num_machines == 1


def torchrun_arguments(
    cfg: LaunchConfig,
    nprocs: int,
    port: int,
    log_dir: str,
    target: list[str],
    hosts_store: bool = False,
) -> list[str]:
    """The torch.distributed.run command line (without the program name) for this launch."""
    from nbaccel.cli.elastic_rendezvous import BACKEND, C10D_BACKEND  # imports torch

    static = uses_static_rendezvous(cfg)
    argv = [
        f"--nnodes={cfg.num_machines}",
        f"--nproc-per-node={nprocs}",
        # elastic's static, with a fresh loopback-only store per restart, or torch's c10d
        # with its workers' store on this machine's address only (elastic_rendezvous)
        f"--rdzv-backend={BACKEND if static else C10D_BACKEND}",
        f"--rdzv-endpoint={cfg.main_process_ip}:{port}",
        "--rdzv-id=nbaccel",
        f"--max-restarts={cfg.max_restarts}",
        # Workers write to files that the agent tails onto our stdout/stderr, labelled.
        "--redirects=3",
        "--tee=3",
        f"--log-dir={log_dir}",
    ]
    if static:  # c10d numbers the machines itself; machine_rank is not needed.
        argv.append(f"--rdzv-conf=rank={cfg.machine_rank}")
    else:
        # torch finds both by the machine's name, which may resolve to an address the others
        # cannot reach (Debian's 127.0.1.1) or not to the one --main_process_ip names: then
        # no machine serves the store, or the workers are told to meet where none can.
        if hosts_store:
            argv.append("--rdzv-conf=is_host=1")
        local = rendezvous.route_address(cfg.main_process_ip)
        if local:
            argv.append(f"--local-addr={local}")
    return [*argv, "--module", ENTRY_MODULE, *target]


def serve_c10d_store(cfg: LaunchConfig, port: int) -> Any:
    """Across machines with c10d, the server of its rendezvous store, on the interface of
    --main_process_ip only (torch's store, multi-tenant, shares it); ``None`` where another
    process serves it: the address is not this machine's (or machine 0 is behind NAT and
    knows none: torch's own guess decides there), or the port is taken, by another machine's
    launch on this same host."""
    listen = rendezvous.listen_address(cfg.main_process_ip, one_machine=False)
    if uses_static_rendezvous(cfg) or not listen:
        return None
    try:
        return rendezvous.serve_store(listen, port)
    except OSError:
        return None


def _resolve_port(cfg: LaunchConfig) -> int:
    if cfg.main_process_port is not None:
        return cfg.main_process_port
    if cfg.num_machines > 1:
        raise UsageError(
            "--main_process_port is required when --num_machines is above 1: every machine "
            "must be given the same port (e.g. --main_process_port 29500)."
        )
    loopback = cfg.main_process_ip in hardware.LOOPBACK_HOSTS
    try:
        return rendezvous.free_port("127.0.0.1" if loopback else cfg.main_process_ip)
    except OSError as exc:  # a name that does not resolve, or no address of this machine
        message = rendezvous.unusable_address("--main_process_ip", cfg.main_process_ip, exc)
        raise UsageError(message) from None


def _meeting_point(cfg: LaunchConfig, port: int, hosts_store: bool) -> str:
    """Where the ranks meet, as the banner says it: machine 0 listens there, only there."""
    if (cfg.machine_rank == 0 and uses_static_rendezvous(cfg)) or hosts_store:
        listen = rendezvous.listen_address(cfg.main_process_ip, cfg.num_machines == 1)
        return f"rendezvous on {rendezvous.describe_listening(listen, port)}"
    return f"rendezvous at {cfg.main_process_ip}:{port}"


def _check_target(args: argparse.Namespace) -> list[str]:
    if args.module:
        return ["-m", args.script, *args.script_args]
    script = Path(args.script)
    if not script.is_file():
        raise UsageError(f"no such script: {args.script} (pass -m to run a module).")
    return [str(script), *args.script_args]


def _set_environment(cfg: LaunchConfig, nprocs: int) -> None:
    """Variables the ranks inherit (the agent passes os.environ on to them)."""
    one_machine = cfg.num_machines == 1 or cfg.main_process_ip in hardware.LOOPBACK_HOSTS
    os.environ.update(
        rendezvous.launcher_environment(cfg.worker_env(), "cli", cfg.main_process_ip, one_machine)
    )
    device = "cuda" if hardware.detect().gpu_count else "cpu"  # what the ranks' Accelerator picks
    for key, value in third_party_env(device, cfg.mixed_precision).items():
        os.environ.setdefault(key, value)
    os.environ["TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"] = DEFAULT_LINE_PREFIX
    os.environ["PYTHONUNBUFFERED"] = "1"  # lines reach the labelled output as they are printed
    if "OMP_NUM_THREADS" not in os.environ:
        # torchrun would force 1 thread and say so in a banner; share the cores out instead.
        os.environ["OMP_NUM_THREADS"] = str(hardware.threads_per_rank(nprocs))


def _quiet_elastic_logs() -> None:
    """torch elastic logs each worker's exit and its own SIGTERMs at WARNING/ERROR; the final
    summary says the same more clearly. NBACCEL_DEBUG=1 keeps them."""
    if os.environ.get("NBACCEL_DEBUG"):
        return
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)


def failure_from(failures: dict[int, Any], world_size: int) -> RankFailedError:
    """Turn torch elastic's per-rank ``ProcessFailure`` records into the notebook's error."""
    described = []
    for rank, failure in failures.items():
        message = failure.error_file_data.get("message") if failure.error_file_data else None
        extra = message.get("extraInfo", {}) if isinstance(message, dict) else {}
        ours = extra.get("nbaccel") or {}
        exc_type = ours.get("exc_type")
        if exc_type:
            summary = describe_raise(exc_type, ours.get("exc_message", ""))
            traceback_text = extra.get("py_callstack", "")
        elif isinstance(message, dict):  # a script that used torch's own @record
            summary = f"raised {message.get('message', 'an exception')}"
            traceback_text = extra.get("py_callstack", "")
        else:
            summary, traceback_text = describe_exit(failure.exitcode), ""
        when = float(ours.get("time", failure.timestamp))
        described.append((when, rank, summary, traceback_text, exc_type, failure.exitcode))
    # The first to fail is the cause; the rest were usually stopped because of it. Ranks the
    # agent itself terminated (SIGTERM/SIGKILL, no record, whole-second times) go last.
    described.sort(key=lambda d: (d[5] in _STOPPED_BY_AGENT, d[0], d[1]))
    _, rank, summary, traceback_text, exc_type, exitcode = described[0]
    others = tuple(f"rank {r} {s}" for _, r, s, *_ in described[1:])
    return RankFailedError(
        rank,
        world_size,
        summary,
        traceback_text,
        exc_type,
        exitcode=exitcode,
        other_failures=others,
    )


def launch(args: argparse.Namespace) -> int:
    """Run ``args.script`` on every rank; return the exit status for the command.

    Example::

        $ nbaccel launch --num_processes 2 train.py --lr 0.1
    """
    cfg = resolve_config(args)
    target = _check_target(args)
    port = _resolve_port(cfg)
    gpus = hardware.detect().gpu_count
    nprocs = cfg.num_processes or gpus or 1
    world_size = nprocs * cfg.num_machines
    try:
        capacity.check_process_count(nprocs, world_size, not gpus, name="--num_processes")
        parallelism_settings.check_launch(cfg.to_dict(), world_size, on_gpus=bool(gpus))
    except ValueError as exc:
        raise UsageError(str(exc)) from None

    import torch.distributed.run as torch_run
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousError

    from nbaccel.cli import elastic_rendezvous
    from nbaccel.cli.debugging import TerminalDebugging

    elastic_rendezvous.register()

    _set_environment(cfg, nprocs)
    debugging = TerminalDebugging()  # breakpoint() in a rank: pdb on this terminal
    os.environ.update(debugging.environment())
    _quiet_elastic_logs()
    log_dir = tempfile.mkdtemp(prefix="nbaccel-launch-")
    # A rank's guard that is itself SIGKILLed leaves orphans; they re-parent here and are
    # stopped when the launch ends (see nbaccel.rank.script_guard for the rest). Only in a
    # process with no children yet (the `nbaccel` command), so nothing else of ours is stopped.
    subreaper = not containment.descendants() and containment.set_subreaper()
    c10d_server = serve_c10d_store(cfg, port)
    argv = torchrun_arguments(cfg, nprocs, port, log_dir, target, c10d_server is not None)
    try:
        torch_args = torch_run.parse_args(argv)
        print(
            f"nbaccel: launching {nprocs} process{'es' if nprocs > 1 else ''} on machine "
            f"{cfg.machine_rank} of {cfg.num_machines} (world size {world_size}), "
            f"mixed_precision={cfg.mixed_precision}, strategy={cfg.strategy}, "
            f"{_meeting_point(cfg, port, c10d_server is not None)}",
            flush=True,
        )
        torch_run.run(torch_args)
    except ChildFailedError as exc:
        error = failure_from(exc.failures, world_size)
        sys.stdout.flush()
        print(f"nbaccel launch: {error}", file=sys.stderr, flush=True)
        return 1
    except RendezvousError as exc:  # e.g. a machine that did not rejoin for a restart
        sys.stdout.flush()
        print(f"nbaccel launch: {exc}", file=sys.stderr, flush=True)
        return 1
    except SignalException as exc:
        # The agent has already stopped the ranks; report how we were stopped.
        name = signal.Signals(exc.sigval).name
        why = debugging.stop_reason or f"stopped by {name}"
        print(f"nbaccel launch: {why}; all ranks were stopped.", file=sys.stderr)
        return 128 + int(exc.sigval)
    finally:
        if subreaper:
            containment.stop_descendants()
        shutil.rmtree(log_dir, ignore_errors=True)
        del c10d_server
        debugging.close()
    return 0
