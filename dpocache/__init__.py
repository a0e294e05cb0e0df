"""dpocache: DPO-family preference training with a persistent, verified reference cache.

The names a script needs, each imported on first use: ``import dpocache`` imports neither torch
nor transformers. The subpackages (docs/ARCHITECTURE.md) have surfaces of their own.

    import dpocache
    data = dpocache.load_preference_data("pairs.jsonl", tokenizer)
    store = dpocache.CacheStore(cache_dir, dpocache.namespace_for_dir(model_dir, torch.float32, cache_dir)).open()
"""

from dpocache.imports import install_moved_modules, lazy_surface

__version__ = "0.1.0"

__getattr__, __dir__, __all__ = lazy_surface(__name__, {
    "dpocache.config": ["Config", "ConfigError", "build_config"],
    "dpocache.data.pairs": ["load_preference_data", "PreferenceData", "TokenizedPair"],
    "dpocache.data.rows": ["DataError"],
    "dpocache.data.values": ["PairValues"],
    "dpocache.cache.store": ["CacheStore", "Namespace", "CacheError", "MissingReferenceError"],
    "dpocache.cache.build": ["build_missing", "BuildOptions", "BuildSummary", "namespace_for_dir", "verify"],
    "dpocache.models.reference": ["ReferenceModel"],
    "dpocache.scoring.logprobs": ["CompletionLogProbs"],
    "dpocache.scoring.layouts": ["policy_logps"],
    "dpocache.losses.registry": ["preference_loss", "LOSSES", "LossSpec", "parse_loss_spec"],
    "dpocache.training.loop": ["train"],
    "dpocache.service.reference_service": ["ReferenceService", "ServiceOptions"],
    "dpocache.service.pool": ["ReferencePool"],
    "dpocache.integrations.trl": ["CachedDPOTrainer"],
    "dpocache.integrations.trl_grpo": ["CachedGRPOTrainer"],
    "dpocache.runtime.signals": ["Interrupted"],
})

install_moved_modules()
