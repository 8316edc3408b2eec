"""The package layout keeps its promises: each layer imports only what it may, and no cycles.

Read from the source with ``ast`` (every import, also those inside functions), so a violation
fails here before it can load a kernel-side module inside a rank.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "nbaccel"

# package -> the nbaccel packages it may import (besides itself).
ALLOWED = {
    "core": set(),
    "rank": {"core"},
    "training": {"core", "rank"},
    "utils": {"core", "rank", "training"},  # accelerate.utils's names; training side
    # The views render the launch's model and implement its View protocol; the launch never
    # imports them (the launcher, nbaccel.launchers, hands it its view).
    "ui": {"core", "launch"},
    "launch": {"core", "forkserver"},
    "cli": {"core", "rank", "training", "ui", "launch"},
    # Kernel side (ray_cluster, ray_group) and a node's side (node, remote_entry: core, rank).
    "cluster": {"core", "rank", "launch", "ui"},
    # The fork server: the kernel's side (server, mirror) and the server's (guard, preload, ...).
    "forkserver": {"core", "rank"},
    # Persistent ranks: the kernel's side (session, magics, ...) and the rank's (serve, messages).
    "persistent": {"core", "rank", "launch", "ui"},
}
# Modules of a two-sided package that run in a rank or the fork server: only these packages.
SIDES = {
    "nbaccel.forkserver.guard": {"core", "rank", "forkserver"},
    "nbaccel.forkserver.preload": {"core", "rank", "forkserver"},
    "nbaccel.forkserver.importer": {"core", "rank", "forkserver"},
    "nbaccel.forkserver.ready": {"core", "rank", "forkserver"},
    "nbaccel.forkserver.log": {"core", "rank", "forkserver"},
    "nbaccel.forkserver.launching_script": {"core", "rank", "forkserver"},
    "nbaccel.forkserver.protocol": {"core"},
    "nbaccel.persistent.serve": {"core", "rank", "persistent"},
    "nbaccel.persistent.messages": {"core"},
}
# Single modules a layer may import outside its allowance, each with the reason.
EXCEPTIONS = {
    # The kernel hands this function to multiprocessing as the rank's entry point.
    ("launch", "nbaccel.rank.entry"),
    # XLA devices as threads: the kernel names this host process as the ranks' entry point.
    ("launch", "nbaccel.rank.xla"),
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every nbaccel module ``path`` imports, resolved to the most specific existing module."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                candidate = f"{node.module}.{alias.name}"
                found.add(candidate if _exists(candidate) else node.module)
    return {name for name in found if name == "nbaccel" or name.startswith("nbaccel.")}


def _exists(module: str) -> bool:
    rel = Path(*module.split("."))
    base = PACKAGE.parent / rel
    return base.with_suffix(".py").exists() or (base / "__init__.py").exists()


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in ALLOWED else None


@pytest.mark.parametrize("module", sorted(m for m in _modules() if _layer(m)))
def test_each_layer_imports_only_what_it_may(module):
    layer = _layer(module)
    bad = []
    for target in _imports(_modules()[module]):
        target_layer = _layer(target)
        if target == "nbaccel" and layer != "cli":
            bad.append(f"{target} (the top-level package: import the module that defines it)")
        elif target == "nbaccel" or target_layer in (None, layer) or target_layer in ALLOWED[layer]:
            continue
        elif (layer, target) not in EXCEPTIONS:
            bad.append(target)
    assert not bad, f"{module} ({layer}) may not import {bad}; allowed: {sorted(ALLOWED[layer])}"


@pytest.mark.parametrize("module", sorted(SIDES))
def test_the_rank_side_of_a_two_sided_package_stays_on_its_side(module):
    """A module that runs in a rank or in the fork server never loads the kernel's side (the
    launcher, views, IPython) even though its package's kernel side may."""
    bad = sorted(t for t in _imports(_modules()[module]) if _layer(t) not in SIDES[module])
    assert not bad, f"{module} runs outside the kernel and may not import {bad}"


