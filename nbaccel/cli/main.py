"""The ``nbaccel`` command line (also ``python -m nbaccel``): parse arguments, dispatch.

Subcommands: ``config`` (write/show the shared config file), ``launch`` (run a script on N
processes through torch.distributed.run), ``export`` (notebook -> runnable script), ``env``
(a report to paste into bug reports) and ``demo`` (the README's 2-process example).

Errors meant for people (a bad flag value, a malformed config file) are printed as one
``nbaccel <command>: error: ...`` line with exit status 2, never as a Python traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from nbaccel.cli import torchrun_flags
from nbaccel.core import (
    deepspeed_settings,
    fsdp_settings,
    parallelism_settings,
    strategy_registry,
)
from nbaccel.core.config import (
    MIXED_PRECISION_CHOICES,
    RDZV_BACKEND_CHOICES,
    ConfigError,
    LaunchConfig,
    default_config_path,
)
from nbaccel.core.errors import UsageError


def _add_demo(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo",
        help="train a tiny model on 2 CPU processes through notebook_launcher",
        description="Run the README's example: a small DDP training on generated data, "
        "launched with notebook_launcher, printing each rank's output and the result.",
    )
    p.add_argument("--num_processes", type=int, default=2, help="processes to start (default 2)")
    p.add_argument("--steps", type=int, default=200, help="optimizer steps per rank (default 200)")
    p.set_defaults(handler=_run_demo)


def _run_demo(args: argparse.Namespace) -> int:
    from nbaccel.cli.demo import run_demo

    if args.num_processes < 1 or args.steps < 1:
        raise UsageError("--num_processes and --steps must be at least 1.")
    result = run_demo(num_processes=args.num_processes, steps=args.steps)
    print(f"result from rank 0: {result}")
    return 0


def _add_config(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "config",
        help="create or show the launch config file",
        description="Answer a few questions (Enter keeps the detected default) and write the "
        "config file shared by `nbaccel launch`, notebook_launcher and nbaccel.configure().",
    )
    p.add_argument("--config_file", help="file to write/show (default: the shared config file)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument(
        "--default", action="store_true", help="write detected defaults, no questions"
    )
    mode.add_argument("--show", action="store_true", help="print the current config file")
    p.set_defaults(handler=_run_config)


def _run_config(args: argparse.Namespace) -> int:
    path = Path(args.config_file) if args.config_file else default_config_path()
    if args.show:
        LaunchConfig.load(path)  # validates: errors name the file, line and key
        print(f"# {path}")
        print(path.read_text(encoding="utf-8"), end="")
        return 0
    if args.default:
        existed = path.exists()
        target = detected_defaults().save(path)
        print(f"{'replaced' if existed else 'wrote'} {target} with detected defaults")
        return 0
    return _ask_and_write(path)


def detected_defaults() -> LaunchConfig:
    """What ``nbaccel config --default`` writes: one process per GPU, else one on CPU."""
    from nbaccel.core import hardware

    return LaunchConfig(num_processes=hardware.detect().gpu_count or 1)


def _ask(question: str, default: Any, parse: Callable[[str], Any]) -> Any:
    """Ask until the answer parses; Enter keeps ``default``. End of input stops cleanly."""
    while True:
        try:
            answer = input(f"{question} [{default}]: ").strip()
        except EOFError:
            raise UsageError(
                "input ended before every question was answered; nothing was written. "
                "Use `nbaccel config --default` for a config without questions."
            ) from None
        if not answer:
            return default
        try:
            return parse(answer)
        except (ValueError, ConfigError) as exc:
            print(f"  {exc}")


def _integer(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise ValueError(f"{text!r} is not a whole number.") from None
        if value < minimum or (maximum is not None and value > maximum):
            upper = f" and at most {maximum}" if maximum is not None else ""
            raise ValueError(f"enter a number at least {minimum}{upper}.")
        return value

    return parse


def _choice(choices: tuple[str, ...]) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text.lower() not in choices:
            raise ValueError(f"choose one of {', '.join(choices)}.")
        return text.lower()

    return parse


def _ask_and_write(path: Path) -> int:
    """The interactive questions; the existing file's values (else detected ones) are defaults."""
    from nbaccel.core import hardware

    current = LaunchConfig.load(path) if path.exists() else detected_defaults()
    print(f"nbaccel config: this machine has {hardware.detect().describe()}.")
    print(f"Press Enter to keep the value in brackets. The answers go to {path}.")
    machines = _ask("How many machines take part?", current.num_machines, _integer(1))
    values: dict[str, Any] = {"num_machines": machines}
    if machines > 1:
        values["machine_rank"] = _ask(
            "Rank of this machine (0 is the main one)?",
            min(current.machine_rank, machines - 1),
            _integer(0, machines - 1),
        )
        values["main_process_ip"] = _ask(
            "Address of the main machine?", current.main_process_ip, str
        )
        values["main_process_port"] = _ask(
            "Port on the main machine?", current.main_process_port or 29500, _integer(1, 65535)
        )
        values["rdzv_backend"] = _ask(
            f"Rendezvous backend ({'/'.join(RDZV_BACKEND_CHOICES)})?",
            current.rdzv_backend,
            _choice(RDZV_BACKEND_CHOICES),
        )
    else:
        values.update(machine_rank=0, main_process_port=None)
    values["num_processes"] = _ask(
        "How many processes on this machine?", current.num_processes or 1, _integer(1)
    )
    values["mixed_precision"] = _ask(
        f"Mixed precision ({'/'.join(MIXED_PRECISION_CHOICES)})?",
        current.mixed_precision,
        _choice(MIXED_PRECISION_CHOICES),
    )
    values["strategy"] = _ask(
        f"Strategy ({'/'.join(strategy_registry.names())})?",
        current.strategy,
        _choice(strategy_registry.names()),
    )
    values["gradient_accumulation_steps"] = _ask(
        "Gradient accumulation steps?", current.gradient_accumulation_steps, _integer(1)
    )
    change_fsdp = "no"
    if values["strategy"] == "fsdp":
        change_fsdp = _ask(
            "Change the FSDP options (wrap policy, offload, checkpoint format)? (yes/no)",
            "no",
            _choice(("yes", "no")),
        )
    if change_fsdp == "yes":
        values.update(_ask_fsdp(current))
    if values["strategy"] == "deepspeed":
        values["deepspeed_zero_stage"] = _ask(
            "DeepSpeed ZeRO stage (0/1/2/3)?", current.deepspeed_zero_stage, _integer(0, 3)
        )
        values["deepspeed_offload_optimizer_device"] = _ask(
            f"Offload the optimizer state to ({'/'.join(deepspeed_settings.OFFLOAD_DEVICES)})?",
            current.deepspeed_offload_optimizer_device,
            _choice(deepspeed_settings.OFFLOAD_DEVICES),
        )
    cfg = dataclasses.replace(current, **values)  # validates the whole config again
    print(f"wrote {cfg.save(path)}")
    _say_what_cannot_run_here(cfg)
    return 0


