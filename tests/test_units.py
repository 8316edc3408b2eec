"""Fast tests of the pure logic under the launcher: no processes, no kernels, milliseconds each.

The end-to-end tests check the same behaviour through real ranks; these pin the rules down so a
regression shows up in ``pytest -m "not slow"`` first.
"""

from __future__ import annotations

import os
import signal
import types

import pytest

from nbaccel.core import capabilities, hardware
from nbaccel.core.config import ConfigError, ConfigTypeError, LaunchConfig
from nbaccel.core.hardware import GPU
from nbaccel.launch import failures, plan
from nbaccel.launch.failures import describe_exit, describe_raise
from nbaccel.launch.lines import LINE_LIMIT, LineSplitter
from nbaccel.rank import exit as rank_exit

# -- output lines ---------------------------------------------------------------------------


def test_lines_are_cut_whole_across_reads():
    s = LineSplitter()
    assert s.feed(b"ep") == []
    assert s.feed(b"och 1\nepoch 2\nhal") == ["epoch 1", "epoch 2"]
    assert s.flush() == ["hal"]
    assert s.flush() == []


def test_carriage_return_keeps_what_a_terminal_shows():
    s = LineSplitter()
    assert s.feed(b"10%\r50%\r100%\n") == ["100%"]
    assert s.feed(b"windows line\r\n") == ["windows line"]


def test_invalid_utf8_is_replaced_not_raised():
    assert LineSplitter().feed(b"caf\xe9\n") == ["caf\ufffd"]


def test_a_runaway_line_is_cut_at_the_limit_with_the_dropped_bytes_counted():
    s = LineSplitter()
    for _ in range(100):  # 6.4 MB of one line, in reads: only the first 64 KiB are kept
        assert s.feed(b"x" * LINE_LIMIT) == []
    assert len(s._partial) == LINE_LIMIT and s.pending.endswith("x …")
    (line,) = s.feed(b"tail\n")
    assert line.startswith("x" * LINE_LIMIT)
    assert line.endswith(f" … [line cut here: {99 * LINE_LIMIT + 4:,} more bytes not shown]")
    assert s.feed(b"next\n") == ["next"]  # the next line is whole again


def test_a_cut_line_ends_between_characters_and_names_its_log():
    class Sink:
        path, data = "/logs/rank0.stdout.log", b""

        def write(self, data):
            Sink.data += data

    s = LineSplitter(limit=5, sink=Sink())
    raw = "abcdé and more".encode() + b"\n"  # the limit falls inside the two bytes of "é"
    assert s.feed(raw) == [
        "abcd … [line cut here: 11 more bytes not shown; the whole line is in "
        "/logs/rank0.stdout.log]"
    ]
    assert Sink.data == raw


def test_progress_lines_past_the_limit_keep_what_follows_the_last_carriage_return():
    s = LineSplitter(limit=100)
    for i in range(50):  # a bar redrawn in place, never a newline
        s.feed(f"\rstep {i:4d} ".encode() + b"=" * 20)
    assert s.pending == "step   49 " + "=" * 20
    assert s.flush() == ["step   49 " + "=" * 20]


# -- how ranks end ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("code", "text"),
    [
        (0, "exited with code 0"),
        (2, "exited with code 2"),
        (-signal.SIGKILL, "was killed by signal SIGKILL (killed)"),
        (-signal.SIGSEGV, "was killed by signal SIGSEGV (segmentation fault)"),
        (-200, "was killed by signal 200"),
        (None, "is still running"),
    ],
)
def test_exit_codes_in_words(code, text):
    assert describe_exit(code) == text


def test_raised_exceptions_drop_the_builtins_prefix_only():
    assert describe_raise("builtins.ValueError", "bad") == "raised ValueError: bad"
    assert describe_raise("torch.OutOfMemoryError", "") == "raised torch.OutOfMemoryError"


