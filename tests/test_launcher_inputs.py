"""Bad input to notebook_launcher gets a clear error and starts nothing."""

from __future__ import annotations

import functools
import multiprocessing
import os
import resource
import socket
import threading

import psutil
import pytest

import nbaccel


def noop():
    return None


def children_now() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


@pytest.fixture
def starts_nothing():
    before = children_now()
    yield
    assert children_now() <= before, "a rejected launch started processes"


@pytest.mark.usefixtures("starts_nothing")
class TestRejectedBeforeStarting:
    def test_num_processes_below_one(self):
        with pytest.raises(ValueError, match="num_processes must be at least 1, got 0"):
            nbaccel.notebook_launcher(noop, num_processes=0)

    def test_num_processes_not_an_int(self):
        with pytest.raises(TypeError, match="num_processes must be an integer"):
            nbaccel.notebook_launcher(noop, num_processes="2")

    def test_function_not_callable(self):
        with pytest.raises(TypeError, match="function must be callable.*got int"):
            nbaccel.notebook_launcher(42, num_processes=1)

    def test_unpicklable_argument_is_named(self):
        lock = threading.Lock()
        with pytest.raises(TypeError, match=r"args\[1\] \(lock\) cannot be sent to the ranks"):
            nbaccel.notebook_launcher(noop, args=(1, lock), num_processes=1)

    def test_unpicklable_global_of_the_function(self):
        lock = threading.Lock()

        def uses_lock():
            return lock.locked()

        with pytest.raises(TypeError, match="the function .*uses_lock cannot be sent"):
            nbaccel.notebook_launcher(uses_lock, num_processes=1)

    def test_a_multiprocessing_queue_is_refused_with_what_to_use(self):
        # Accelerate's test_fault_tolerant passes one: its ranks are forks of the caller.
        queue = multiprocessing.get_context("fork").Queue()
        use = r"fork server, not forked from this process.*`manager = multiprocessing.Manager\(\)`"
        with pytest.raises(TypeError, match=r"args\[0\] \(Queue\) cannot be sent.*" + use):
            nbaccel.notebook_launcher(noop, args=(queue,), num_processes=2)

        def puts():
            queue.put(1)

        with pytest.raises(TypeError, match=r"the function .*puts cannot be sent.*" + use):
            nbaccel.notebook_launcher(puts, num_processes=2)

    def test_a_generator_function_is_refused_with_what_to_write(self):
        def steps():
            yield 1

        with pytest.raises(TypeError, match=r"steps is a generator function.*Return the values"):
            nbaccel.notebook_launcher(steps, num_processes=2)

    @pytest.mark.parametrize("block", [True, False])
    def test_an_async_function_is_refused_with_what_to_write(self, block):
        async def train(lr):
            return lr

        with pytest.raises(TypeError, match=r"train is an async function.*asyncio.run"):
            nbaccel.notebook_launcher(functools.partial(train, 0.1), num_processes=2, block=block)

    def test_an_async_generator_function_is_refused(self):
        async def stream():
            yield 1

        with pytest.raises(TypeError, match=r"stream is an async generator function"):
            nbaccel.notebook_launcher(stream, num_processes=2)

    def test_unknown_mixed_precision_lists_choices(self):
        with pytest.raises(ValueError, match="'fp4'.*'no', 'fp16', 'bf16', 'fp8'"):
            nbaccel.notebook_launcher(noop, num_processes=1, mixed_precision="fp4")

    def test_unknown_start_method_lists_choices(self):
        with pytest.raises(ValueError, match="start_method='vfork'.*'forkserver'"):
            nbaccel.notebook_launcher(noop, num_processes=1, start_method="vfork")

    def test_fp8_without_a_gpu(self):
        with pytest.raises(ValueError, match="fp8.*use 'bf16' on CPU"):
            nbaccel.notebook_launcher(noop, num_processes=1, mixed_precision="fp8")

    def test_port_already_in_use(self):
        with socket.socket() as busy:
            busy.bind(("127.0.0.1", 0))
            busy.listen()
            port = busy.getsockname()[1]
            with pytest.raises(ValueError, match=f"port {port} on 127.0.0.1 is not available"):
                nbaccel.notebook_launcher(noop, num_processes=1, use_port=port)

    def test_bad_port_value(self):
        with pytest.raises(ValueError, match="use_port must be 'auto' or a port number"):
            nbaccel.notebook_launcher(noop, num_processes=1, use_port="http")

    def test_auto_port_across_machines(self):
        with pytest.raises(ValueError, match="same port"):
            nbaccel.notebook_launcher(noop, num_processes=1, num_nodes=2, node_rank=1)

    def test_args_must_be_a_sequence(self):
        with pytest.raises(TypeError, match="args must be a tuple or list"):
            nbaccel.notebook_launcher(noop, args="abc", num_processes=1)

    def test_kwargs_must_be_a_dict(self):
        with pytest.raises(TypeError, match=r"kwargs must be a dict .*got list\.$"):
            nbaccel.notebook_launcher(noop, kwargs=[1], num_processes=1)

    def test_master_addr_that_does_not_resolve(self):
        with pytest.raises(ValueError, match=r"master_addr='no.such.host.invalid' cannot be used"):
            nbaccel.notebook_launcher(noop, num_processes=1, master_addr="no.such.host.invalid")

    def test_far_more_cpu_processes_than_cores(self, monkeypatch):
        monkeypatch.delenv("NBACCEL_MAX_CPU_PROCESSES", raising=False)
        cap = 16 * (os.cpu_count() or 1)
        with pytest.raises(ValueError, match=f"Start at most {cap}, or set NBACCEL_MAX_CPU_"):
            nbaccel.notebook_launcher(noop, num_processes=cap + 1)
        with pytest.raises(ValueError, match="num_processes=10000 CPU processes"):
            nbaccel.notebook_launcher(noop, num_processes=10_000)

    def test_more_processes_than_open_files_allow(self, monkeypatch):
        monkeypatch.setenv("NBACCEL_MAX_CPU_PROCESSES", "100000")  # past the cores rule
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        low = len(os.listdir("/proc/self/fd")) + 100
        resource.setrlimit(resource.RLIMIT_NOFILE, (low, hard))
        try:
            with pytest.raises(ValueError, match=rf"limit here is {low} \(RLIMIT_NOFILE\)"):
                nbaccel.notebook_launcher(noop, num_processes=30)
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

    def test_timeout_must_be_positive(self):
        with pytest.raises(ValueError, match="timeout must be a positive number"):
            nbaccel.notebook_launcher(noop, num_processes=1, timeout=0)

    @pytest.mark.parametrize("block", [True, False])
    def test_preload_must_be_module_names(self, block):
        """Checked by the plan like every other argument (the fork server got it unchecked),
        before a background launch is started too."""
        with pytest.raises(TypeError, match=r"preload must be a list of module names"):
            nbaccel.notebook_launcher(noop, num_processes=1, preload=[3], block=block)


def test_num_processes_none_without_gpu_warns_and_uses_one():
    with pytest.warns(UserWarning, match="pass num_processes explicitly"):
        assert nbaccel.notebook_launcher(noop, num_processes=None) is None
