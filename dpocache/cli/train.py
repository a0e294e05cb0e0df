"""``dpocache train``, ``demo`` and ``plot``: argument handling and printing only."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from dpocache.models.hub_ids import resolve_model_path
from dpocache.runtime.console import three_places
from dpocache.runtime.preflight import (
    UsageError,
    check_cache_dir,
    check_data_path,
    check_model_dir,
    check_run_dir,
    check_writable_dir,
    disk_errors,
)
from dpocache.runtime.run_lock import check_output_dir_free

TRAIN_USAGE = """usage: dpocache train [CONFIG.yaml] [--key value ...]

Train a policy with a DPO-family loss on cached reference log-probs. Settings come from the
defaults, then CONFIG.yaml (nested sections as below), then the command line
(--section.field value, or the short flag in parentheses). Booleans: --flag, or --flag false.
`dpocache cache build` reads the same file and flags, so a cache built first is reused whole.

Example:
  dpocache train configs/lora-single-gpu.yaml --model ./sft --data prefs.jsonl --lr 5e-6 --loss dpo_norm

Fields:
"""


def add_train_parsers(sub) -> None:
    t = sub.add_parser("train", help="train a policy (see dpocache train --help)", add_help=False)
    # Everything after "train" is ours to parse: argparse would take a flag's value for CONFIG.
    t.add_argument("rest", nargs=argparse.REMAINDER)
    d = sub.add_parser("demo", help="the embedded default: build a tiny model and task, cache, train, evaluate, plot")
    d.add_argument("--output-dir", default=None, help="where to write everything (default: ./dpocache-demo)")
    d.add_argument("--out", default=None, help=argparse.SUPPRESS)  # the old name of --output-dir, deprecated
    p = sub.add_parser("plot", help="draw a run's curves to a PNG")
    p.add_argument("output_dir")
    p.add_argument("--out", default=None, help="PNG path (default: OUTPUT_DIR/curves.png)")


def run(args: argparse.Namespace, extra: list[str]) -> int:
    if args.command == "train":
        return _train(args, extra)
    if args.command == "demo":
        from dpocache.models.checkpoint import CheckpointWriteError
        from dpocache.training.demo import run_demo

        if args.out is not None:
            print("dpocache demo: --out is deprecated; use --output-dir", file=sys.stderr)
        try:
            run_demo(args.output_dir or args.out or "dpocache-demo", extra)
        except CheckpointWriteError as err:  # a full disk mid-run: one line, as train's
            print(f"dpocache demo: error: {err}", file=sys.stderr)
            return 1
        return 0
    from dpocache.training.plot import plot_run

    print(plot_run(args.output_dir, args.out))
    return 0


def _train(args: argparse.Namespace, extra: list[str]) -> int:
    from dpocache.config import build_config, help_text

    rest = [a for a in [*args.rest, *extra] if a != "--"]
    if "-h" in rest or "--help" in rest:
        print(TRAIN_USAGE + help_text())
        return 0
    config = None
    if rest and not rest[0].startswith("--"):
        config, rest = rest[0], rest[1:]
    if config is not None and not Path(config).is_file():
        raise UsageError(f"{config}: no such config file (the first argument, if any, is a YAML file)")
    cfg = build_config(config, rest)
    # A Hub id (org/name[@revision]) becomes its snapshot directory in the local Hugging Face cache.
    cfg.model.path = resolve_model_path(cfg.model.path)
    cfg.model.ref_model = resolve_model_path(cfg.model.ref_model, "--ref-model")
    # The model directories first: checking them needs no imports, and a wrong --model must
    # not wait for torch (which validate imports), let alone for a model to load.
    check_model_dirs(cfg)
    if os.environ.get("RANK", "0") == "0":  # rank 0 holds the directory for a torchrun job (training.setup)
        check_output_dir_free(cfg.train.output_dir)  # a second run refused before torch is imported
    cfg.validate(required=("model.path", "data.train"))
    check_train_paths(cfg)
    from dpocache.cache import CacheError, default_cache_dir
    from dpocache.models.checkpoint import CheckpointWriteError
    from dpocache.models.hub import HubError
    from dpocache.training.audit import ReferenceAuditFailed
    from dpocache.training.loop import TrainingDiverged, train

    try:
        with disk_errors(output_dir=cfg.train.output_dir, cache_dir=cfg.cache.dir or default_cache_dir()):
            info = train(cfg)
    except (TrainingDiverged, ReferenceAuditFailed, HubError, CacheError,  # CacheError: e.g. NaN reference values
            CheckpointWriteError) as err:  # a full disk mid-run: the run failed, not its input (exit 1)
        print(f"dpocache train: error: {err}", file=sys.stderr)
        return 1
    if int(os.environ.get("RANK", "0")) != 0:
        return 0  # rank 0 reports for the job
    final = info["final"]
    print(describe_reference(info["reference"]))
    print(describe_data(info["data"]))
    if info.get("resumed_from"):
        print(f"resumed from {info['resumed_from']['checkpoint']} (step {info['resumed_from']['step']})")
    if final["output"] is None:  # --max-steps 0
        print("done: 0 steps (--max-steps 0): " + ("the held-out set evaluated" if final["eval"] else
                                                   "the reference log-probs in the cache") + "; no model written")
    else:
        print(f"done: {final['step']} step{'s' if final['step'] != 1 else ''}; model in {final['output']}")
    compiled = describe_compiled(info.get("policy", {}))
    if compiled:
        print(compiled)
    streamed = info.get("policy", {}).get("streamed")
    if streamed and "transfers" in streamed:
        from dpocache.cli.cache import describe_pace, describe_transfers

        turn = (f", {streamed['turn_layers']} more from each backward to the next forward"
                if streamed.get("turn_layers") else "")
        print(f"streamed base: {streamed['layers']} layers from host memory, {streamed['resident_layers']} on the "
              f"device{turn}; {describe_transfers(streamed['transfers'])}")
        pace = describe_pace(streamed["transfers"], final["loop_s"], training=True)
        if pace:
            print(pace)
    if final["eval"]:
        # a run of no step evaluated once: no "before -> after"
        print(describe_eval(first_eval(cfg.train.output_dir) if final["step"] else None, final["eval"]))
    return 0


def check_model_dirs(cfg) -> None:
    if cfg.model.path:
        check_model_dir(cfg.model.path, "--model")
    if cfg.model.ref_model:
        check_model_dir(cfg.model.ref_model, "--ref-model", tokenizer=False)


def check_train_paths(cfg) -> None:
    """Every other path ``train`` reads or writes, before anything loads (``dpocache.runtime.preflight``)."""
    from dpocache.cache import default_cache_dir

    check_data_path(cfg.data.train, "--data")
    check_data_path(cfg.data.eval, "--eval-data")
    cache_dir = cfg.cache.dir or default_cache_dir()
    check_run_dir(cfg.train.output_dir, "--output-dir", {"--model": cfg.model.path, "--ref-model": cfg.model.ref_model,
                                                          "--data": cfg.data.train, "--eval-data": cfg.data.eval,
                                                          "--cache-dir": cache_dir})
    check_writable_dir(cfg.train.output_dir, "--output-dir")
    check_cache_dir(cache_dir)  # read-only: read from, the pairs it lacks refused (cache.build)


def describe_reference(ref: dict) -> str:
    """``reference: 2200 pairs from the cache (0 computed, 2200 reused)``: where the values came from."""
    if ref.get("source") != "cache":
        return f"reference: {ref.get('source')}"
    return (f"reference: {ref['pairs']} pairs from the cache ({ref['computed']} computed, {ref['reused']} reused), "
            f"{ref.get('forward_passes_during_training', 0)} reference forward passes during training")


def describe_compiled(policy: dict) -> str | None:
    """``compiled: 6 decoder layers into 2 graphs, no graph break`` (``--compile on``; None where
    nothing compiled): a count past the one or two a run needs means the compiler compiled again
    mid-run, each time a slow step; run.json's ``policy.compiler`` says which guard failed."""
    compiler = policy.get("compiler")
    if not policy.get("compiled_layers") or not compiler:
        return None
    breaks = compiler["graph_breaks"]
    return (f"compiled: {policy['compiled_layers']} decoder layers into {compiler['graphs']} "
            f"graph{'s' if compiler['graphs'] != 1 else ''}, "
            f"{f'{breaks} graph breaks' if breaks else 'no graph break'} (why each: run.json policy.compiler)")


