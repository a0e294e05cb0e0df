"""Every script in ``bench/`` imports: the names it takes from dpocache still exist.

Most of them need a GPU, TRL or minutes of machine time, so CI does not run them; a function
moved between modules would otherwise surface only in the session that next runs the script
(a GPU session is scarce). Importing runs no benchmark: each script's work sits behind
``if __name__ == "__main__"``. Imports inside functions (bench scripts defer the costly ones)
are checked from the source's syntax tree."""

import ast
import importlib
import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
SCRIPTS = sorted(BENCH.glob("*.py"))
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


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_bench_script_imports(script, monkeypatch):
    source = script.read_text()
    if "def main(" in source:  # a script, not one of the shared helpers (common.py)
        assert 'if __name__ == "__main__":' in source, f"{script.name} runs its work on import"
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
