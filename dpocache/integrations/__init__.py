"""Adapters that put dpocache's reference cache inside other trainers (optional dependencies)."""

from dpocache.imports import lazy_surface

__getattr__, __dir__, __all__ = lazy_surface(__name__, {
    "dpocache.integrations.trl": ["CachedDPOTrainer"],
    "dpocache.integrations.trl_grpo": ["CachedGRPOTrainer"],
})
