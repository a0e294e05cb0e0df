"""The reference pass eager against its decoder layers compiled, side by side in one process.

    python bench/probes/compile_ab.py [--budget 1024] [--rounds 3] [--segments 8] [--pairs N]
        [--config 58m] [--dtype float32] [--warm-cache]

Two copies of the model are loaded; one gets ``dpocache.scoring.compiling.compile_layers`` (what
``--compile on`` and a large enough ``--compile auto`` pass run). The compile is timed as the
compiled copy's first batch minus the eager copy's time for the same batch (both after an eager
warm-up batch), in a fresh inductor cache unless ``--warm-cache`` (then torch's default cache
directory, as a second run on a machine sees it). Then, as in ``token_budget_ab.py``, each
round runs a whole pass of each copy cut into ``--segments`` stretches of about equal tokens,
interleaved, so a slow spell of a shared machine falls on both alike. Prints one line per round
and a JSON line: the compile seconds, each copy's tokens/s per round and their medians, the
median ratio, and the break-even pass length (tokens at which the compile has paid for itself:
compile seconds / seconds saved per token), the figure ``compiling.AUTO_MIN_WORK`` is set from.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(BENCH), str(BENCH.parent)]  # bench/common.py, and dpocache in a checkout not installed

from common import add_pass_arguments, bench_pairs, segments, timed_pass  # noqa: E402

from dpocache.cache.build import default_max_tokens, reference_batches  # noqa: E402
from dpocache.scoring.compiling import compile_layers  # noqa: E402
from dpocache.models.reference import ReferenceModel, default_device  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--budget", type=int, default=None, help="--max-tokens (default: the device's)")
    add_pass_arguments(parser)
    parser.add_argument("--warm-cache", action="store_true",
                        help="use torch's default inductor cache (else a fresh one: the first compile on a machine)")
    args = parser.parse_args()
    if not args.warm_cache:  # inductor reads it at each compile (cache_dir_utils.cache_dir)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="dpocache-compile-ab-")

    model, pairs = bench_pairs(args.config, args.pairs)
    tokens = sum(p.unique_tokens for p in pairs)
    device = default_device()
    budget = args.budget or default_max_tokens(device)
    copies = {name: ReferenceModel.from_pretrained(model, args.dtype, device, layout=args.layout, attention="sdpa")
              for name in ("eager", "compiled")}
    batches = reference_batches(copies["eager"], pairs, budget)
    for reference in copies.values():  # eager warm-up of both copies (allocator, first-call costs)
        timed_pass(reference, batches[-1:], budget, device)
    compile_layers(copies["compiled"].model)
    first = {name: timed_pass(copies[name], batches[:1], budget, device) for name in ("compiled", "eager")}
    compile_s = first["compiled"] - first["eager"]
    print(f"compile: {compile_s:.1f} s (first batch compiled {first['compiled']:.2f} s, eager {first['eager']:.2f} s)",
          flush=True)

    stretches = segments(batches, args.segments)
    names = list(copies)
    passes: dict[str, list[int]] = {name: [] for name in names}
    for round_ in range(args.rounds):
        seconds = dict.fromkeys(names, 0.0)
        for k in range(args.segments):
            for name in names if (round_ + k) % 2 == 0 else names[::-1]:
                seconds[name] += timed_pass(copies[name], stretches[k], budget, device)
        for name in names:
            passes[name].append(round(tokens / seconds[name]))
        print(f"round {round_}: " + ", ".join(f"{n} {passes[n][-1]} tokens/s" for n in names), flush=True)
    eager, compiled = (statistics.median(passes[n]) for n in names)
    saved_per_token = 1 / eager - 1 / compiled
    parameters = sum(p.numel() for p in copies["eager"].model.parameters())
    print(json.dumps({
        "config": args.config, "dtype": args.dtype, "layout": copies["eager"].layout_choice.used,
        "budget": budget, "pairs": len(pairs), "tokens": tokens, "parameters": parameters,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
        "threads": torch.get_num_threads(), "inductor_cache": "warm" if args.warm_cache else "fresh",
        "rounds": args.rounds, "segments": args.segments, "compile_s": round(compile_s, 2),
        "tokens_per_s": {n: {"median": statistics.median(v), "passes": v} for n, v in passes.items()},
        "ratio": round(statistics.median(c / e for c, e in zip(passes["compiled"], passes["eager"])), 3),
        "break_even_tokens": round(compile_s / saved_per_token) if saved_per_token > 0 else None,
    }), flush=True)


if __name__ == "__main__":
    main()