def first_eval(output_dir: str) -> dict | None:
    """The run's first eval row in its metrics.jsonl (step 0, before any update; a resumed run
    keeps the first attempt's), or None."""
    from dpocache.training.metrics import read_metrics

    return next((row for row in read_metrics(output_dir) if "eval/loss" in row), None)


def describe_eval(before: dict | None, after: dict) -> str:
    """``eval: reward accuracy 0.500 -> 0.600, margin 0.000 -> 0.261``: the held-out set before
    the first update and at the end (the end alone when no eval row was logged before)."""
    parts = []
    for name, key in (("reward accuracy", "eval/rewards/accuracies"), ("margin", "eval/rewards/margins")):
        end = three_places(after.get(key, float("nan")))
        parts.append(f"{name} {three_places(before[key])} -> {end}" if before and key in before else f"{name} {end}")
    return "eval: " + ", ".join(parts)


def describe_data(data: dict) -> str:
    repeated = data.get("train_repeated_per_epoch", 0)
    steps = (f"; {data['steps_per_epoch']} steps per epoch, the last filled up with {repeated} of the epoch's first "
             "pairs" if repeated else "")
    held_out = f"; {data['eval_pairs']} held-out pairs" if data.get("eval_pairs") else ""
    return (f"data: {data['train_pairs']} training pairs ({data.get('train_truncated', 0)} truncated, "
            f"{data.get('train_identical', 0)} with chosen == rejected, {data['train_skipped']} skipped){steps}"
            f"{held_out}")
