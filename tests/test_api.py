"""Module boundaries and house-keeping: ``CompletionLogProbs``'s body/head split is a public API
that composes to its own forward, no dpocache module uses a private name another dpocache module
defines, and dead config and process-global counters are gone."""

from __future__ import annotations

import ast
import inspect
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

import dpocache
from dpocache.data.pairs import load_preference_data
from dpocache.scoring.logprobs import CompletionLogProbs
from dpocache.scoring.padded import collate_pairs

PACKAGE = Path(dpocache.__file__).parent


def _private_definitions(tree: ast.AST) -> set[str]:
    """Private names a module defines: functions, classes, methods, assigned names and
    attributes it assigns on ``self``."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def _private_uses(tree: ast.AST) -> list[tuple[int, str]]:
    """``(line, name)`` of private attributes read on anything but ``self``/``cls``, and of
    private names imported from a dpocache module."""
    uses = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                uses.append((node.lineno, node.attr))
        elif isinstance(node, ast.ImportFrom) and (node.level > 0 or (node.module or "").startswith("dpocache")):
            uses += [(node.lineno, a.name) for a in node.names if a.name.startswith("_") and a.name != "__version__"]
    return uses


def test_no_module_uses_another_modules_private_names():
    trees = {p: ast.parse(p.read_text()) for p in sorted(PACKAGE.rglob("*.py"))}
    defined = {p: _private_definitions(t) for p, t in trees.items()}
    found = []
    for path, tree in trees.items():
        for line, name in _private_uses(tree):
            owners = [p for p, names in defined.items() if name in names]
            # A name only other dpocache modules define is theirs; one no dpocache module defines
            # is a library's (torch's ``_version``), and one this module defines too is its own
            # (an override of a subclass hook included).
            if owners and path not in owners:
                found.append(f"{path.relative_to(PACKAGE)}:{line}: {name} (defined in "
                             f"{', '.join(str(p.relative_to(PACKAGE)) for p in owners)})")
    assert not found, "\n".join(found)


def test_body_and_head_compose_to_forward(tiny_models, tokenizer, make_rows):
    """``head_logps(body(...)[positions], labels)`` is ``forward``'s value at those positions, and
    ``causal_lm`` is the wrapped model."""
    pairs = load_preference_data(make_rows(4, seed=5), tokenizer, show_progress=False).pairs
    batch = collate_pairs(pairs, tokenizer.pad_token_id)
    for arch in ("llama", "gemma2"):  # gemma2: the head's soft-capping is part of head_logps
        model = tiny_models[arch]
        lp = CompletionLogProbs(model)
        assert lp.causal_lm is model and lp.fast_path and not lp.router_loss
        with torch.no_grad():
            want = lp(batch.input_ids, batch.attention_mask, batch.completion_mask)  # (2B, T)
            hidden = lp.body(batch.input_ids, batch.attention_mask)  # (2B, T, H)
            target = batch.completion_mask[:, 1:].bool()
            got = lp.head_logps(hidden[:, :-1][target], batch.input_ids[:, 1:][target])  # (M,)
        assert hidden.shape[:2] == batch.input_ids.shape
        torch.testing.assert_close(got, want[:, 1:][target], rtol=0, atol=1e-6)


def test_dead_config_and_globals_are_gone():
    """The reference pass counts its passes in the build's summary (tests/test_train.py), not in
    a process-global counter. Cache defaults live once, in the config. (``model.compile``, once
    an unread field, is read now: tests/test_compiling.py.)"""
    import dpocache.models.reference
    from dpocache.cache.build import CPU_MAX_TOKENS, GPU_MAX_TOKENS, BuildOptions, default_max_tokens
    from dpocache.cache.store import DEFAULT_SHARD_PAIRS, CacheStore
    from dpocache.config import CacheConfig

    assert not hasattr(dpocache.models.reference, "FORWARD_PASSES")
    assert DEFAULT_SHARD_PAIRS == CacheConfig.shard_size
    # The token budget has no one default: each device's is chosen where the reference is loaded.
    assert CacheConfig.max_tokens is None and BuildOptions.max_tokens is None
    assert (default_max_tokens("cpu"), default_max_tokens(torch.device("cuda", 1))) == (CPU_MAX_TOKENS, GPU_MAX_TOKENS)
    assert inspect.signature(CacheStore.writer).parameters["shard_pairs"].default == DEFAULT_SHARD_PAIRS
    assert BuildOptions.shard_pairs == DEFAULT_SHARD_PAIRS


# ------------------------------------------------------------------------------ package shape

def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(path: Path) -> set[str]:
    """The dpocache modules ``path`` imports, at the top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("dpocache"):
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                found.add(full if full in MODULES else node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("dpocache")}
    return {m for m in found if m in MODULES}


