"""notebook_launcher from a plain ``python script.py``, and what happens when the launcher dies."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import psutil
import pytest

pytestmark = pytest.mark.slow  # every test runs python scripts that launch ranks

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_script(path, timeout=180):
    env = {**os.environ, "PYTHONPATH": REPO}
    return subprocess.run(
        [sys.executable, str(path)], capture_output=True, text=True, timeout=timeout, env=env
    )


def test_plain_script_with_main_guard(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent("""
        import nbaccel

        def train(base):
            import torch.distributed as dist
            dist.init_process_group("gloo")
            print("hello from", dist.get_rank())
            return base + dist.get_world_size()

        if __name__ == "__main__":
            print("RESULT", nbaccel.notebook_launcher(train, args=(40,), num_processes=2))
    """)
    )
    done = run_script(script)
    assert done.returncode == 0, done.stderr
    assert "[rank0] hello from 0" in done.stdout
    assert "[rank1] hello from 1" in done.stdout
    assert "RESULT 42" in done.stdout


def test_a_script_without_a_main_guard_runs_its_top_level_once(tmp_path):
    # As under Accelerate's launcher (a fork): the ranks do not run the script again, so its
    # banner prints once, its data loads once, and the launch needs no guard (it launched again
    # inside every rank: multiprocessing's bootstrapping error, 150 lines of it).
    script = tmp_path / "noguard.py"
    script.write_text(
        textwrap.dedent("""
        import os
        import nbaccel

        print("TOP LEVEL in", os.getpid())
        SCALE = 3

        class Scaler:
            def __call__(self, v):
                return v * SCALE

        def train(v):
            import pickle, torch.distributed as dist
            dist.init_process_group("gloo")
            again = pickle.loads(pickle.dumps(Scaler()))  # found in __main__ by reference
            return again(v) + dist.get_world_size()

        print("RESULT", nbaccel.notebook_launcher(train, args=(10,), num_processes=2))
    """)
    )
    done = run_script(script)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("TOP LEVEL in") == 1, done.stdout
    assert "RESULT 32" in done.stdout
    assert "bootstrapping" not in done.stderr


def test_spawned_ranks_of_a_script_without_a_guard_say_what_to_add(tmp_path):
    script = tmp_path / "noguard_spawn.py"
    script.write_text(
        "import nbaccel\n\ndef train():\n    return 1\n\n"
        "nbaccel.notebook_launcher(train, num_processes=2, start_method='spawn')\n"
    )
    done = run_script(script)
    assert done.returncode != 0
    assert "Put the call under `if __name__ == '__main__':`" in done.stdout + done.stderr
    assert "bootstrapping phase" not in done.stderr


def test_failing_script_exits_nonzero_naming_the_rank(tmp_path):
    script = tmp_path / "fails.py"
    script.write_text(
        textwrap.dedent("""
        import os, nbaccel

        def train():
            if os.environ["RANK"] == "1":
                raise RuntimeError("out of data")

        if __name__ == "__main__":
            nbaccel.notebook_launcher(train, num_processes=2)
    """)
    )
    done = run_script(script)
    assert done.returncode == 1
    assert "rank 1 (of 2) raised RuntimeError: out of data" in done.stderr
    assert 'raise RuntimeError("out of data")' in done.stderr


def test_ranks_die_with_the_launching_process(tmp_path):
    """SIGKILL the process that launched (as if the kernel died): no rank may survive it."""
    script = tmp_path / "killed.py"
    script.write_text(
        textwrap.dedent("""
        import os, time, nbaccel

        def train():
            print("rank pid", os.getpid(), flush=True)
            time.sleep(600)

        if __name__ == "__main__":
            nbaccel.notebook_launcher(train, num_processes=2)
    """)
    )
    env = {**os.environ, "PYTHONPATH": REPO, "PYTHONUNBUFFERED": "1"}
    launcher = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env
    )
    rank_pids = []
    try:
        for line in launcher.stdout:
            if "rank pid" in line:
                rank_pids.append(int(line.split()[-1]))
            if len(rank_pids) == 2:
                break
        server = [
            c
            for c in psutil.Process(launcher.pid).children(recursive=True)
            if c.pid not in rank_pids
        ]
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(timeout=30)
    finally:
        launcher.kill()
        launcher.stdout.close()
    ranks = [psutil.Process(p) for p in rank_pids if psutil.pid_exists(p)]
    gone, alive = psutil.wait_procs(ranks + server, timeout=30)
    assert not alive, f"still running after the launcher died: {alive}"
    assert len(rank_pids) == 2


def test_two_nodes_on_one_host_form_one_world(tmp_path):
    """Two launching processes, one rank each, node_rank 0 and 1, meet on an explicit port."""
    from nbaccel.core.rendezvous import free_port

    port = free_port()
    script = tmp_path / "node.py"
    script.write_text(
        textwrap.dedent("""
        import sys, nbaccel

        def train():
            import torch, torch.distributed as dist
            dist.init_process_group("gloo")
            value = torch.tensor([float(dist.get_rank() + 1)])
            dist.all_reduce(value)
            return (dist.get_rank(), dist.get_world_size(), value.item())

        if __name__ == "__main__":
            node = int(sys.argv[1])
            result = nbaccel.notebook_launcher(train, num_processes=1, num_nodes=2, node_rank=node,
                                               use_port=int(sys.argv[2]), timeout=120, return_all=True)
            print("RESULT", result)
    """)
    )
    env = {**os.environ, "PYTHONPATH": REPO, "GLOO_SOCKET_IFNAME": "lo"}
    nodes = [
        subprocess.Popen(
            [sys.executable, str(script), str(n), str(port)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for n in (0, 1)
    ]
    outputs = [n.communicate(timeout=180) for n in nodes]
    for node, (_, err) in zip(nodes, outputs):
        assert node.returncode == 0, err
    assert "RESULT [(0, 2, 3.0)]" in outputs[0][0]
    assert "RESULT [(1, 2, 3.0)]" in outputs[1][0]
