from tests.kernel_helpers import KernelSession

def test_kernel_smoke():
    with KernelSession() as k:
        c = k.execute("import nbaccel\ndef f(x):\n    print('hi', x)\n    return x*2\nr = nbaccel.notebook_launcher(f, args=(21,), num_processes=2)\nprint('result', r)")
        print(c.stdout, c.stderr, c.error_text)
        assert "result 42" in c.stdout
        assert not k.leftovers()
