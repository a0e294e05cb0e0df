"""Module boundaries and house-keeping: ``CompletionLogProbs``'s body/head split is a public API
that composes to its own forward, no dpocache module uses a private name another dpocache module
defines, and dead config and process-global counters are gone."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import torch

import dpocache
from dpocache.scoring.padded import collate_pairs
from dpocache.data.pairs import load_preference_data
from dpocache.scoring.logprobs import CompletionLogProbs

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
        elif isinstance(node, ast.ImportFrom) and node.level > 0:
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
    from dpocache.cache.build import CPU_MAX_TOKENS, GPU_MAX_TOKENS, build_missing, default_max_tokens
    from dpocache.cache.store import DEFAULT_SHARD_PAIRS, CacheStore
    from dpocache.config import CacheConfig

    assert not hasattr(dpocache.models.reference, "FORWARD_PASSES")
    assert DEFAULT_SHARD_PAIRS == CacheConfig.shard_size
    # The token budget has no one default: each device's is chosen where the reference is loaded.
    assert CacheConfig.max_tokens is None and inspect.signature(build_missing).parameters["max_tokens"].default is None
    assert (default_max_tokens("cpu"), default_max_tokens(torch.device("cuda", 1))) == (CPU_MAX_TOKENS, GPU_MAX_TOKENS)
    assert inspect.signature(CacheStore.writer).parameters["shard_pairs"].default == DEFAULT_SHARD_PAIRS
    assert inspect.signature(build_missing).parameters["shard_pairs"].default == DEFAULT_SHARD_PAIRS
