"""``dpocache train``, ``demo`` and ``plot``: argument handling and printing only."""

from __future__ import annotations

import argparse
import os
import sys

TRAIN_USAGE = """usage: dpocache train [CONFIG.yaml] [--key value ...]

Train a policy with a DPO-family loss on cached reference log-probs. Settings come from the
defaults, then CONFIG.yaml (nested sections as below), then the command line
(--section.field value, or the short flag in parentheses). Booleans: --flag, or --flag false.

Example:
  dpocache train configs/lora.yaml --model ./sft --data prefs.jsonl --lr 5e-6 --loss dpo_norm

Fields:
"""


def add_train_parsers(sub) -> None:
    t = sub.add_parser("train", help="train a policy (see dpocache train --help)", add_help=False)
    # Everything after "train" is ours to parse: argparse would take a flag's value for CONFIG.
    t.add_argument("rest", nargs=argparse.REMAINDER)
    d = sub.add_parser("demo", help="the embedded default: build a tiny model and task, cache, train, evaluate, plot")
    d.add_argument("--out", default="dpocache-demo", help="where to write everything (default: ./dpocache-demo)")
    p = sub.add_parser("plot", help="draw a run's curves to a PNG")
    p.add_argument("output_dir")
    p.add_argument("--out", default=None, help="PNG path (default: OUTPUT_DIR/curves.png)")


def run(args: argparse.Namespace, extra: list[str]) -> int:
    if args.command == "train":
        return _train(args, extra)
    if args.command == "demo":
        from .demo import run_demo

        run_demo(args.out, extra)
        return 0
    from .plot import plot_run

    print(plot_run(args.output_dir, args.out))
    return 0


def _train(args: argparse.Namespace, extra: list[str]) -> int:
    from .config import ConfigError, build_config, help_text

    rest = [a for a in [*args.rest, *extra] if a != "--"]
    if "-h" in rest or "--help" in rest:
        print(TRAIN_USAGE + help_text())
        return 0
    config = None
    if rest and not rest[0].startswith("--"):
        config, rest = rest[0], rest[1:]
    try:
        cfg = build_config(config, rest)
    except ConfigError as err:
        print(f"dpocache train: error: {err}", file=sys.stderr)
        return 2
    from .audit import ReferenceAuditFailed
    from .hub import HubError
    from .train import TrainingDiverged, train

    try:
        info = train(cfg)
    except (TrainingDiverged, ReferenceAuditFailed, HubError) as err:
        print(f"dpocache train: error: {err}", file=sys.stderr)
        return 1
    if int(os.environ.get("RANK", "0")) != 0:
        return 0  # rank 0 reports for the job
    final = info["final"]
    print(f"done: {final['step']} steps; model in {final['output']}")
    if final["eval"]:
        print(f"eval: reward accuracy {final['eval'].get('eval/rewards/accuracies', float('nan')):.3f}, "
              f"margin {final['eval'].get('eval/rewards/margins', float('nan')):.3f}")
    return 0
