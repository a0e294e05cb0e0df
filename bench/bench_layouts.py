"""Same-process A/B of the reference pass's layouts (padded, shared, packed) and attention
backends: real tokens per second (each prompt counted once) and pairs per second, medians of
``--repeats`` runs, the layouts interleaved within each repeat so that a busy machine slows
them alike.

    python bench/bench_layouts.py --config 58m --pairs 32
    python bench/bench_layouts.py --config long-prompt --pairs 32 --attention sdpa flex   # flex: CUDA
    python bench/bench_layouts.py --config long-prompt --pairs 32 --train --batch-size 8  # training steps

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


def train_once(scorer, layout: str, pairs, pad_id: int, batch_size: int, device):
    """Forward and backward of every micro-batch (the policy's work in a training step, no
    optimizer): seconds, and the per-pair sums."""
    from dpocache.scoring.layouts import layout_logprobs

    sums = {}
    start = time.perf_counter()
    for i in range(0, len(pairs), batch_size):
        batch = pairs[i:i + batch_size]
        out, _ = layout_logprobs(scorer, layout, batch, pad_id, device)
        (out.chosen_logps.sum() - out.rejected_logps.sum()).backward()
        scorer.model.zero_grad(set_to_none=True)
        sums.update({p.index: (float(c), float(r)) for p, c, r in zip(batch, out.chosen_logps.detach(),
                                                                      out.rejected_logps.detach())})
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start, sums


def trainers(args, inputs, variants):
    """``{(layout, attention): run(pairs) -> (seconds, sums)}`` over one policy in train mode."""
    from dpocache.scoring.logprobs import CompletionLogProbs
    from dpocache.scoring.layouts import training_layout
    from dpocache.models.loading import disable_dropout, load_causal_lm

    model = load_causal_lm(inputs / "model", args.device).train()
    disable_dropout(model)
    scorer = CompletionLogProbs(model)
    runs, choices = {}, {}
    for layout, attention in variants:
        def run(pairs, pad_id, max_tokens, layout=layout, attention=attention):
            training_layout(scorer, layout, attention)  # switches the attention backend
            return train_once(scorer, layout, pairs, pad_id, args.batch_size, args.device)
        runs[(layout, attention)] = run
        choices[(layout, attention)] = training_layout(scorer, layout, attention).to_json()
    return runs, choices


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
    ap.add_argument("--train", action="store_true", help="time training forward + backward, not the reference pass")
    ap.add_argument("--batch-size", type=int, default=8, help="pairs per micro-batch (--train)")
    ap.add_argument("--out", type=Path, help="write the results as JSON here")
    args = ap.parse_args(argv)

    from dpocache.cli.cache import load_tokenizer
    from dpocache.data.pairs import load_preference_data
    from dpocache.models.reference import ReferenceModel

    inputs = build_inputs(CONFIGS[args.config], args.pairs)
    tokenizer = load_tokenizer(inputs / "model")
    pairs = load_preference_data(inputs / "data.jsonl", tokenizer, max_length=None, show_progress=False).pairs
    real = sum(p.unique_tokens for p in pairs)
    variants = [(layout, attention) for attention in args.attention for layout in args.layouts]
    if args.train:
        runs, choices = trainers(args, inputs, variants)
    else:
        runs, choices = {}, {}
        for layout, attention in variants:
            ref = ReferenceModel.from_pretrained(inputs / "model", args.dtype, args.device, layout=layout,
                                                 attention=attention)
            runs[(layout, attention)] = lambda *a, ref=ref: run_once(ref, *a)
            choices[(layout, attention)] = ref.layout_choice.to_json()
    for run in runs.values():
        run(pairs[:4], tokenizer.pad_token_id, args.max_tokens)  # warm-up (and compiles)
    seconds = {v: [] for v in variants}
    baseline = None
    for _ in range(args.repeats):
        for v in variants:
            s, sums = runs[v](pairs, tokenizer.pad_token_id, args.max_tokens)
            seconds[v].append(s)
            baseline = baseline or sums
            diff = max(abs(a - b) for k in sums for a, b in zip(sums[k], baseline[k]))
            assert diff < 1e-3, (v, diff)
    rows = []
    for (layout, attention), times in seconds.items():
        med = statistics.median(times)
        choice = choices[(layout, attention)]
        assert choice["used"] == layout, choice  # a fallback would time another layout
        rows.append({"layout": layout, "attention": choice["attention"], "seconds": times, "median_s": med,
                     "tokens_per_s": real / med, "pairs_per_s": len(pairs) / med})
    base = next(r for r in rows if r["layout"] == rows[0]["layout"])["tokens_per_s"]
    for r in rows:
        r["vs_first"] = r["tokens_per_s"] / base
        print(f"{args.config:12s} {r['layout']:7s} {r['attention']:15s} {r['tokens_per_s']:9.0f} tok/s "
              f"{r['pairs_per_s']:7.2f} pairs/s  x{r['vs_first']:.2f}  runs {[round(t, 2) for t in r['seconds']]}")
    result = {"config": args.config, "pass": "train" if args.train else "reference", "pairs": len(pairs),
              "batch_size": args.batch_size if args.train else None, "real_tokens": real,
              "max_tokens": args.max_tokens, "device": args.device, "dtype": args.dtype,
              "threads": torch.get_num_threads(), "rows": rows}
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
