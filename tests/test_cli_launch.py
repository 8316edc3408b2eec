"""``nbaccel launch`` end to end: the real command, real torch.distributed.run underneath."""

from __future__ import annotations

import json
import textwrap

import pytest

import nbaccel
from tests.test_cli_support import free_port, processes_mentioning, run_cli, start_cli

# One training-like function, run both as a script under `nbaccel launch` and through
# notebook_launcher; both must give the same numbers.
JOB = textwrap.dedent(
    """
    import os

    def compute(scale):
        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        torch.manual_seed(rank)
        value = torch.randn(3) * scale
        dist.all_reduce(value)
        dist.destroy_process_group()
        print(f"rank {rank} of {world} done")
        env = {k: os.environ.get(k) for k in (
            "NBACCEL_MIXED_PRECISION", "NBACCEL_STRATEGY",
            "NBACCEL_GRADIENT_ACCUMULATION_STEPS", "NBACCEL_LAUNCHER", "OMP_NUM_THREADS")}
        return {"rank": rank, "world": world, "sum": value.tolist(), "env": env}
    """
)

SCRIPT_MAIN = textwrap.dedent(
    """
    if __name__ == "__main__":
        import json, sys
        out = compute(float(sys.argv[2]))
        with open(f"{sys.argv[1]}/rank{out['rank']}.json", "w") as f:
            json.dump(out, f)
    """
)


def _compute_function():
    # exec'd in a namespace of its own, so cloudpickle sends it by value to notebook ranks.
    namespace = {"__name__": "nbaccel_cli_test_job"}
    exec(compile(JOB, "<job>", "exec"), namespace)
    return namespace["compute"]


