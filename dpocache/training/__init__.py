"""Preference training: the loop (``loop``: step, evaluation, checkpoints), the step-0 audit of
the cache (``audit``), divergence checks (``divergence``), metrics and trackers (``metrics``),
the demo run (``demo``) and curves (``plot``)."""

from dpocache.imports import lazy_surface

__getattr__, __dir__, __all__ = lazy_surface(__name__, {
    "dpocache.training.loop": ["train", "setup", "TrainingDiverged", "Run"],
    "dpocache.training.demo": ["run_demo"],
    "dpocache.training.metrics": ["read_metrics"],
    "dpocache.training.plot": ["plot_run"],
})