def test_no_import_cycles():
    modules = _modules()
    graph = {m: {t for t in _imports(p) if t in modules and t != m} for m, p in modules.items()}
    # A package's __init__ imported for its submodule is not a real edge back to it.
    for m, targets in graph.items():
        graph[m] = {t for t in targets if not m.startswith(t + ".")}
    cycles, state = [], {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycles.append(path[path.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_no_cycles_between_packages():
    """No package imports one that imports it back, directly or through others: each arrow of
    the package graph (a top-level module is a node of its own) points down. The process
    targets (``EXCEPTIONS``) count too."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        source = _layer(module) or module
        for target in _imports(path):
            if target in modules and target != "nbaccel":
                graph.setdefault(source, set()).add(_layer(target) or target)
    for source in graph:
        graph[source].discard(source)
    cycles, state = [], {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                cycles.append(path[path.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not cycles, "package cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_every_package_says_its_job_and_what_it_may_import():
    for layer in ALLOWED:
        doc = ast.get_docstring(ast.parse((PACKAGE / layer / "__init__.py").read_text()))
        assert doc, f"nbaccel/{layer}/__init__.py has no docstring"
        if layer != "core":
            assert "May import" in doc, (
                f"nbaccel/{layer}/__init__.py does not say what it may import"
            )


def test_every_module_says_its_job():
    missing = [m for m, p in _modules().items() if not ast.get_docstring(ast.parse(p.read_text()))]
    assert not missing, f"modules without a docstring: {missing}"


# The one event loop (launch.loop.follow, driven by launch.Launch and %ranks cells alike) is the
# only place that waits on the ranks' pipes; these bounded waits are not loops of a launch.
WAITS_OUTSIDE_THE_LOOP = {
    "nbaccel.launch.loop": "the loop",
    "nbaccel.launch.relay": "collect_stacks: up to 2 s for stack dumps, inside a job's timeout",
    "nbaccel.persistent.start": "accept_ranks: the command sockets, before any job runs",
    "nbaccel.forkserver.mirror": "the fork server's mirror socket, not the ranks' pipes",
}


def test_one_event_loop_waits_on_the_ranks():
    bad = []
    for module, path in _modules().items():
        if not module.startswith("nbaccel.launch.") or module in WAITS_OUTSIDE_THE_LOOP:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute) and node.attr == "select":
                bad.append(f"{module}:{node.lineno}")
    assert not bad, f"selector waits outside launch.loop (a second event loop?): {bad}"


def test_a_ranks_status_is_set_only_by_rank_state_move():
    """``RankState.move`` is the state machine: nothing else assigns a rank's ``status``."""
    bad = []
    for module, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets = node.targets if isinstance(node, ast.Assign) else []
            for target in targets:
                for t in target.elts if isinstance(target, ast.Tuple) else [target]:
                    if not (isinstance(t, ast.Attribute) and t.attr == "status"):
                        continue
                    own = isinstance(t.value, ast.Name) and t.value.id == "self"
                    if not own or module not in (
                        "nbaccel.launch.state",
                        "nbaccel.ui.config_panel",
                    ):
                        bad.append(f"{module}:{node.lineno}")
    assert not bad, f"a rank's status set outside RankState.move: {bad}"


# ... and launch.protocols declares a cluster's make_group (it builds none)
MAKERS_OF_GROUPS = ("nbaccel.launch.xla", "nbaccel.cluster.ray_cluster", "nbaccel.launch.protocols")


def test_ranks_have_one_start_and_one_teardown():
    """A launch's attempts and ``%ranks`` sessions start and tear down their ranks through
    ``launch.lifecycle.RankLifecycle``: nothing else in nbaccel builds a rank group (XLA's
    ``make_group`` picks the kind, a cluster's (``cluster.ray_cluster``) makes its own)."""
    owners = set()
    for module, path in _modules().items():
        text = path.read_text(encoding="utf-8")
        builds = "make_group(" in text or re.search(r"\bRankGroup\(", text)
        if builds and module not in MAKERS_OF_GROUPS and module != "nbaccel.launch.group":
            owners.add(module)
    assert owners == {"nbaccel.launch.lifecycle"}, owners
