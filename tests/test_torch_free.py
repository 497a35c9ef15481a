"""The core must not import torch (or matplotlib): it is the fast, dependency-light part."""
import subprocess
import sys


def test_import_pipesched_does_not_import_torch_or_matplotlib():
    code = ("import pipesched, pipesched.cli, pipesched.catalogue, sys; "
            "bad = [m for m in ('torch', 'matplotlib') if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_compile_and_simulate_do_not_import_torch():
    code = ("import pipesched, sys; p = pipesched.compile_program('interleaved-1f1b', 4, 8, 2); "
            "pipesched.simulate(p); assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)
