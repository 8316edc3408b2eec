"""Ranks on a real local Ray cluster (CPU): notebook_launcher(..., cluster=nbaccel.RayCluster()).

One head started here (``ray start --head``, its own temporary folder and ports) serves the
module; each test's launches run in a driver script (a kernel's stand-in, with the text view)
so that the Ray driver and its Ctrl-C are a process of their own. Ray's start is slow on two
cores: one cluster for the module, and ``ray stop`` plus a check by pid at its end.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import numpy as np
import psutil
import pytest

import nbaccel
from nbaccel.core import process_table
from nbaccel.core.rendezvous import free_port
from nbaccel.launch.options import LaunchOptions
from nbaccel.launch.plan import resolve_plan
from tests import netns_helpers

# The test clusters and their drivers agree on no token authentication: with RAY_AUTH_MODE
# unset, a token left in ~/.ray by any earlier local ray.init() turns it on for `ray start` but
# not for a driver's ray.init(address=...), which is then refused ("InvalidAuthToken").
RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}

if importlib.util.find_spec("ray") is None:  # pragma: no cover - the dev extra installs it
    pytest.skip("ray is not installed: pip install 'nbaccel[ray]'", allow_module_level=True)

RAY = str(Path(sys.executable).with_name("ray"))


def _noop():
    pass


@pytest.mark.parametrize(
    ("options", "error", "says"),
    [
        ({"cluster": object()}, TypeError, "cluster must be a cluster to run the ranks on"),
        ({"num_nodes": 2}, ValueError, "cluster= places the ranks itself"),
        ({"args": (np.zeros(1 << 20),)}, ValueError, "cannot reach a cluster's nodes"),
    ],
)
def test_bad_cluster_launches_are_refused_before_anything_starts(options, error, says):
    options = {"cluster": nbaccel.RayCluster(), "num_processes": 2, **options}
    with pytest.raises(error, match=says):
        nbaccel.notebook_launcher(_noop, **options)
    ray = sys.modules.get("ray")
    assert ray is None or not ray.is_initialized()  # nothing connected, nothing placed


def test_a_cluster_banner_names_no_local_port():
    plan = resolve_plan(_noop, (), {}, LaunchOptions(num_processes=2, cluster=nbaccel.RayCluster()))
    assert plan.info.describe().endswith(", on a Ray cluster"), plan.info.describe()
    assert plan.specs[0].transfer is None  # results come back pickled, not by /dev/shm
    assert "CUDA_VISIBLE_DEVICES" in plan.specs[0].env  # CPU ranks: gloo, no GPU


def _cluster_processes(temp_dir: str) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if any(temp_dir in part for part in p.info["cmdline"] or []):
                found.append(p)
        except psutil.Error:
            continue
    return found


def _ray_temp_dir() -> str:
    """A temporary folder for one Ray node, short enough for its Unix sockets: Ray puts
    ``session_<date>_<pid>/sockets/plasma_store`` below it, and a socket path over 107 bytes
    is refused (pytest's own folders, deeper under pytest-xdist, are too long)."""
    return tempfile.mkdtemp(prefix="nbray", dir="/tmp")


def _ray_start(
    run, argv: list[str], env: dict[str, str], temp_dir: str
) -> subprocess.CompletedProcess:
    """``ray start`` through ``run``, once more after a failed start: on a loaded 2-core
    machine Ray's own node startup sometimes times out ("node timed out during startup").
    Before the second try only what the failed start left in ``temp_dir`` is killed: ``ray
    stop --force`` would stop every Ray node of the machine (a namespace shares its process
    table), the module's other cluster too."""
    for attempt in range(2):
        started = run(argv, env=env, capture_output=True, text=True, timeout=180)
        if started.returncode == 0 or attempt:
            return started
        left = _cluster_processes(temp_dir)
        process_table.signal_all(left, signal.SIGKILL)
        psutil.wait_procs(left, timeout=10)
    return started


@pytest.fixture(scope="module")
def head():
    """The address of a one-node Ray cluster with 3 CPUs, stopped (and checked) at the end."""
    temp_dir = _ray_temp_dir()
    port = free_port()
    env = {**os.environ, **RAY_ENV}
    started = _ray_start(
        subprocess.run,
        [RAY, "start", "--head", f"--port={port}", "--num-cpus=3", "--num-gpus=0",
         "--include-dashboard=false", f"--temp-dir={temp_dir}", "--node-ip-address=127.0.0.1"],
        env,
        temp_dir,
    )  # fmt: skip
    try:
        assert started.returncode == 0, started.stdout + started.stderr
        yield f"127.0.0.1:{port}"
    finally:
        subprocess.run([RAY, "stop", "--force"], env=env, capture_output=True, timeout=120)
        left = _cluster_processes(temp_dir)
        psutil.wait_procs(left, timeout=10)
        left = [p for p in left if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        for p in left:
            p.kill()
        shutil.rmtree(temp_dir, ignore_errors=True)
        assert not left, f"ray processes left running: {left}"


def _driver(tmp_path: Path, head: str, body: str) -> subprocess.Popen:
    """Run ``body`` in a fresh driver (the kernel's stand-in) connected to ``head``."""
    script = tmp_path / "driver.py"
    script.write_text(
        "import nbaccel, os, sys, time\n"
        f"cluster = nbaccel.RayCluster(address={head!r})\n"
        "def main():\n" + textwrap.indent(textwrap.dedent(body), "    ") + "\n"
        "if __name__ == '__main__':\n    main()\n"
    )
    return subprocess.Popen(
        [sys.executable, str(script)],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, **RAY_ENV, "PYTHONUNBUFFERED": "1"},
    )


def _finish(proc: subprocess.Popen, timeout: float = 240) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"the driver did not finish in {timeout} s:\n{out}")
    assert proc.returncode == 0, out
    return out


