"""Reference-pass token budgets (``--max-tokens``) side by side in one process, no TRL.

    python bench/token_budget_ab.py --budgets 2048,4096 [--rounds 3] [--segments 8] [--pairs N]
        [--config 58m] [--dtype float32] [--layout shared]

The model is loaded once and each budget's batches are planned over the same pairs. A round runs
a whole pass per budget, interleaved: the pass is cut into ``--segments`` stretches of about
equal tokens (batches come longest first under every budget, so stretch k covers about the same
pairs under each), and every budget runs stretch k before any runs stretch k+1, in an order that
alternates. A slow spell of a shared machine (its speed drifted by 1.5x over minutes here) then
falls on every budget alike, where whole passes one after another gave contradictory ratios.
Prints one line per round and a JSON line with each budget's tokens/s (prompt once) per round
and their median, and the median over rounds of each budget's ratio to the first budget's.
This is how ``cache.build.CPU_MAX_TOKENS`` was chosen.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import CONFIGS, bench_pairs  # noqa: E402
from gpu_compile_probe import synchronize  # noqa: E402

from dpocache.cache.build import reference_batches, score_batch  # noqa: E402
from dpocache.reference import ReferenceModel, default_device  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--budgets", required=True, help="comma-separated token budgets, e.g. 2048,4096")
    add_pass_arguments(parser)
    args = parser.parse_args()
    budgets = [int(b) for b in args.budgets.split(",")]

    model, pairs = bench_pairs(args.config, args.pairs)
    tokens = sum(p.unique_tokens for p in pairs)
    device = default_device()
    reference = ReferenceModel.from_pretrained(model, args.dtype, device, layout=args.layout, attention="sdpa")
    stretches = {b: segments(reference_batches(reference, pairs, b), args.segments) for b in budgets}
    passes: dict[int, list[int]] = {b: [] for b in budgets}
    for round_ in range(args.rounds):
        seconds = dict.fromkeys(budgets, 0.0)
        for k in range(args.segments):
            for budget in budgets if (round_ + k) % 2 == 0 else budgets[::-1]:
                seconds[budget] += timed_pass(reference, stretches[budget][k], budget, device)
        for budget in budgets:
            passes[budget].append(round(tokens / seconds[budget]))
        print(f"round {round_}: " + ", ".join(f"budget {b} {passes[b][-1]} tokens/s" for b in budgets), flush=True)
    first = budgets[0]
    print(json.dumps({
        "config": args.config, "dtype": args.dtype, "layout": reference.layout_choice.used, "pairs": len(pairs),
        "tokens": tokens, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "threads": torch.get_num_threads(),
        "rounds": args.rounds, "segments": args.segments,
        "batches": {b: sum(len(x) for x in stretches[b]) for b in budgets},
        "tokens_per_s": {b: {"median": statistics.median(v), "passes": v} for b, v in passes.items()},
        f"ratio_to_{first}": {b: round(statistics.median(x / y for x, y in zip(passes[b], passes[first])), 3)
                              for b in budgets},
    }), flush=True)


def add_pass_arguments(parser: argparse.ArgumentParser) -> None:
    """The options that say which reference pass an A/B runs (this script's and compile_ab.py's)."""
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--segments", type=int, default=8, help="interleaved stretches per pass")
    parser.add_argument("--pairs", type=int, default=None, help="the first N pairs (default: the configuration's)")
    parser.add_argument("--config", default="58m", choices=list(CONFIGS))
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--layout", default="shared", choices=["shared", "packed", "padded"])


def segments(batches: list, count: int) -> list[list]:
    """``batches`` cut into ``count`` consecutive stretches of about equal tokens."""
    sizes = [sum(p.unique_tokens for p in batch) for batch in batches]
    total, done, out = sum(sizes), 0, [[] for _ in range(count)]
    for batch, size in zip(batches, sizes):
        out[min(count - 1, done * count // total)].append(batch)
        done += size
    return out


def timed_pass(reference, batches: list, budget: int, device: torch.device) -> float:
    """Seconds to score ``batches`` (planned under ``budget``)."""
    synchronize(device)
    start = time.perf_counter()
    for batch in batches:
        score_batch(reference, batch, 0, budget)
    synchronize(device)
    return time.perf_counter() - start


if __name__ == "__main__":
    main()