def _say_what_cannot_run_here(cfg: LaunchConfig) -> None:
    """The file is kept (it may be written for another machine), but a launch here would
    refuse it: say so now, not at the launch."""
    from nbaccel.core import capabilities, hardware

    for problem in capabilities.unrunnable_here(
        cfg.mixed_precision, cfg.strategy, hardware.detect().gpus
    ):
        print(f"note: this machine cannot launch it: {problem}")


def _ask_fsdp(current: LaunchConfig) -> dict[str, Any]:
    """The FSDP questions (as `accelerate config` asks them), answered into ``fsdp_*`` fields."""
    yes_no = _choice(("yes", "no"))
    values: dict[str, Any] = {}
    values["fsdp_auto_wrap_policy"] = _ask(
        f"FSDP auto wrap policy ({'/'.join(fsdp_settings.AUTO_WRAP_CHOICES)})?",
        current.fsdp_auto_wrap_policy,
        _choice(fsdp_settings.AUTO_WRAP_CHOICES),
    )
    if values["fsdp_auto_wrap_policy"] == "transformer_based_wrap":
        names = current.fsdp_transformer_cls_names_to_wrap
        values["fsdp_transformer_cls_names_to_wrap"] = _ask(
            "Block classes to wrap, comma-separated (e.g. GPT2Block)?",
            ",".join(names or []),
            fsdp_settings.class_names,
        )
    elif values["fsdp_auto_wrap_policy"] == "size_based_wrap":
        values["fsdp_min_num_params"] = _ask(
            "Wrap modules with more than how many parameters?",
            current.fsdp_min_num_params or 100_000_000,
            _integer(0),
        )
    for key, question in (
        ("fsdp_cpu_offload", "Offload parameters and optimizer state to the CPU?"),
        ("fsdp_reshard_after_forward", "Free gathered parameters after forward?"),
        ("fsdp_activation_checkpointing", "Recompute activations in backward (checkpointing)?"),
    ):
        answer = _ask(f"{question} (yes/no)", "yes" if getattr(current, key) else "no", yes_no)
        values[key] = answer == "yes"
    values["fsdp_state_dict_type"] = _ask(
        f"Checkpoint format ({'/'.join(fsdp_settings.STATE_DICT_CHOICES)})?",
        current.fsdp_state_dict_type,
        fsdp_settings.state_dict_choice,
    )
    return values