@pytest.mark.slow
def test_two_ranks_all_reduce_print_return_and_a_failure_names_its_rank(head, tmp_path):
    out = _finish(
        _driver(
            tmp_path,
            head,
            """
            def work(x):
                import torch, torch.distributed as dist
                dist.init_process_group("gloo")
                t = torch.tensor([float(dist.get_rank() + x)])
                dist.all_reduce(t)
                print(f"hello from {dist.get_rank()} of {dist.get_world_size()}")
                for _ in nbaccel.progress(range(3), desc="steps"):
                    nbaccel.log({"loss": t.item()}, step=1)
                return t.item(), os.environ["LOCAL_RANK"], os.getpid()

            launch = nbaccel.notebook_launcher(
                work, args=(1,), num_processes=2, cluster=cluster, return_all=True,
                progress="text", block=False)
            values = launch.result()
            print("METRICS", launch.metrics(1))
            print("BARS", [(b.n, b.total) for b in launch.state.ranks[1].bars.values()])
            print("VALUES", [v[:2] for v in values])
            print("PIDS", [v[2] for v in values])

            def fails():
                import torch.distributed as dist
                dist.init_process_group("gloo")
                if dist.get_rank() == 1:
                    raise ValueError("bad shard on the second rank")
                dist.barrier()

            try:
                nbaccel.notebook_launcher(fails, num_processes=2, cluster=cluster,
                                          progress="text")
            except nbaccel.RankFailedError as exc:
                print("FAILED rank", exc.rank, "|", str(exc).replace(chr(10), " / "))
            """,
        )
    )
    assert "VALUES [(3.0, '0'), (3.0, '1')]" in out, out
    assert "SIGTERM handler" not in out, out  # Ray's warning when block=False connects
    assert "METRICS [{'step': 1, 'loss': 3.0}" in out, out  # rank 1's, relayed from its node
    assert "BARS [(3, 3)]" in out, out
    for rank in (0, 1):
        assert f"[rank{rank}] hello from {rank} of 2" in out, out
    pids = eval(out.split("PIDS ", 1)[1].splitlines()[0])
    assert not [p for p in pids if psutil.pid_exists(p)], "ranks still running after the launch"
    failed = out.split("FAILED rank ", 1)[1].splitlines()[0]
    assert failed.startswith("1 |"), out
    assert "ValueError: bad shard on the second rank" in failed, out
    assert 'raise ValueError("bad shard on the second rank")' in failed, failed  # traceback


