"""The process around the work: stop signals (``signals``), the allocators (``allocator``) and
the checks that run before any model loads (``preflight``)."""

from dpocache.imports import lazy_surface

__getattr__, __dir__, __all__ = lazy_surface(__name__, {
    "dpocache.runtime.signals": ["StopRequest", "Interrupted", "stop_signals"],
    "dpocache.runtime.preflight": ["UsageError"],
    "dpocache.runtime.allocator": ["configure_cpu_allocator"],
})
