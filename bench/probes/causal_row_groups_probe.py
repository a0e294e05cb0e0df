"""The causal backend's attention alone, its sequence rows in one group against ``ROW_GROUPS``.

    python bench/probes/causal_row_groups_probe.py [--device cpu|cuda] [--dtype float32|bfloat16]
        [--pairs 8] [--batches 4] [--rounds 5] [--heads 8 --kv-heads 2 --head-dim 64]

Batches of ``--pairs`` pairs shaped as the GPU suite's 8B rows (prompts 200-1,200 tokens,
completions 100-800) are laid out as training lays them out under the causal backend (the
packed layout in one row, ``scoring.shared.layout_batch``), and their rows built twice: in one
group, every row as wide as the longest sequence (the rows before ``row_groups``), and in
``ROW_GROUPS`` groups. Random queries, keys and values of the given head shape go through
``scoring.attention.causal_attention_forward`` forward and backward, each way once per batch in
turn within a round. Prints the attention work each way (the rows' widths squared, summed),
the largest difference between the two ways' outputs and input gradients, each way's seconds
per round and the median ratio, as one JSON line.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # dpocache in a checkout not installed

from dpocache.data.pairs import TokenizedPair  # noqa: E402
from dpocache.scoring import shared  # noqa: E402
from dpocache.scoring.attention import causal_attention_forward  # noqa: E402
from dpocache.scoring.layout_choice import CAUSAL  # noqa: E402


class _Config:  # a config whose attention is the causal backend, for layout_batch
    _attn_implementation = CAUSAL


class _Attention(nn.Module):
    """What transformers' ``sdpa_attention_forward`` reads of an attention module."""

    def __init__(self, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.num_key_value_groups = heads // kv_heads
        self.is_causal = True


def tulu_shaped_pairs(n: int, seed: int) -> list[TokenizedPair]:
    rng = random.Random(seed)
    ids = lambda k: tuple(rng.randrange(3, 1000) for _ in range(k))  # noqa: E731
    return [TokenizedPair(i, ids(rng.randint(200, 1200)), ids(rng.randint(100, 800)), ids(rng.randint(100, 800)),
                          key=i.to_bytes(16, "little")) for i in range(n)]


def rows_of(pairs, groups: int):
    """The batch and its sequence rows in ``groups`` groups at most."""
    real = shared.row_groups
    shared.row_groups = lambda lengths: real(lengths, groups)
    try:
        return shared.layout_batch("packed", pairs, 0, _Config())
    finally:
        shared.row_groups = real


def run(module, batch, q, k, v, grad):
    """Forward and backward once: (output, input gradients)."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    rows = batch.rows
    out, _ = causal_attention_forward(module, q, k, v, None, dpocache_gather=rows.gather,
                                      dpocache_scatter=rows.scatter, dpocache_second=rows.second,
                                      dropout=0.0, scaling=q.shape[-1] ** -0.5)
    out.backward(grad)
    return out.detach(), [t.grad for t in (q, k, v)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--pairs", type=int, default=8, help="pairs a batch (a training step's micro-batch)")
    p.add_argument("--batches", type=int, default=4)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    args = p.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    module = _Attention(args.heads, args.kv_heads)
    torch.manual_seed(0)
    cases = []
    for b in range(args.batches):
        pairs = tulu_shaped_pairs(args.pairs, seed=b)
        one, grouped = rows_of(pairs, 1), rows_of(pairs, shared.ROW_GROUPS)
        t = one.input_ids.shape[1]
        q = torch.randn(1, args.heads, t, args.head_dim, device=device, dtype=dtype)
        k, v = (torch.randn(1, args.kv_heads, t, args.head_dim, device=device, dtype=dtype) for _ in range(2))
        grad = torch.randn(1, t, args.heads, args.head_dim, device=device, dtype=dtype)
        cases.append(([one.to(device), grouped.to(device)], q, k, v, grad))
    work = [sum(g.shape[0] * g.shape[1] ** 2 for g in batches[i].rows.gather) for batches, *_ in cases
            for i in (0, 1)]
    diff = 0.0
    for batches, q, k, v, grad in cases:  # the two ways agree (and every kernel has run once)
        (o1, g1), (o2, g2) = (run(module, batch, q, k, v, grad) for batch in batches)
        diff = max([diff, float((o1 - o2).abs().max()), *(float((a - b).abs().max()) for a, b in zip(g1, g2))])
    seconds = {"one group": [], "row groups": []}
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(args.rounds):
        for i, name in enumerate(seconds):
            sync()
            start = time.perf_counter()
            for batches, q, k, v, grad in cases:
                run(module, batches[i], q, k, v, grad)
            sync()
            seconds[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(s) for name, s in seconds.items()}
    print(json.dumps({
        "device": str(device), "dtype": args.dtype, "threads": torch.get_num_threads(), "pairs": args.pairs,
        "batches": args.batches, "rounds": args.rounds, "heads": [args.heads, args.kv_heads, args.head_dim],
        "row_groups": shared.ROW_GROUPS, "work_ratio": round(sum(work[1::2]) / sum(work[0::2]), 3),
        "max_abs_diff": diff, "seconds": seconds, "median_s": medians,
        "speedup": round(medians["one group"] / medians["row groups"], 3)}))


if __name__ == "__main__":
    main()
