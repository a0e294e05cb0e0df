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
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import add_pass_arguments, bench_pairs, segments, timed_pass  # noqa: E402

from dpocache.cache.build import reference_batches  # noqa: E402
from dpocache.models.reference import ReferenceModel, default_device  # noqa: E402


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


if __name__ == "__main__":
    main()
