"""The persistent, content-addressed reference cache (docs/cache.md): the store and its
namespaces (``store``), the build (``build``), the look-aside cache of single sequences
(``sequences``), exports (``export``)."""

from dpocache.imports import lazy_surface

__getattr__, __dir__, __all__ = lazy_surface(__name__, {
    "dpocache.cache.build": [
        "BuildOptions", "BuildSummary", "build_missing", "default_cache_dir", "export_rows",
        "namespace_for_dir", "namespace_for_module", "verify"
    ],
    "dpocache.data.values": ["PairValues"],
    "dpocache.cache.store": ["CacheError", "CacheStore", "CorruptShard", "MissingReferenceError", "Namespace"],
    "dpocache.cache.sequences": ["SequenceStore"],
})