def _wait_for_line(proc: subprocess.Popen, prefix: str, timeout: float = 180) -> str:
    """Read the driver's output until a line starts with ``prefix``; that line."""
    seen = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line)
        if line.startswith(prefix):
            return line
    proc.kill()
    pytest.fail(f"no {prefix!r} line from the driver:\n{''.join(seen)}")


RUNS_LONG = """
def sleeper():
    print("PID", os.getpid(), flush=True)
    open(f"started-{os.getpid()}", "w").close()  # the kernel's cwd: this machine's, here
    time.sleep(600)

def interrupt_when_started():
    import glob, signal
    while len(glob.glob("started-*")) < 2:
        time.sleep(0.1)
    os.kill(os.getpid(), signal.SIGINT)

def pids_of(launch):
    while launch.state is None or len([r for r in launch.state.ranks.values() if r.pid]) < 2:
        time.sleep(0.1)
    return sorted(r.pid for r in launch.state.ranks.values())
"""


@pytest.mark.slow
def test_stop_and_ctrl_c_and_kernel_death_leave_no_rank_running(head, tmp_path):
    # stop() of a background launch, then Ctrl-C in a blocking one
    proc = _driver(
        tmp_path,
        head,
        RUNS_LONG
        + """
launch = nbaccel.notebook_launcher(sleeper, num_processes=2, cluster=cluster,
                                   progress=False, block=False)
print("STOPPING", pids_of(launch), flush=True)
launch.stop()
print("STOPPED", launch.status, flush=True)
import glob, threading
for f in glob.glob("started-*"):  # the stopped launch's
    os.remove(f)
threading.Thread(target=interrupt_when_started, daemon=True).start()
try:
    nbaccel.notebook_launcher(sleeper, num_processes=2, cluster=cluster, progress="text")
except KeyboardInterrupt as exc:
    print("INTERRUPTED", exc, flush=True)
""",
    )
    pids = eval(_wait_for_line(proc, "STOPPING").split(" ", 1)[1])
    assert _wait_for_line(proc, "STOPPED").split()[1] == "interrupted"
    assert not [p for p in pids if psutil.pid_exists(p)], f"stop() left ranks {pids} running"
    out = _finish(proc)
    interrupted = [int(pid) for pid in re.findall(r"\[rank\d\] PID (\d+)", out)]
    assert "INTERRUPTED launch interrupted; all 2 ranks were stopped" in out, out
    assert len(interrupted) == 2, out
    assert not [p for p in interrupted if psutil.pid_exists(p)], "Ctrl-C left ranks running"

    # the kernel dies (SIGKILL): its ranks on the cluster go too
    proc = _driver(
        tmp_path,
        head,
        RUNS_LONG
        + """
launch = nbaccel.notebook_launcher(sleeper, num_processes=2, cluster=cluster,
                                   progress=False, block=False)
print("RUNNING", pids_of(launch), flush=True)
time.sleep(600)
""",
    )
    pids = eval(_wait_for_line(proc, "RUNNING").split(" ", 1)[1])
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    gone = psutil.wait_procs([psutil.Process(p) for p in pids if psutil.pid_exists(p)], 30)[1]
    assert not gone, f"ranks {gone} outlived their kernel"


@pytest.fixture(scope="module")
def two_nodes():
    """(net, head address) of a Ray cluster of two nodes, a head and a worker, each a host of
    its own (network namespaces); everything in them is killed at the end, checked by pid."""
    reason = netns_helpers.unavailable()
    if reason:
        pytest.skip(f"no network namespaces here: {reason}")
    try:
        net = netns_helpers.Network.hosts(2)
    except OSError as exc:
        pytest.skip(f"no network namespaces here: {exc}")
    env = {**os.environ, **RAY_ENV}
    head = f"{net.address(0)}:6379"
    temps: list[str] = []
    try:
        for host, role in ((0, ["--head", "--port=6379", "--include-dashboard=false"]),
                           (1, [f"--address={head}"])):  # fmt: skip
            temps.append(_ray_temp_dir())
            started = _ray_start(
                functools.partial(net.run, host),
                [RAY, "start", *role, "--num-cpus=1", "--num-gpus=0", f"--temp-dir={temps[-1]}",
                 f"--node-ip-address={net.address(host)}"],
                env,
                temps[-1],
            )  # fmt: skip
            assert started.returncode == 0, started.stdout + started.stderr
        yield net, head
    finally:
        net.close()  # kills every process of both nodes, by pid
        for temp in temps:
            shutil.rmtree(temp, ignore_errors=True)
        left = net.still_running(timeout=1)
        assert net.left() == [] and left == [], f"left behind: {net.left()} {left}"


