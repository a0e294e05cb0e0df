"""Every script in ``bench/`` and ``bench/probes/`` imports: the names it takes from dpocache
still exist, and each finds ``bench/common.py`` by its own ``sys.path`` handling.

Most of them need a GPU, TRL or minutes of machine time, so CI does not run them; a function
moved between modules would otherwise surface only in the session that next runs the script
(a GPU session is scarce). Importing runs no benchmark: each script's work sits behind
``if __name__ == "__main__"``. Imports inside functions (bench scripts defer the costly ones)
are checked from the source's syntax tree.

A probe (``bench/probes/``) may import no bench module but ``common``: the maintained benchmarks
can then change without breaking a probe, and a probe can be deleted without breaking them."""

import ast
import importlib
import importlib.util
import subprocess
import sys
import types
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
PROBES = sorted((BENCH / "probes").glob("*.py"))
SCRIPTS = sorted(BENCH.glob("*.py")) + PROBES
BENCH_MODULES = {p.stem for p in SCRIPTS}  # what a bench script may import by its bare name
OPTIONAL_EXTRAS = {"trl", "ray", "wandb", "tensorboard"}  # pyproject's extras: CI's install has none of them


def _missing_extra(error: ImportError) -> str | None:
    """The optional extra whose absence ``error`` reports (dpocache re-raises with the pip
    command, the missing module in its cause), or None for any other import error."""
    for e in (error, error.__cause__):
        name = getattr(e, "name", None) or ""
        if name.split(".")[0] in OPTIONAL_EXTRAS:
            return name
    return None


def _import(name: str, load):
    try:
        return load()
    except ImportError as error:
        extra = _missing_extra(error)
        if extra is None:
            raise
        pytest.skip(f"{name} needs the optional {extra}")


def test_bench_scripts_found():
    assert len(SCRIPTS) >= 10, SCRIPTS
    assert PROBES, "no probes in bench/probes/"
    assert len(BENCH_MODULES) == len(SCRIPTS), "a probe and a bench script share a name"


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_bench_script_imports(script, monkeypatch):
    source = script.read_text()
    if "def main(" in source:  # a script, not one of the shared helpers (common.py)
        assert 'if __name__ == "__main__":' in source, f"{script.name} runs its work on import"
    # The script must find bench/common.py by itself, as `python bench/[probes/]X.py` does: no
    # bench directory on the path and no bench module already imported (another test's).
    bench_dirs = (BENCH, BENCH / "probes")
    monkeypatch.setattr(sys, "path", [p for p in sys.path if Path(p or ".").resolve() not in bench_dirs])
    for name in BENCH_MODULES & set(sys.modules):
        monkeypatch.delitem(sys.modules, name)
    spec = importlib.util.spec_from_file_location(f"bench_{script.stem}", script)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up there
    _import(script.name, lambda: spec.loader.exec_module(module))  # ImportError: a name dpocache no longer has
    assert module.__name__ == f"bench_{script.stem}"


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_bench_script_deferred_dpocache_imports_resolve(script):
    missing = []
    for node in ast.walk(ast.parse(script.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "dpocache":
            target = _import(script.name, lambda: importlib.import_module(node.module))
            missing += [f"{node.module}.{a.name} (line {node.lineno})" for a in node.names
                        if not hasattr(target, a.name) and importlib.util.find_spec(f"{node.module}.{a.name}") is None]
    assert not missing, f"{script.name} imports names dpocache lacks: {missing}"


def _dpocache_module_aliases(tree: ast.AST, script: Path) -> dict[str, object]:
    """The names under which ``script`` binds a dpocache module (``import dpocache.training.loop
    as train_mod``, ``from dpocache.cli import entry as cli``), each with the module."""
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "dpocache" and a.asname:
                    aliases[a.asname] = _import(script.name, lambda: importlib.import_module(a.name))
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "dpocache":
            parent = _import(script.name, lambda: importlib.import_module(node.module))
            for a in node.names:
                name = f"{node.module}.{a.name}"
                value = getattr(parent, a.name, None)
                if value is None and hasattr(parent, "__path__") and importlib.util.find_spec(name):
                    value = _import(script.name, lambda: importlib.import_module(name))
                if isinstance(value, types.ModuleType):
                    aliases[a.asname or a.name] = value
    return aliases


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_bench_script_module_attributes_resolve(script):
    """``train_mod.load_policy`` and the like: a bench script reads (or patches, to time it) a
    function through its module, so a function moved to another module breaks it silently."""
    tree = ast.parse(script.read_text())
    aliases = _dpocache_module_aliases(tree, script)
    missing = [f"{node.value.id}.{node.attr} (line {node.lineno})" for node in ast.walk(tree)
               if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
               and node.value.id in aliases and not hasattr(aliases[node.value.id], node.attr)]
    assert not missing, f"{script.name} reads attributes its dpocache modules lack: {missing}"


def _bench_imports(script: Path) -> set[str]:
    """The bench modules ``script`` imports by their bare names (``from common import ...``)."""
    names = set()
    for node in ast.walk(ast.parse(script.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
        elif isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
    return names & BENCH_MODULES


@pytest.mark.parametrize("script", PROBES, ids=lambda p: p.name)
def test_probe_imports_no_bench_module_but_common(script):
    assert _bench_imports(script) <= {"common"}, f"probes/{script.name} imports {_bench_imports(script)}"


@pytest.mark.parametrize("script", sorted(BENCH.glob("*.py")), ids=lambda p: p.name)
def test_maintained_benchmark_imports_no_probe(script):
    probes = {p.stem for p in PROBES}
    assert not _bench_imports(script) & probes, f"{script.name} imports a probe: {_bench_imports(script) & probes}"


def test_probe_runs_as_a_script_from_elsewhere(tmp_path):
    """``python bench/probes/X.py`` from another directory finds bench/common.py (gpu_sharded.py:
    it imports common at the top and nothing costly before parsing its arguments)."""
    proc = subprocess.run([sys.executable, str(BENCH / "probes" / "gpu_sharded.py"), "--help"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "--max-tokens" in proc.stdout