@pytest.mark.parametrize(
    ("raised", "code", "reported"),
    [
        (None, 0, False),
        (SystemExit(0), 0, False),
        (SystemExit(None), 0, False),
        (SystemExit(4), 4, True),
        (SystemExit("no data"), 1, True),
        (KeyboardInterrupt(), 1, True),
        (ValueError("x"), 1, True),
    ],
)
def test_one_exit_protocol_for_every_way_user_code_ends(raised, code, reported):
    got_code, failure = rank_exit.outcome(raised)
    assert got_code == code
    assert (failure is raised) if reported else failure is None


def test_plumbing_frames_are_dropped_from_the_top():
    def run():
        raise KeyError("k")

    try:
        run()
    except KeyError as exc:
        full = rank_exit.user_traceback(exc, lambda f: False)
        trimmed = rank_exit.user_traceback(exc, lambda f: f == __file__)
    assert "test_plumbing_frames_are_dropped_from_the_top" in full
    # Every frame here is in this file: trimmed to the exception line itself.
    assert "test_plumbing_frames" not in trimmed and "KeyError: 'k'" in trimmed


def test_a_cluster_ranks_stack_ends_at_the_users_code_and_nbaccels_rank_entry():
    """A Ray rank runs as ``python -m nbaccel.cluster.remote_entry``: its stack at a timeout
    (faulthandler's, most recent call first) keeps what a local rank's keeps, not the entry's
    or runpy's frames below it."""
    site = "/venv/lib/python3.11/site-packages/nbaccel"
    dump = "\n".join(
        [
            "Current thread 0x00007f (most recent call first):",
            '  File "/home/me/train.py", line 9 in train',
            f'  File "{site}/rank/entry.py", line 120 in run_rank',
            f'  File "{site}/cluster/remote_entry.py", line 57 in main',
            f'  File "{site}/cluster/remote_entry.py", line 61 in <module>',
            '  File "<frozen runpy>", line 88 in _run_code',
            '  File "<frozen runpy>", line 198 in _run_module_as_main',
        ]
    )
    local = dump.replace(
        f'  File "{site}/cluster/remote_entry.py", line 57 in main',
        ('  File "/usr/lib/python3.11/multiprocessing/process.py", line 314 in _bootstrap'),
    )
    from nbaccel.cluster.ray_cluster import RayCluster

    entry_file = RayCluster().rank_entry_file  # the cluster says where its ranks start
    assert failures.without_plumbing(dump, entry_file).splitlines() == [
        "Current thread 0x00007f (most recent call first):",
        '  File "/home/me/train.py", line 9 in train',
        f'  File "{site}/rank/entry.py", line 120 in run_rank',
    ]
    assert failures.without_plumbing(dump, entry_file) == failures.without_plumbing(local)


def test_a_ctrl_c_in_a_nested_deferral_is_raised_once_after_the_outer_block():
    """A teardown step (``RankLifecycle.end``) inside a launch's teardown: a Ctrl-C during the
    step must not cut the rest of the outer block short; it is raised once, at its end."""
    import os

    from nbaccel.core.containment import sigint_deferred

    steps = []
    with pytest.raises(KeyboardInterrupt, match="launch interrupted"), sigint_deferred():
        with sigint_deferred():
            os.kill(os.getpid(), signal.SIGINT)
            steps.append("inner")
        steps.append("outer")
    assert steps == ["inner", "outer"]
    # An outer block that drops it: nothing is raised.
    with sigint_deferred(reraise=False), sigint_deferred():
        os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


# -- failure attribution under nbaccel launch ----------------------------------------------


def _elastic_failure(exitcode, timestamp, nbaccel=None):
    data = {}
    if nbaccel is not None:
        data = {
            "message": {"message": "x", "extraInfo": {"py_callstack": "tb", "nbaccel": nbaccel}}
        }
    return types.SimpleNamespace(error_file_data=data, exitcode=exitcode, timestamp=timestamp)


