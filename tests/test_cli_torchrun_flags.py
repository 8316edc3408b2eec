"""``nbaccel launch`` takes torchrun's flag names, or says in one line what it does instead."""

from __future__ import annotations

import pytest

from nbaccel.cli.main import build_parser
from tests.test_cli_support import run_cli


def launch_args(*flags: str):
    return build_parser().parse_args(["launch", *flags, "train.py", "--lr", "1"])


@pytest.mark.parametrize("dash", ["_", "-"])
def test_torchrun_names_set_nbaccels_settings(dash):
    def flag(name: str) -> str:
        return "--" + name.replace("_", dash)

    args = launch_args(
        flag("nproc_per_node"), "3", flag("nnodes"), "2", flag("node_rank"), "1",
        flag("master_addr"), "10.0.0.7", flag("master_port"), "29511",
        flag("rdzv_backend"), "c10d", flag("max_restarts"), "4",
    )  # fmt: skip
    assert (args.num_processes, args.num_machines, args.machine_rank) == (3, 2, 1)
    assert (args.main_process_ip, args.main_process_port) == ("10.0.0.7", 29511)
    assert (args.rdzv_backend, args.max_restarts) == ("c10d", 4)
    assert args.script_args == ["--lr", "1"]  # the script's own flags stay the script's


def test_rdzv_endpoint_and_standalone():
    args = launch_args("--rdzv_endpoint", "[fd00::5]:29400")
    assert (args.main_process_ip, args.main_process_port) == ("fd00::5", 29400)
    assert launch_args("--standalone").num_machines == 1


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--nnodes", "1:4"], "--nnodes 1:4: give a number (--num_machines N); elastic MIN:MAX"),
        (["--nproc_per_node", "gpu"], "give a number (--num_processes N); without it"),
        (["--rdzv_endpoint", "host"], "give HOST:PORT"),
        (["--log-dir", "/tmp/logs"], "--log-dir is torchrun's; nbaccel launch has no such option"),
        (["--rdzv_id", "job7"], "the launch names its rendezvous itself"),
    ],
)
def test_what_nbaccel_has_not_is_one_line(flags, says, capsys):
    with pytest.raises(SystemExit) as exit:
        launch_args(*flags)
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("nbaccel launch: error: ") and says in err
    assert err.count("\n") == 1, err  # no usage dump


def test_command_line_answers_in_one_line(tmp_path):
    result = run_cli("launch", "--nnodes", "2:3", "train.py", cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [
        "nbaccel launch: error: --nnodes 2:3: give a number (--num_machines N); elastic "
        "MIN:MAX ranges are not supported."
    ]