@pytest.mark.slow
def test_two_nodes_a_rank_failing_on_the_worker_node_is_named_with_its_traceback(
    two_nodes, tmp_path
):
    net, head = two_nodes
    worker = net.address(1)
    body = f"""
    def work(worker):
        import psutil, torch, torch.distributed as dist
        dist.init_process_group("gloo")
        here = [a.address for addrs in psutil.net_if_addrs().values() for a in addrs]
        t = torch.ones(1)
        dist.all_reduce(t)
        print(f"sum {{t.item()}} on", "worker" if worker in here else "head")
        if worker in here:
            raise RuntimeError("the worker node's shard is missing")
        dist.barrier()

    try:
        nbaccel.notebook_launcher(work, args=({worker!r},), num_processes=2, progress="text",
                                  cluster=nbaccel.RayCluster({head!r}, strategy="STRICT_SPREAD"))
    except nbaccel.RankFailedError as exc:
        print("FAILED rank", exc.rank, "|", str(exc).replace(chr(10), " / "))
    """
    script = tmp_path / "driver.py"
    script.write_text("import nbaccel\ndef main():\n" + textwrap.indent(textwrap.dedent(body), "    ")
                      + "\nif __name__ == '__main__':\n    main()\n")  # fmt: skip
    env = {**os.environ, **RAY_ENV, "PYTHONUNBUFFERED": "1"}
    out = _finish(
        net.popen(0, [sys.executable, str(script)], cwd=tmp_path, env=env, text=True,
                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    )  # fmt: skip
    assert "sum 2.0 on head" in out and "sum 2.0 on worker" in out, out
    failed = out.split("FAILED rank ", 1)[1].splitlines()[0]
    assert "RuntimeError: the worker node's shard is missing" in failed, out
    assert 'raise RuntimeError("the worker node' in failed, failed  # its traceback


@pytest.mark.slow
def test_from_a_real_kernel_a_cells_function_runs_on_the_cluster_and_fails_by_rank(head):
    """The notebook experience: a function defined in a cell, launched on the cluster from a
    real ipykernel; its lines reach the cell labelled, its value comes back, and a rank that
    raises is named with the cell's own traceback."""
    from tests.kernel_helpers import KernelSession

    env = {**RAY_ENV, "NBACCEL_VIEW": "text"}
    with KernelSession(env=env, startup="import nbaccel") as kernel:
        code = textwrap.dedent(f"""
            cluster = nbaccel.RayCluster(address={head!r})

            def work(scale):
                import torch, torch.distributed as dist
                dist.init_process_group("gloo")
                t = torch.tensor([float(dist.get_rank() + 1)])
                dist.all_reduce(t)
                print(f"sum {{t.item()}} on rank {{dist.get_rank()}}")
                if scale < 0 and dist.get_rank() == 1:
                    raise ValueError("negative scale on rank 1")
                return t.item() * scale

            nbaccel.notebook_launcher(work, args=(10,), num_processes=2, cluster=cluster)
        """).strip()
        cell = kernel.execute(code, timeout=240)
        assert cell.error is None, cell.error_text
        assert cell.results[-1]["text/plain"] == "30.0"
        assert "[rank0] sum 3.0 on rank 0" in cell.stdout, cell.stdout
        assert "[rank1] sum 3.0 on rank 1" in cell.stdout, cell.stdout
        failed = kernel.execute(
            "nbaccel.notebook_launcher(work, args=(-1,), num_processes=2, cluster=cluster)",
            timeout=240,
        )
        assert failed.error is not None and failed.error["ename"] == "RankFailedError"
        text = failed.error_text
        assert "rank 1 (of 2) raised ValueError: negative scale on rank 1" in text, text
        assert 'raise ValueError("negative scale on rank 1")' in text, text
        assert kernel.leftovers() == []
