"""dpocache: DPO-family preference training with a persistent, verified reference cache."""

__version__ = "0.1.0"