def test_cli_names_the_first_rank_that_raised_not_the_ones_the_agent_stopped():
    from nbaccel.cli.launch import failure_from

    failures = {
        0: _elastic_failure(-signal.SIGTERM, 100),  # stopped by the agent afterwards
        1: _elastic_failure(
            1, 100, {"exc_type": "builtins.ValueError", "exc_message": "bad", "time": 99.5}
        ),
        2: _elastic_failure(
            1, 100, {"exc_type": "builtins.KeyError", "exc_message": "'k'", "time": 99.7}
        ),
    }
    error = failure_from(failures, world_size=3)
    assert error.rank == 1 and error.summary == "raised ValueError: bad"
    assert error.exc_type == "builtins.ValueError" and error.remote_traceback == "tb"
    assert error.other_failures[0].startswith("rank 2 raised KeyError")
    assert "SIGTERM" in error.other_failures[-1]


# -- the capability table -------------------------------------------------------------------

T4 = GPU(0, "Tesla T4", 15.0, (7, 5))
A100 = GPU(0, "A100", 80.0, (8, 0))
H100 = GPU(0, "H100", 80.0, (9, 0))


@pytest.mark.parametrize(
    ("precision", "gpus", "torchao", "allowed", "hint"),
    [
        ("no", (), False, True, ""),
        ("fp16", (T4,), False, True, ""),
        ("bf16", (), False, True, ""),
        ("bf16", (T4,), False, False, "use 'fp16'"),
        ("bf16", (A100, T4), False, False, "GPU 0 Tesla T4 has 7.5"),
        ("fp8", (), True, False, "use 'bf16' on CPU"),
        ("fp8", (A100,), True, False, "8.9+"),
        ("fp8", (H100,), False, False, "pip install torchao"),
        ("fp8", (H100,), True, True, ""),
    ],
)
def test_capability_table(precision, gpus, torchao, allowed, hint):
    verdict = capabilities.precision_verdict(precision, gpus, torchao)
    assert verdict.allowed is allowed
    assert hint in verdict.reason and (bool(verdict.reason) is not allowed)


def test_capability_check_raises_the_reason_and_unknown_values_are_named():
    with pytest.raises(ConfigError, match="mixed_precision='fp8'.*use 'bf16' on CPU"):
        capabilities.check_precision("fp8", (), torchao=True)
    with pytest.raises(ConfigError, match="mixed_precision='int4' is not supported"):
        capabilities.check_precision("int4", (), torchao=True)


def test_config_panel_and_launcher_share_the_table():
    from nbaccel.ui.config_panel import precision_choices

    hw = hardware.Hardware(cpu_count=4, gpus=(T4,))
    panel = {c.value: (c.enabled, c.reason) for c in precision_choices(hw, torchao=False)}
    for name, (enabled, reason) in panel.items():
        verdict = capabilities.precision_verdict(name, hw.gpus, False)
        assert (enabled, reason) == (verdict.allowed, verdict.reason)


# -- config validation ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "error", "match"),
    [
        ({"num_processes": 0}, ConfigError, "num_processes"),
        ({"num_processes": "2"}, ConfigTypeError, "must be an integer"),
        ({"num_processes": True}, ConfigTypeError, "must be an integer"),
        ({"mixed_precision": "fp4"}, ConfigError, "choose one of"),
        ({"strategy": "zero"}, ConfigError, "strategy"),
        ({"gradient_accumulation_steps": 0}, ConfigError, "gradient_accumulation_steps"),
    ],
)
def test_config_rejects_bad_values_by_name(changes, error, match):
    with pytest.raises(error, match=match):
        LaunchConfig(**changes)


def test_config_yaml_errors_name_the_line_and_key():
    with pytest.raises(ConfigError, match=r"cfg.yaml, line 2: unknown key 'mixed_precison'"):
        LaunchConfig.from_yaml("num_processes: 2\nmixed_precison: bf16\n", source="cfg.yaml")
    with pytest.raises(ConfigError, match=r"cfg.yaml, line 1, key 'num_processes'"):
        LaunchConfig.from_yaml("num_processes: -1\n", source="cfg.yaml")


