"""The two phases of one checkpointed call, and what the forward keeps for the recompute.

torch's checkpoint runs a layer's forward, drops what its backward saved, and runs the forward
again (the recompute) just before the layer's backward. What ``--checkpoint-keep`` keeps
(``dpocache.models.checkpointing``'s products, ``dpocache.models.kept_attention``'s attention
outputs) is computed in the forward and taken in the recompute instead of computed again: each
checkpointed call has a store of its own, shared by its two ``Phase`` objects, and the phase
running on this thread is ``current_phase()``. Eager layers enter the phases through the
non-reentrant checkpoint's context hooks (``checkpoint_phases``); a layer compiled inside the
reentrant checkpoint enters them by its grad mode (``in_phase_by_grad_mode``). What one call
keeps is taken in the order it was kept, first in first out, per key.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Callable, Hashable

import torch

from dpocache.config import flag_name


class Phase:
    """One of a checkpointed call's two phases (``checkpoint_phases``): the forward, which keeps
    the products, or the recompute, which takes them. Entered by torch's checkpoint around the
    layer's forward and around its recompute; both share the call's ``store``."""

    def __init__(self, store: dict, recompute: bool) -> None:
        self.store, self.recompute = store, recompute
        self._outer = None

    def __enter__(self) -> "Phase":
        self._outer = current_phase()
        _current.phase = self
        return self

    def __exit__(self, *exc) -> None:
        _current.phase = self._outer

    def keep(self, key: Hashable, product: torch.Tensor) -> None:
        """Keep ``product`` for the recompute's ``take(key)`` (a module, or an operation)."""
        self.store.setdefault(key, deque()).append((product.detach(), product._version))

    def take(self, key: Hashable) -> torch.Tensor:
        """The oldest product kept under ``key`` and not taken yet; a named ``RuntimeError`` if
        none is left (a second backward) or it was changed in place since."""
        kept = self.store.get(key)
        if not kept:  # taken by an earlier backward through the same graph (retain_graph)
            raise RuntimeError(f"{flag_name('model.checkpoint_keep')}: a second backward through a checkpointed "
                               "layer; its kept products were taken by the first")
        product, version = kept.popleft()
        if product._version != version:
            raise RuntimeError(f"{flag_name('model.checkpoint_keep')}: a kept product was changed in place after "
                               "the forward; the recompute would have taken the changed values")
        return product


# The phase of the checkpointed call running on this thread, if any. Thread-local: a GPU's backward
# (and so the recompute) runs on autograd's device thread, and enters its phase there.
_current = threading.local()


def current_phase() -> Phase | None:
    """The phase of the checkpointed call running on this thread (None: outside any)."""
    return getattr(_current, "phase", None)


def checkpoint_phases() -> tuple[Phase, Phase]:
    """torch's ``context_fn`` for one checkpointed call: the forward's phase and the
    recompute's, sharing the products kept between them."""
    store: dict = {}
    return Phase(store, recompute=False), Phase(store, recompute=True)


def in_phase_by_grad_mode(store: dict, run: Callable, *args, **kwargs):
    """``run`` in the forward's phase of one checkpointed call (without autograd: the reentrant
    checkpoint's forward) or in its recompute's (with it), sharing ``store``."""
    with Phase(store, recompute=torch.is_grad_enabled()):
        return run(*args, **kwargs)
