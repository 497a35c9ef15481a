"""The package's shape: module boundaries (who may import whom), no private names used across modules, the
README's "Repository layout" table matching the tree, and the one garbage-collector pause of the core."""
import ast
import gc
import re
from pathlib import Path

import pytest

import pipesched
from pipesched.gcpause import paused_gc

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "pipesched"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list[tuple[str, str | None, int]]:
    """(imported module, imported name or None, line) for every import of a module of the package."""
    here = _module_name(path).split(".")
    package = here if path.name == "__init__.py" else here[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(alias.name, None, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            for alias in node.names:  # `from . import x` imports the module x
                found.append((module, alias.name, node.lineno))
    return found


def _imported_modules(path: Path) -> set[str]:
    """Every module of the package that ``path`` imports (``from a import b``: ``a``, and ``a.b`` if a module)."""
    modules = set()
    for module, name, _ in _imports(path):
        modules.add(module)
        if name is not None and _is_module(f"{module}.{name}"):
            modules.add(f"{module}.{name}")
    return {m for m in modules if m == "pipesched" or m.startswith("pipesched.")}


def _is_module(dotted: str) -> bool:
    path = ROOT.joinpath(*dotted.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def _core_modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


@pytest.mark.parametrize("path", sorted((PACKAGE / "schedules").glob("*.py")), ids=lambda p: p.name)
def test_schedule_builders_do_not_import_the_engine_or_passes(path):
    # a builder is a pure function of a few integers to a compute-only program: the IR, placement and checks
    allowed = {"pipesched", "pipesched.ir", "pipesched.placement", "pipesched.checks", "pipesched.errors",
               "pipesched.progress"}  # progress: a leaf (the standard library only) that long builders report to
    imported = {m for m in _imported_modules(path) if not m.startswith("pipesched.schedules")}
    assert imported <= allowed, f"{path.name} imports {sorted(imported - allowed)}"


def test_lowering_and_validation_do_not_depend_on_the_simulator():
    for name in ("lower.py", "validate.py", "engine.py", "timing.py", "deps.py", "ir.py"):
        imported = _imported_modules(PACKAGE / name)
        assert "pipesched.sim" not in imported, f"{name} imports pipesched.sim"
    assert "pipesched.timing" in _imported_modules(PACKAGE / "lower.py")  # what places messages: the timing only


def test_no_module_imports_another_modules_private_names():
    # `from x import _y` and `from . import _module`; a package-private helper module of one package may be
    # imported by its own package's modules (schedules/_common.py by the builders)
    found = []
    for path in _core_modules():
        for module, name, line in _imports(path):
            if not module.startswith("pipesched"):
                continue
            private = [part for part in module.split(".") + [name or ""] if part.startswith("_")
                       and not part.startswith("__")]
            same_package = module.rsplit(".", 1)[0] == _module_name(path).rsplit(".", 1)[0]
            if private and not (same_package and private == [module.rsplit(".", 1)[-1]]):
                found.append(f"{path.relative_to(ROOT)}:{line}: from {module} import {name}")
    assert not found, "\n".join(found)


def test_no_module_reads_another_modules_private_attributes():
    # `engine._x` where `engine` is a module of the package imported by name
    found = []
    for path in _core_modules():
        tree = ast.parse(path.read_text())
        modules = {alias.asname or alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                   and (node.level or (node.module or "").startswith("pipesched")) for alias in node.names
                   if (PACKAGE / f"{alias.name}.py").exists() or (path.parent / f"{alias.name}.py").exists()}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules
                    and node.attr.startswith("_") and not node.attr.startswith("__")):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value.id}.{node.attr}")
    assert not found, "\n".join(found)


# --- the README's layout table ---------------------------------------------------------------------------

LAYOUT = (ROOT / "README.md").read_text().split("## Repository layout", 1)[1].split("\n## ", 1)[0]


def _layout_paths() -> set[str]:
    """Every path the table names, resolved: a cell's first path sets the folder of the names after it
    (`pipesched/cost.py`, `sim.py`); an indented one (`  runtime/x.py`) is inside `pipesched/`; in the
    description, names ending in .py are files of the row's folder (`pipesched/demo/`: `model.py`, ...)."""
    paths = set()
    for row in LAYOUT.splitlines():
        cells = row.split("|")
        if len(cells) < 4 or not cells[1].strip().startswith("`"):
            continue
        names = re.findall(r"`([^`]+)`", cells[1])
        first = ("pipesched/" if names[0].startswith(" ") else "") + names[0].strip()
        folder = first if first.endswith("/") else first.rsplit("/", 1)[0] + "/" if "/" in first else ""
        paths.add(first)
        paths.update(folder + name.strip() for name in names[1:])
        if first.endswith("/"):
            paths.update(folder + name for name in re.findall(r"`([\w/]+\.py)`", cells[2]))
    return paths


def test_every_path_in_the_layout_table_exists():
    missing = sorted(p for p in _layout_paths() if not (ROOT / p).exists())
    assert not missing, f"the README's layout table names paths that do not exist: {missing}"


def test_every_module_of_the_package_is_in_the_layout_table():
    listed = _layout_paths()
    # a folder row covers its files unless the table lists files of that folder itself
    expanded = {p.rsplit("/", 1)[0] + "/" for p in listed if p.endswith(".py")}
    unlisted = []
    for path in sorted(PACKAGE.rglob("*.py")) + sorted((ROOT / "examples").glob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        folder = rel.rsplit("/", 1)[0] + "/"
        if path.name == "__init__.py" and folder != "pipesched/":
            continue  # a package's __init__ is the package (its row)
        if rel not in listed and (folder in expanded or folder not in listed):
            unlisted.append(rel)
    assert not unlisted, f"files missing from the README's layout table: {unlisted}"


# --- the garbage-collector pause ----------------------------------------------------------------------------

def test_paused_gc_pauses_and_restores_the_collector_even_on_error():
    assert gc.isenabled()
    with pytest.raises(ZeroDivisionError), paused_gc():
        assert not gc.isenabled()
        1 / 0
    assert gc.isenabled()
    gc.disable()
    try:
        with paused_gc():
            pass
        assert not gc.isenabled()  # a caller's own pause stays
    finally:
        gc.enable()


def test_the_entry_points_leave_the_collector_running():
    program = pipesched.compile_program("interleaved-1f1b", 4, 8, 2)  # build, add_send_recv, validate
    pipesched.simulate(program)
    assert gc.isenabled()


def test_no_two_test_modules_share_a_basename():
    # pytest's default import mode imports each test file by its basename (tests/ has no packages): a second
    # test_x.py in another folder stops the whole suite's collection ("import file mismatch"); helper modules
    # (rt_*.py) are imported by basename too. conftest.py is pytest's own, one per folder
    seen: dict[str, list[str]] = {}
    for path in sorted((ROOT / "tests").rglob("*.py")):
        if path.name != "conftest.py":
            seen.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
    assert {name: paths for name, paths in seen.items() if len(paths) > 1} == {}
