"""How dpocache's names are imported: lazily from each package's surface, and from the module
paths they had before the package was organised into subpackages.

``lazy_surface`` gives a package's ``__init__`` a PEP 562 ``__getattr__``: a name of its surface
imports its defining module on first use, so ``import dpocache`` (or ``dpocache.cache``) costs
no torch or transformers import until a name that needs one is used. dpocache's own modules
import from the defining module, never through a surface, so the surfaces add no import cycle.

``install_moved_modules`` keeps every earlier module path importable (``dpocache.logprobs``,
``python -m dpocache.memory_plan``): the old name is an alias of the module's new home, the
same module object, so a script written against either path sees the same functions and state.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from typing import Callable

# The module paths before the subpackages, and where each module lives now. Old names that are
# packages now (dpocache.data, .losses, .distributed, .service, .cli) are not here: their
# package's surface exports the old module's public names.
MOVED = {
    "dpocache.values": "dpocache.data.values",
    "dpocache.batching": "dpocache.scoring.padded",
    "dpocache.prefix": "dpocache.scoring.shared",
    "dpocache.packing": "dpocache.scoring.packing",
    "dpocache.layouts": "dpocache.scoring.layout_choice",
    "dpocache.attention": "dpocache.scoring.attention",
    "dpocache.logprobs": "dpocache.scoring.logprobs",
    "dpocache.groups": "dpocache.scoring.groups",
    "dpocache.compiling": "dpocache.scoring.compiling",
    "dpocache.bf16_matmul": "dpocache.scoring.bf16_matmul",
    "dpocache.loading": "dpocache.models.loading",
    "dpocache.reference": "dpocache.models.reference",
    "dpocache.policy": "dpocache.models.policy",
    "dpocache.checkpoint": "dpocache.models.checkpoint",
    "dpocache.tiny": "dpocache.models.tiny",
    "dpocache.hub_ids": "dpocache.models.hub_ids",
    "dpocache.hub": "dpocache.models.hub",
    "dpocache.memory_plan": "dpocache.models.memory_plan",
    "dpocache.fsdp": "dpocache.distributed.fsdp",
    "dpocache.sharded": "dpocache.distributed.sharded_reference",
    "dpocache.vocab_stream": "dpocache.distributed.vocab_stream",
    "dpocache.ld_dpo": "dpocache.losses.ld_dpo",
    "dpocache.wpo": "dpocache.losses.wpo",
    "dpocache.train": "dpocache.training.loop",
    "dpocache.audit": "dpocache.training.audit",
    "dpocache.divergence": "dpocache.training.divergence",
    "dpocache.metrics": "dpocache.training.metrics",
    "dpocache.demo": "dpocache.training.demo",
    "dpocache.plot": "dpocache.training.plot",
    "dpocache.cache_cli": "dpocache.cli.cache",
    "dpocache.cache_args": "dpocache.cli.cache_args",
    "dpocache.score_cli": "dpocache.cli.score",
    "dpocache.train_cli": "dpocache.cli.train",
    "dpocache.signals": "dpocache.runtime.signals",
    "dpocache.allocator": "dpocache.runtime.allocator",
    "dpocache.preflight": "dpocache.runtime.preflight",
}


def lazy_surface(package: str, modules: dict[str, list[str]]) -> tuple[Callable[[str], object], Callable[[], list],
                                                                         list[str]]:
    """``(__getattr__, __dir__, __all__)`` for ``package`` whose surface is ``modules`` (defining
    module → the names it exports): each name is imported from its module the first time it is
    read, then kept on the package."""
    exports = {name: module for module, names in modules.items() for name in names}

    def __getattr__(name: str):
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module '{package}' has no attribute '{name}'")
        value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(exports))

    return __getattr__, __dir__, sorted(exports)


class _AliasLoader(importlib.abc.Loader):
    """Loads an old path as the module at its new one (the same object, its own spec kept)."""

    def __init__(self, target: str):
        self.target = target
        self.target_spec = None

    def create_module(self, spec):
        module = importlib.import_module(self.target)
        self.target_spec = module.__spec__
        return module

    def exec_module(self, module) -> None:
        # The import system set the alias's spec on the shared module: give it its own back.
        module.__spec__ = self.target_spec

    def get_code(self, fullname: str):
        """The new module's code: what ``python -m <old path>`` runs."""
        spec = importlib.util.find_spec(self.target)
        return spec.loader.get_code(self.target)


class _MovedModuleFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path, target=None):
        new = MOVED.get(fullname)
        if new is None:
            return None
        return importlib.util.spec_from_loader(fullname, _AliasLoader(new))


def install_moved_modules() -> None:
    """Make the old module paths importable (once per interpreter)."""
    if not any(isinstance(f, _MovedModuleFinder) for f in sys.meta_path):
        sys.meta_path.append(_MovedModuleFinder())
