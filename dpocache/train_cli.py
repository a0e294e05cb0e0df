"""``dpocache train``, ``demo`` and ``plot``."""

from __future__ import annotations


def add_train_parsers(sub) -> None:
    pass


def run(args, extra) -> int:
    raise NotImplementedError(args.command)
