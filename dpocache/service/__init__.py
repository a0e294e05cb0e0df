"""The reference as a service for online RL (GRPO, PPO): per-token reference log-probs of token
ids, each group's prompt run once, a look-aside cache; replicas through Ray (``ReferencePool``)."""

from dpocache.imports import lazy_surface

__getattr__, __dir__, __all__ = lazy_surface(__name__, {
    "dpocache.service.reference_service": [
        "ReferenceService", "ServiceOptions", "RequestError", "Request", "check_request", "GROUP_MAX_TOKENS"
    ],
    "dpocache.service.pool": ["ReferencePool"],
})
