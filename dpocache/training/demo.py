"""The embedded default: a whole run with nothing downloaded.

A tiny Llama and a byte-level BPE tokenizer are built from scratch; the task is sorting: the
prompt is a list of numbers, the chosen completion is the list sorted, the rejected one the
same numbers in a shuffled order. Chosen and rejected hold the same tokens and differ only in
structure, so the policy has to learn order, not vocabulary. The demo builds the reference
cache, trains with DPO, evaluates on a held-out split, saves, plots, and prints a summary.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

from dpocache.config import Config, build_config
from dpocache.data.rows import write_jsonl
from dpocache.models.tiny import save_tiny_model
from dpocache.runtime.console import three_places
from dpocache.training.loop import train
from dpocache.training.metrics import read_metrics
from dpocache.training.plot import plot_run

DEMO_CONFIG = Path(__file__).parents[1] / "configs" / "demo.yaml"


def sorting_pairs(n: int, seed: int) -> list[dict]:
    """``n`` preference rows: prompt "sort: 7 2 9", chosen " 2 7 9", rejected a shuffle."""
    rng = random.Random(seed)
    rows = []
    while len(rows) < n:
        nums = [rng.randint(0, 99) for _ in range(rng.randint(4, 10))]
        shuffled = nums[:]
        while shuffled == sorted(nums):
            rng.shuffle(shuffled)
        rng.shuffle(shuffled)
        if shuffled == sorted(nums):
            continue
        rows.append({
            "prompt": "sort: " + " ".join(map(str, nums)),
            "chosen": " " + " ".join(map(str, sorted(nums))),
            "rejected": " " + " ".join(map(str, shuffled)),
        })
    return rows


def prepare(out: Path, train_pairs: int = 2000, eval_pairs: int = 200, seed: int = 0) -> tuple[Path, Path, Path]:
    """Write the model, tokenizer and data under ``out``; returns (model dir, train, eval)."""
    model_dir = out / "base-model"
    if not (model_dir / "config.json").exists():
        save_tiny_model(model_dir, "llama", seed=seed)
    train = write_jsonl(sorting_pairs(train_pairs, seed + 1), out / "data" / "train.jsonl")
    held_out = write_jsonl(sorting_pairs(eval_pairs, seed + 2), out / "data" / "eval.jsonl")
    return model_dir, train, held_out


def demo_config(out: Path, overrides: list[str] | None = None) -> Config:
    model_dir, train, held_out = prepare(out)
    cfg = build_config(DEMO_CONFIG, [
        "--model", str(model_dir), "--data", str(train), "--eval-data", str(held_out),
        "--output-dir", str(out / "run"), "--cache-dir", str(out / "cache"),
        "--train.overwrite", "true",  # the demo owns its run directory; its cache is what persists
        *(overrides or []),
    ])
    return cfg


def run_demo(out: str | Path = "dpocache-demo", overrides: list[str] | None = None) -> dict:
    """Build everything, train, plot; print and return the before/after table."""
    out = Path(out)
    start = time.perf_counter()
    cfg = demo_config(out, overrides)
    info = train(cfg)
    evals = [m for m in read_metrics(cfg.train.output_dir) if "eval/rewards/accuracies" in m]
    before, after = evals[0], evals[-1]
    png = plot_run(cfg.train.output_dir)
    result = {
        "accuracy_before": before["eval/rewards/accuracies"], "accuracy_after": after["eval/rewards/accuracies"],
        "margin_before": before["eval/rewards/margins"], "margin_after": after["eval/rewards/margins"],
        "seconds": time.perf_counter() - start, "output": str(out.resolve()), "plot": str(png),
        "reference": info["reference"],
    }
    _print_table(result, cfg)
    return result


def _print_table(r: dict, cfg: Config) -> None:
    ref = r["reference"]
    print()
    print("dpocache demo: DPO on a sorting task (tiny Llama, built offline)")
    print(f"  {'held-out':<24}{'before':>10}{'after':>10}")
    print(f"  {'reward accuracy':<24}{three_places(r['accuracy_before']):>10}{three_places(r['accuracy_after']):>10}")
    print(f"  {'reward margin':<24}{three_places(r['margin_before']):>10}{three_places(r['margin_after']):>10}")
    print(f"  reference: {ref['pairs']} pairs from the cache ({ref['computed']} computed, {ref['reused']} reused), "
          f"{ref['forward_passes_during_training']} reference forward passes during training")
    print(f"  time: {r['seconds']:.0f} s")
    print(f"  model, data, cache: {r['output']}")
    print(f"  run (metrics.jsonl, run.json, checkpoints, final/): {cfg.train.output_dir}")
    print(f"  plot: {r['plot']}")