def test_config_round_trips_through_yaml():
    cfg = LaunchConfig(num_processes=3, mixed_precision="BF16", gradient_accumulation_steps=4)
    assert cfg.mixed_precision == "bf16"
    assert LaunchConfig.from_yaml(cfg.to_yaml()) == cfg


# -- the launch plan's refusals ---------------------------------------------------------------


def test_fork_is_refused_once_cuda_is_initialised(monkeypatch):
    monkeypatch.setattr(hardware, "cuda_initialized", lambda: True)
    with pytest.raises(RuntimeError, match="start_method='fork' cannot be used after CUDA"):
        plan.check_start_method("fork")
    assert plan.check_start_method("forkserver") == "forkserver"  # the safe default stays


def test_fork_is_allowed_before_cuda(monkeypatch):
    monkeypatch.setattr(hardware, "cuda_initialized", lambda: False)
    assert plan.check_start_method("fork") == "fork"


def test_env_none_removes_a_variable_and_values_become_strings(monkeypatch):
    monkeypatch.setenv("NBACCEL_UNIT_DROP", "1")
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    info = types.SimpleNamespace(
        world_size=2,
        num_processes=2,
        node_rank=0,
        master_addr="127.0.0.1",
        master_port=1234,
        device="cpu",
        mixed_precision="no",
    )
    env = plan._worker_env(info, LaunchConfig(), {"NBACCEL_UNIT_DROP": None, "N": 3})
    assert "NBACCEL_UNIT_DROP" not in env and env["N"] == "3"
    assert env["NBACCEL_LAUNCHER"] == "notebook" and env["WORLD_SIZE"] == "2"
    assert env["ACCELERATE_USE_CPU"] == "true"  # Accelerate's CPU ranks form a group too
    own = plan._worker_env(info, LaunchConfig(), {"ACCELERATE_USE_CPU": "false"})
    assert own["ACCELERATE_USE_CPU"] == "false"  # the user's own setting wins
    assert "ACCELERATE_MIXED_PRECISION" not in env
    # notebook_launcher(mixed_precision="bf16"): a Trainer or accelerate.Accelerator() in the
    # rank trains in bf16, as under Accelerate's launcher (it ran fp32 before, silently)
    bf16 = plan._worker_env(types.SimpleNamespace(**{**vars(info), "mixed_precision": "bf16"}),
                            LaunchConfig(), {})  # fmt: skip
    assert bf16["ACCELERATE_MIXED_PRECISION"] == "bf16"


def test_nbaccel_launch_hands_its_precision_to_accelerate(monkeypatch):
    # accelerate.Accelerator() and TrainingArguments in the script read it, as under
    # `accelerate launch --mixed_precision bf16`; they trained in fp32 before.
    from nbaccel.cli import launch as cli_launch

    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if "ACCEL" not in k})
    cli_launch._set_environment(LaunchConfig(num_processes=2, mixed_precision="bf16"), 2)
    assert os.environ["ACCELERATE_MIXED_PRECISION"] == "bf16"


def test_atomic_write_keeps_symlinks_and_permissions(tmp_path):
    import os
    import stat

    from nbaccel.core.atomic import atomic_write

    real = tmp_path / "dotfiles" / "real.yaml"
    real.parent.mkdir()
    real.write_text("old\n")
    real.chmod(0o644)
    link = tmp_path / "config.yaml"
    link.symlink_to(real)
    with atomic_write(link, "w", encoding="utf-8") as f:
        f.write("new\n")
    assert link.is_symlink() and real.read_text() == "new\n"  # written through the link
    assert stat.S_IMODE(real.stat().st_mode) == 0o644
    fresh = tmp_path / "script.py"
    with atomic_write(fresh, "w", encoding="utf-8") as f:
        f.write("print(1)\n")
    umask = os.umask(0o022)
    os.umask(umask)
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o666 & ~umask  # as open() would, not 0600
