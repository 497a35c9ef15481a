"""``--schedule-module`` as a new user gives it to the ``pipesched`` console script: a dotted name of a module in
the current directory (found as under ``python -m``), a ``.py`` file that imports a module next to it."""
import subprocess
import sys
import textwrap

# as the console script runs main: -I keeps the current directory (and PYTHONPATH) off sys.path
_PIPESCHED = [sys.executable, "-I", "-c", "import sys\nfrom pipesched.cli import main\nsys.exit(main())"]

_REGISTERS = textwrap.dedent("""\
    import pipesched as ps
    from {helper} import build
    ps.register_schedule("{name}", build, "one of mine", inflight="m", microbatches="any m >= 1")
    """)

_HELPER = textwrap.dedent("""\
    from pipesched import Instr, Op, Program
    def build(num_ranks, num_microbatches, virtual_stages):
        streams = [[Instr(Op.F, r, mb) for mb in range(num_microbatches)] +
                   [Instr(Op.B, r, mb) for mb in range(num_microbatches)] for r in range(num_ranks)]
        return Program(streams, stage_to_rank=tuple(range(num_ranks)), num_microbatches=num_microbatches)
    """)


def _pipesched(args, cwd):
    return subprocess.run([*_PIPESCHED, *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def _listed(stdout, name):
    return [line.split()[0] for line in stdout.splitlines() if line.split() and line.split()[0] == name]


def test_dotted_name_of_a_module_in_the_current_directory(tmp_path):
    (tmp_path / "myhelper.py").write_text(_HELPER)
    (tmp_path / "myreg.py").write_text(_REGISTERS.format(helper="myhelper", name="mine-dotted"))
    done = _pipesched(["--schedule-module", "myreg", "list"], tmp_path)
    assert done.returncode == 0, done.stderr
    assert _listed(done.stdout, "mine-dotted") == ["mine-dotted"]


def test_dotted_name_of_a_package_module_in_the_current_directory(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "helper.py").write_text(_HELPER)
    (tmp_path / "pkg" / "reg.py").write_text(_REGISTERS.format(helper="pkg.helper", name="mine-pkg"))
    done = _pipesched(["list", "--schedule-module", "pkg.reg"], tmp_path)
    assert done.returncode == 0, done.stderr
    assert _listed(done.stdout, "mine-pkg") == ["mine-pkg"]


def test_py_file_imports_a_module_next_to_it(tmp_path):
    sub = tmp_path / "sched"
    sub.mkdir()
    (sub / "nexthelper.py").write_text(_HELPER)
    (sub / "myfile.py").write_text(_REGISTERS.format(helper="nexthelper", name="mine-file"))
    done = _pipesched(["--schedule-module", "sched/myfile.py", "list"], tmp_path)
    assert done.returncode == 0, done.stderr
    assert _listed(done.stdout, "mine-file") == ["mine-file"]


def test_py_file_folder_leaves_sys_path_after_the_import(tmp_path):
    sub = tmp_path / "sched"
    sub.mkdir()
    (sub / "nexthelper.py").write_text(_HELPER)
    (sub / "myfile.py").write_text(_REGISTERS.format(helper="nexthelper", name="mine-file2"))
    code = ("import sys\nfrom pipesched.registry import REGISTRY\n"
            f"print(REGISTRY.import_module({str(sub / 'myfile.py')!r}))\nprint({str(sub)!r} in sys.path)")
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["('mine-file2',)", "False"]


def test_missing_dotted_module_still_named(tmp_path):
    done = _pipesched(["--schedule-module", "nosuchmod", "list"], tmp_path)
    assert done.returncode != 0
    assert "--schedule-module nosuchmod: cannot import it: ModuleNotFoundError: No module named 'nosuchmod'" in done.stderr