def _doc(name: str) -> str:
    """The documentation of the launch option a flag sets (Accelerate's config spelling or
    nbaccel's), from :class:`~nbaccel.launch.options.LaunchOptions`."""
    from nbaccel.launch.options import ALIASES, LaunchOptions

    return LaunchOptions.doc(ALIASES.get(name, name))


def _add_launch(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "launch",
        help="run a training script on N processes (torch.distributed.run underneath)",
        description="Run SCRIPT on every process with torch.distributed.run. Settings come "
        "from the config file; flags override it. Output is labelled per rank. torchrun's "
        "names work too (--nproc_per_node, --nnodes, --node_rank, --master_addr, "
        "--master_port, --rdzv_endpoint, --standalone).",
    )
    # Flag names follow `accelerate launch` where they mean the same thing.
    p.add_argument("--config_file", help="config file to read (default: the shared one)")
    # Help of the settings a notebook launch has too: its LaunchOptions field's documentation
    p.add_argument("--num_processes", type=int, help=_doc("num_processes"))
    p.add_argument("--num_machines", type=int, help=_doc("num_machines"))
    p.add_argument("--machine_rank", type=int, help=_doc("machine_rank"))
    p.add_argument("--main_process_ip", help=_doc("main_process_ip"))
    p.add_argument("--main_process_port", type=int, help="port on machine 0 (default: free port)")
    p.add_argument(
        "--mixed_precision", choices=MIXED_PRECISION_CHOICES, help=_doc("mixed_precision")
    )
    p.add_argument("--strategy", choices=strategy_registry.names(), help=_doc("strategy"))
    p.add_argument("--gradient_accumulation_steps", type=int)
    p.add_argument(
        "--rdzv_backend", "--rdzv-backend", choices=RDZV_BACKEND_CHOICES, help=_doc("rdzv_backend")
    )
    p.add_argument("--max_restarts", "--max-restarts", type=int, help=_doc("max_restarts"))
    torchrun_flags.add_torchrun_flags(p)
    fsdp = p.add_argument_group("FSDP (with --strategy fsdp; names as in `accelerate launch`)")
    fsdp.add_argument(
        "--fsdp_auto_wrap_policy", type=str.lower, choices=fsdp_settings.AUTO_WRAP_CHOICES
    )
    fsdp.add_argument("--fsdp_transformer_cls_names_to_wrap", type=fsdp_settings.class_names)
    fsdp.add_argument("--fsdp_min_num_params", type=int)
    for flag in ("cpu_offload", "reshard_after_forward", "activation_checkpointing"):
        fsdp.add_argument(f"--fsdp_{flag}", metavar="true|false")
    fsdp.add_argument(
        "--fsdp_state_dict_type", type=str.upper, choices=fsdp_settings.STATE_DICT_CHOICES
    )
    ds = p.add_argument_group(
        "DeepSpeed (with --strategy deepspeed; names as in `accelerate launch`)"
    )
    ds.add_argument("--use_deepspeed", dest="strategy", action="store_const", const="deepspeed")
    ds.add_argument("--zero_stage", dest="deepspeed_zero_stage", type=int, choices=(0, 1, 2, 3))
    ds.add_argument("--gradient_clipping", dest="deepspeed_gradient_clipping", type=float)
    for flag in ("offload_optimizer_device", "offload_param_device"):
        ds.add_argument(
            f"--{flag}",
            dest=f"deepspeed_{flag}",
            type=str.lower,
            choices=deepspeed_settings.OFFLOAD_DEVICES,
        )
    for flag in ("zero3_init_flag", "zero3_save_16bit_model"):
        ds.add_argument(f"--{flag}", dest=f"deepspeed_{flag}", metavar="true|false")
    ds.add_argument(
        "--deepspeed_config_file", help="a DeepSpeed JSON config ('auto' values filled)"
    )
    nd = p.add_argument_group(
        "N-D parallelism (ParallelismConfig's sizes; names as in `accelerate launch`)"
    )
    for field in parallelism_settings.ENV:
        flag = field.replace("_", "-")
        nd.add_argument(f"--{field}", f"--{flag}", dest=field, type=int, metavar="N")
    p.add_argument("-m", "--module", action="store_true", help="SCRIPT is a module name")
    p.add_argument("script", help="the training script (or module with -m)")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    p.set_defaults(handler=_run_launch)