GRAPH = {name: _imports(path) - {name} for name, path in MODULES.items()}


def test_the_package_is_a_few_modules_and_subpackages():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    subpackages = sorted(p.parent.name for p in PACKAGE.glob("*/__init__.py"))
    assert len(top) <= 6, top
    assert len(subpackages) >= 6, subpackages


def test_no_import_cycle():
    """Module by module, function-level imports included (a package's lazy surface imports nothing)."""
    state: dict[str, str] = {}

    def visit(name: str, path: list[str]) -> list[str] | None:
        state[name] = "open"
        for dep in sorted(GRAPH[name]):
            if state.get(dep) == "open":
                return path + [dep]
            if dep not in state and (cycle := visit(dep, path + [dep])):
                return cycle
        state[name] = "done"
        return None

    for name in sorted(GRAPH):
        if name not in state:
            cycle = visit(name, [name])
            assert cycle is None, " -> ".join(cycle)


def test_nothing_outside_the_command_line_imports_it():
    """Library code never imports ``dpocache.cli`` (``python -m dpocache``'s ``__main__`` starts it)."""
    found = {name: sorted(d for d in deps if d.startswith("dpocache.cli")) for name, deps in GRAPH.items()
             if not name.startswith("dpocache.cli") and name != "dpocache.__main__"}
    assert not {k: v for k, v in found.items() if v}


def test_the_training_loop_reads_with_few_imports():
    deps = {d for d in GRAPH["dpocache.training.loop"] if d != "dpocache"}
    assert len(deps) <= 12, sorted(deps)


def test_only_the_layout_modules_branch_on_a_layout_name():
    """The padded/shared/packed switch is ``scoring.layouts``; ``scoring.layout_choice`` names the
    layouts and ``scoring.shared`` builds its own two (shared, packed)."""
    allowed = {"dpocache.scoring.layouts", "dpocache.scoring.layout_choice", "dpocache.scoring.shared"}
    pattern = re.compile(r"(==|!=)\s*(PADDED|SHARED|PACKED)\b|\bin\s+PROMPT_SHARING\b|\blayout\s*(==|!=)\s*\"")
    found = [f"{name}:{i}" for name, path in MODULES.items() if name not in allowed
             for i, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
    assert not found


def test_import_dpocache_is_light_and_its_surface_resolves():
    """``import dpocache`` imports neither torch nor transformers; each name of each surface
    (``__all__``) is there once used, and every earlier module path imports as its new module."""
    code = textwrap.dedent("""
        import importlib, importlib.util, sys
        import dpocache
        assert "torch" not in sys.modules and "transformers" not in sys.modules, "heavy import"
        dpocache.ReferenceService, dpocache.CacheStore
        from dpocache.imports import MOVED
        optional = {"trl", "ray"}  # extras: a name that needs one is checked where it is installed
        for package in [dpocache] + [importlib.import_module(f"dpocache.{p}") for p in sys.argv[1:]]:
            for name in package.__all__:
                try:
                    getattr(package, name)
                except ImportError as e:
                    missing = getattr(e.__cause__, "name", None) or e.name
                    if (missing or "").split(".")[0] not in optional or importlib.util.find_spec(missing):
                        raise
        for old, new in MOVED.items():
            assert importlib.import_module(old) is importlib.import_module(new), old
        from dpocache.batching import collate_pairs  # a name through an old path
        print("ok")
    """)
    subpackages = sorted(p.parent.name for p in PACKAGE.glob("*/__init__.py"))
    proc = subprocess.run([sys.executable, "-c", code, *subpackages], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_an_old_module_path_runs_with_python_m():
    proc = subprocess.run([sys.executable, "-m", "dpocache.memory_plan", "--devices", "8", "--device-gib", "80"],
                          capture_output=True, text=True)
    assert proc.returncode == 0 and "8B" in proc.stdout + proc.stderr, proc.stderr