@pytest.mark.slow
def test_launch_two_processes_matches_notebook(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(JOB + SCRIPT_MAIN)
    config = tmp_path / "cfg.yaml"
    nbaccel.LaunchConfig(num_processes=1, gradient_accumulation_steps=4, strategy="fsdp").save(
        config
    )
    result = run_cli(
        "launch",
        "--config_file",
        str(config),
        "--num_processes",
        "2",
        "--strategy",
        "ddp",
        str(script),
        str(tmp_path),
        "0.5",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert "[rank0] rank 0 of 2 done" in lines and "[rank1] rank 1 of 2 done" in lines
    cli = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert cli[0]["env"] == {
        "NBACCEL_MIXED_PRECISION": "no",
        "NBACCEL_STRATEGY": "ddp",  # the flag beats the file
        "NBACCEL_GRADIENT_ACCUMULATION_STEPS": "4",  # from the file
        "NBACCEL_LAUNCHER": "cli",
        "OMP_NUM_THREADS": cli[0]["env"]["OMP_NUM_THREADS"],
    }
    assert int(cli[0]["env"]["OMP_NUM_THREADS"]) >= 1

    notebook = nbaccel.notebook_launcher(
        _compute_function(), args=(0.5,), num_processes=2, return_all=True, progress=False
    )
    for from_cli, from_notebook in zip(cli, notebook):
        assert from_cli["world"] == from_notebook["world"] == 2
        assert from_cli["sum"] == pytest.approx(from_notebook["sum"])
    assert not processes_mentioning(str(script))


@pytest.mark.slow
def test_failing_rank_is_named_with_its_traceback(tmp_path):
    script = tmp_path / "broken.py"
    script.write_text(
        textwrap.dedent(
            """
            import torch.distributed as dist

            def check(rank):
                if rank == 1:
                    raise ValueError(f"bad batch on rank {rank}")

            dist.init_process_group("gloo")
            print("started", flush=True)
            check(dist.get_rank())
            dist.barrier()
            """
        )
    )
    result = run_cli("launch", "--num_processes", "2", str(script), cwd=tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "nbaccel launch: rank 1 (of 2) raised ValueError: bad batch on rank 1" in result.stderr
    assert "--- rank 1 traceback ---" in result.stderr
    assert 'raise ValueError(f"bad batch on rank {rank}")' in result.stderr
    assert "_script_entry" not in result.stderr  # the traceback starts at the user's code
    assert "ChildFailedError" not in result.stdout + result.stderr
    assert "[rank0] started" in result.stdout
    assert not processes_mentioning(str(script))


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["static", "c10d"])
def test_two_machines_on_one_host_form_one_world(tmp_path, backend):
    script = tmp_path / "allreduce.py"
    script.write_text(
        textwrap.dedent(
            """
            import torch, torch.distributed as dist
            dist.init_process_group("gloo")
            t = torch.tensor([float(dist.get_rank() + 1)])
            dist.all_reduce(t)
            print(f"world {dist.get_world_size()} sum {t.item():g}")
            dist.destroy_process_group()
            """
        )
    )
    port = str(free_port())
    common = ["--num_processes", "1", "--num_machines", "2", "--main_process_port", port]
    common += ["--rdzv_backend", backend]  # c10d: both would host its store on loopback
    machines = [
        start_cli("launch", *common, "--machine_rank", str(m), str(script), cwd=tmp_path)
        for m in (0, 1)
    ]
    outputs = []
    try:
        for proc in machines:
            out, err = proc.communicate(timeout=120)
            outputs.append((proc.returncode, out, err))
    finally:
        for proc in machines:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for rank, (code, out, err) in enumerate(outputs):
        assert code == 0, out + err
        assert f"[rank{rank}] world 2 sum 3" in out.splitlines()
    assert not processes_mentioning(str(script))


def test_bad_input_starts_nothing(tmp_path):
    missing = run_cli("launch", "--num_processes", "2", "missing.py", cwd=tmp_path)
    assert missing.returncode == 2
    assert "no such script: missing.py" in missing.stderr

    (tmp_path / "ok.py").write_text("print('hi')\n")
    no_port = run_cli("launch", "--num_machines", "2", "ok.py", cwd=tmp_path)
    assert no_port.returncode == 2
    assert "--main_process_port is required" in no_port.stderr

    broken = tmp_path / "broken.yaml"
    broken.write_text("num_processes: 2\nprecision: bf16\n")
    bad_file = run_cli("launch", "--config_file", str(broken), "ok.py", cwd=tmp_path)
    assert bad_file.returncode == 2
    assert f"{broken}, line 2: unknown key 'precision'" in bad_file.stderr
    assert "launching" not in bad_file.stdout

    too_many = run_cli("launch", "--num_processes", "10000", "ok.py", cwd=tmp_path)
    assert too_many.returncode == 2 and "launching" not in too_many.stdout
    assert "nbaccel launch: error: --num_processes=10000 CPU processes" in too_many.stderr

    no_host = run_cli("launch", "--main_process_ip", "no.such.host.invalid", "ok.py", cwd=tmp_path)
    assert no_host.returncode == 2 and "Traceback" not in no_host.stderr
    assert "--main_process_ip='no.such.host.invalid' cannot be used" in no_host.stderr


@pytest.mark.slow
def test_tqdm_bars_become_whole_labelled_lines(tmp_path):
    """Carriage-return redraws would garble the per-rank labelled lines; bars print lines."""
    script = tmp_path / "bars.py"
    script.write_text(
        "from tqdm import tqdm\nfor _ in tqdm(range(30), desc='work'):\n    pass\nprint('done')\n"
    )
    result = run_cli("launch", "--num_processes", "2", "bars.py", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = (result.stdout + result.stderr).splitlines()
    labelled = [line for line in lines if line.startswith("[rank")]
    for line in labelled:
        label, _, text = line.partition("] ")
        assert label in ("[rank0", "[rank1") and text.strip(), f"garbled line: {line!r}"
        assert "[rank" not in text and "\r" not in text, f"two ranks on one line: {line!r}"
    for rank in (0, 1):
        assert any(
            line.startswith(f"[rank{rank}] work: 100%") and "30/30" in line for line in lines
        )
        assert f"[rank{rank}] done" in lines


@pytest.mark.slow
def test_eight_restarts_in_a_row(tmp_path):
    """Each attempt's group forms afresh: elastic's one store for every attempt gave the next
    group the last one's gloo addresses (Connection refused) or barrier counts (a hang), from
    the first restart on; eight (each starts both ranks afresh, ~1.5 s) show no drift."""
    script = tmp_path / "flaky.py"
    script.write_text(
        textwrap.dedent(
            """
            import os
            import torch, torch.distributed as dist
            attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
            dist.init_process_group("gloo")
            t = torch.ones(1)
            dist.all_reduce(t)  # the mesh of this attempt works
            if attempt < 8 and dist.get_rank() == attempt % 2:
                raise SystemExit(f"fails on attempt {attempt}")
            print(f"attempt {attempt} sum {t.item():g}")
            """
        )
    )
    # torchrun's flag names, as a torchrun command line would give them
    args = ("--nproc-per-node", "2", "--max-restarts", "8", str(script))
    result = run_cli("launch", *args, cwd=tmp_path, timeout=400)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "[rank0] attempt 8 sum 2" in result.stdout.splitlines()
    assert not processes_mentioning(str(script))
