"""Declared extension points: a toy of each, added in one module and one registration line,
is found by everything that reads the registry (or asks the object), never by its name."""

from __future__ import annotations

import importlib
import os

import pytest

import nbaccel
from nbaccel.core import capabilities, strategy_registry
from nbaccel.core.config import ConfigError, LaunchConfig


@pytest.fixture
def toy_strategy():
    module = importlib.import_module("tests.toy_strategy")
    strategy_registry.register(module.ENTRY)  # again, after an earlier test removed it
    yield module
    strategy_registry.unregister("toy")


def test_an_unregistered_strategy_is_refused_listing_the_registered_ones():
    with pytest.raises(ConfigError, match="strategy='toy'.*'ddp', 'fsdp', 'deepspeed'"):
        LaunchConfig(strategy="toy")


def test_a_registered_strategy_is_a_choice_everywhere(toy_strategy):
    from nbaccel.cli.main import build_parser
    from nbaccel.core.hardware import Hardware
    from nbaccel.rank import settings_report
    from nbaccel.training.distributed import detect_state
    from nbaccel.training.strategies import select_strategy
    from nbaccel.ui.config_panel import ConfigPanel, panel_text, precision_choices

    assert "toy" in strategy_registry.names()
    assert LaunchConfig(strategy="toy").strategy == "toy"  # the config file
    args = build_parser().parse_args(["launch", "--strategy", "toy", "train.py"])  # the CLI
    assert args.strategy == "toy"
    capabilities.check_strategy("toy", "bf16")  # nothing it needs is missing
    assert strategy_registry.by_accelerate_type("TOY") == "toy"  # the settings report
    assert settings_report.strategy_registry is strategy_registry
    assert isinstance(select_strategy("toy", detect_state(cpu=True)), toy_strategy.ToyStrategy)
    cpu = Hardware(cpu_count=4)
    panel = ConfigPanel(LaunchConfig(strategy="toy"), cpu, "/nonexistent/cfg.yaml", torchao=False)
    assert ("TOY", "toy") in list(panel.strategy.options) and panel.strategy.value == "toy"
    text = panel_text(LaunchConfig(strategy="toy"), cpu, precision_choices(cpu, False), "x.yaml")
    assert "strategy: toy (one of ddp, fsdp, deepspeed, toy)" in text


def _toy_rank_strategy():
    import tests.toy_strategy  # noqa: F401 - registers it in the rank (as preload= would)

    accelerator = nbaccel.Accelerator()
    return type(accelerator._strategy).__name__, os.environ["NBACCEL_STRATEGY"]


@pytest.mark.slow
def test_a_registered_strategy_runs_in_real_ranks(toy_strategy):
    strategy, env = nbaccel.notebook_launcher(
        _toy_rank_strategy, num_processes=2, config=LaunchConfig(strategy="toy"), progress=False
    )
    assert (strategy, env) == ("ToyStrategy", "toy")


def test_the_three_rank_groups_and_the_ray_cluster_are_what_the_protocols_declare() -> None:
    from nbaccel.cluster.ray_cluster import RayCluster
    from nbaccel.cluster.ray_group import RayRankGroup
    from nbaccel.launch import group, protocols, xla

    # The type checker checks these assignments (tests/test_types.py); this, that they run.
    local: protocols.RankGroup = group.RankGroup([], "forkserver")
    threads: protocols.RankGroup = xla.ThreadHostGroup([], "forkserver")
    ray: protocols.RankGroup = RayRankGroup([], RayCluster())
    cluster: protocols.Cluster = RayCluster()
    assert all(isinstance(g, protocols.RankGroup) for g in (local, threads, ray))
    assert isinstance(cluster, protocols.Cluster) and cluster.start_method == "ray"
    assert not isinstance(object(), protocols.RankGroup)


def _rank_and_world() -> tuple[int, int]:
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def test_a_cluster_backend_is_asked_not_named() -> None:
    from nbaccel.launch.options import LaunchOptions
    from nbaccel.launch.plan import resolve_plan
    from tests.toy_cluster import ToyCluster

    plan = resolve_plan(
        _rank_and_world, (), {}, LaunchOptions(num_processes=2, cluster=ToyCluster())
    )
    assert plan.info.describe().endswith(", on a toy cluster"), plan.info.describe()
    assert plan.info.start_method == "spawn" and plan.info.device == "cpu"


@pytest.mark.slow
def test_a_toy_cluster_backend_runs_real_ranks() -> None:
    from tests.toy_cluster import ToyCluster

    cluster = ToyCluster()
    got = nbaccel.notebook_launcher(
        _rank_and_world, num_processes=2, cluster=cluster, return_all=True, progress=False
    )
    assert got == [(0, 2), (1, 2)]
    assert len(cluster.groups) == 1  # the launch asked the cluster for its group


def _says_hello() -> int:
    print(f"hello from {os.environ['RANK']}", flush=True)
    return 7


@pytest.mark.slow
def test_a_toy_view_shows_a_real_launch() -> None:
    from nbaccel.launch.protocols import View
    from tests.toy_view import ToyView

    view = ToyView()
    shown: View = view  # the type checker holds it to the View protocol
    assert nbaccel.notebook_launcher(_says_hello, num_processes=2, view=shown) == 7
    assert view.finished and view.state is not None and view.state.outcome == "finished"
    assert {r: lines for r, lines in view.lines.items()} == {
        0: ["hello from 0"],
        1: ["hello from 1"],
    }
