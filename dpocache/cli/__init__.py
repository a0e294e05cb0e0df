"""The ``dpocache`` command: one thin module per command (``cache``, ``score``, ``train``:
parse, call one library function, print), dispatched by ``entry``. Nothing outside this
package imports it."""

from dpocache.imports import lazy_surface

__getattr__, __dir__, __all__ = lazy_surface(__name__, {
    "dpocache.cli.entry": ["main"],
})
