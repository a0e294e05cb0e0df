"""Models in memory: loading (``loading``), the frozen reference (``reference``), the policy with
its optimizer (``policy``), training checkpoints (``checkpoint``), Hub ids from the local cache
(``hub_ids``) and uploads (``hub``), tiny offline models (``tiny``), the memory plan."""

from dpocache.imports import lazy_surface

__getattr__, __dir__, __all__ = lazy_surface(__name__, {
    "dpocache.models.reference": ["ReferenceModel", "resolve_dtype"],
    "dpocache.models.loading": ["load_causal_lm", "disable_dropout"],
    "dpocache.models.policy": ["load_policy", "build_optimizer", "build_scheduler"],
    "dpocache.models.checkpoint": ["save_checkpoint", "latest_checkpoint", "load_trainer_state"],
    "dpocache.models.tiny": ["build_tokenizer", "build_model", "save_tiny_model"],
    "dpocache.models.hub_ids": ["resolve_model_path"],
    "dpocache.models.memory_plan": ["reference_memory", "training_memory"],
})
