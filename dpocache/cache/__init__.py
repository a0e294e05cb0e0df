"""The persistent, content-addressed reference cache (see docs/ARCHITECTURE.md and ``store``)."""

from .build import (
    BuildSummary, build_missing, default_cache_dir, export_rows, namespace_for_dir, namespace_for_module, verify,
)
from ..values import PairValues
from .store import CacheError, CacheStore, CorruptShard, MissingReferenceError, Namespace

__all__ = [
    "BuildSummary", "CacheError", "CacheStore", "CorruptShard", "MissingReferenceError", "Namespace", "PairValues",
    "build_missing", "default_cache_dir", "export_rows", "namespace_for_dir", "namespace_for_module", "verify",
]
