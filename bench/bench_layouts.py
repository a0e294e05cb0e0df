"""Same-process A/B of the reference pass's layouts (padded, shared, packed) and attention
backends: real tokens per second (each prompt counted once) and pairs per second, medians of
``--repeats`` runs, the layouts interleaved within each repeat so that a busy machine slows
them alike.

    python bench/bench_layouts.py --config 58m --pairs 32
    python bench/bench_layouts.py --config long-prompt --pairs 32 --attention sdpa flex   # flex: CUDA

The values of every layout are checked against the padded layout's (max |difference| of the
per-pair sums) before any time is reported.
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
from common import CONFIGS, build_inputs  # noqa: E402


def run_once(reference, pairs, pad_id: int, max_tokens: int):
    from dpocache.cache.build import reference_batches, score_batch

    sums = {}
    start = time.perf_counter()
    for batch in reference_batches(reference, pairs, max_tokens):
        values = score_batch(reference, batch, pad_id)
        sums.update({p.index: (float(c), float(r))
                     for p, c, r in zip(batch, values.chosen_logps, values.rejected_logps)})
    if reference.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start, sums


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="58m", choices=sorted(CONFIGS))
    ap.add_argument("--pairs", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--layouts", nargs="+", default=["padded", "shared", "packed"])
    ap.add_argument("--attention", nargs="+", default=["sdpa"])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--out", type=Path, help="write the results as JSON here")
    args = ap.parse_args(argv)

    from dpocache.cache_cli import load_tokenizer
    from dpocache.data import load_preference_data
    from dpocache.reference import ReferenceModel

    inputs = build_inputs(CONFIGS[args.config], args.pairs)
    tokenizer = load_tokenizer(inputs / "model")
    pairs = load_preference_data(inputs / "data.jsonl", tokenizer, max_length=None, show_progress=False).pairs
    real = sum(p.unique_tokens for p in pairs)
    variants = [(layout, attention) for attention in args.attention for layout in args.layouts]
    refs = {}
    for layout, attention in variants:
        ref = ReferenceModel.from_pretrained(inputs / "model", args.dtype, args.device, layout=layout,
                                             attention=attention)
        refs[(layout, attention)] = ref
        run_once(ref, pairs[:4], tokenizer.pad_token_id, args.max_tokens)  # warm-up (and compiles)
    seconds = {v: [] for v in variants}
    baseline = None
    for _ in range(args.repeats):
        for v in variants:
            s, sums = run_once(refs[v], pairs, tokenizer.pad_token_id, args.max_tokens)
            seconds[v].append(s)
            baseline = baseline or sums
            diff = max(abs(a - b) for k in sums for a, b in zip(sums[k], baseline[k]))
            assert diff < 1e-3, (v, diff)
    rows = []
    for (layout, attention), times in seconds.items():
        med = statistics.median(times)
        choice = refs[(layout, attention)].layout_choice.to_json()
        rows.append({"layout": layout, "attention": choice["attention"], "seconds": times, "median_s": med,
                     "tokens_per_s": real / med, "pairs_per_s": len(pairs) / med})
    base = next(r for r in rows if r["layout"] == rows[0]["layout"])["tokens_per_s"]
    for r in rows:
        r["vs_first"] = r["tokens_per_s"] / base
        print(f"{args.config:12s} {r['layout']:7s} {r['attention']:15s} {r['tokens_per_s']:9.0f} tok/s "
              f"{r['pairs_per_s']:7.2f} pairs/s  x{r['vs_first']:.2f}  runs {[round(t, 2) for t in r['seconds']]}")
    result = {"config": args.config, "pairs": len(pairs), "real_tokens": real, "max_tokens": args.max_tokens,
              "device": args.device, "dtype": args.dtype, "threads": torch.get_num_threads(), "rows": rows}
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