def _run_launch(args: argparse.Namespace) -> int:
    from nbaccel.cli import launch as cli_launch

    return cli_launch.launch(args)


def _add_export(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export",
        help="turn a notebook into a script that runs under `nbaccel launch`",
        description="Write the notebook's code cells as a script: magics and shell escapes "
        "become comments, cells tagged skip-export are dropped, and the notebook_launcher "
        "call becomes a main guard.",
    )
    p.add_argument("notebook", help="the .ipynb file")
    p.add_argument("-o", "--output", help="script to write (default: NOTEBOOK with .py)")
    p.add_argument(
        "--function", help="training function to run when the notebook has no launcher call"
    )
    p.add_argument("--force", action="store_true", help="overwrite an existing output file")
    p.set_defaults(handler=_run_export)


def _run_export(args: argparse.Namespace) -> int:
    from nbaccel.cli.export import ExportError, ExportWarning, export_notebook, run_command

    # What was not carried over is said in one line each, not as Python's
    # "path/export.py:311: ExportWarning: ..." with the source line under it.
    with warnings.catch_warnings(record=True) as notes:
        warnings.simplefilter("always", ExportWarning)
        try:
            target = export_notebook(args.notebook, args.output, args.function, args.force)
        except ExportError as exc:
            raise UsageError(str(exc)) from None
    for note in notes:
        if issubclass(note.category, ExportWarning):
            print(note.message, file=sys.stderr)
        else:
            warnings.showwarning(note.message, note.category, note.filename, note.lineno)
    print(f"wrote {target}; run it with: {run_command(target)}")
    return 0


def _add_env(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "env",
        help="print versions, devices and config for a bug report",
        description="Print a report to paste into a bug report.",
    )
    p.add_argument("--config_file", help="config file to include (default: the shared one)")
    p.set_defaults(handler=_run_env)


def _run_env(args: argparse.Namespace) -> int:
    from nbaccel.cli.env_report import report

    print(report(args.config_file))
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser for every subcommand (exposed for tests and docs)."""
    parser = argparse.ArgumentParser(
        prog="nbaccel",
        description="Launch distributed PyTorch training from notebooks and scripts.",
    )
    from nbaccel import __version__

    parser.add_argument("--version", action="version", version=f"nbaccel {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for add in (_add_config, _add_launch, _add_export, _add_env, _add_demo):
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status.

    Example::

        $ nbaccel launch --num_processes 2 train.py --epochs 3
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return args.handler(args)
    except (UsageError, ConfigError) as exc:
        print(f"nbaccel {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"nbaccel {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
