"""How close the CPU reference pass is to what its matrix products alone allow.

    python bench/probes/cpu_ceiling_probe.py [--config 58m] [--budget 1024] [--pairs N] [--rounds 3]

On the configuration's real batches (shared layout, ``--budget`` tokens, fp32, as ``dpocache
cache build`` plans them), each round times, in turn:

- ``pass``: the reference pass as the build runs it (``cache.build.score_batch``);
- ``products``: the same batches through the pass's matrix products and attention only, with the
  model's own weights at the same shapes: per layer the q, k, v, o, gate, up and down products and
  the one masked SDPA call, then the output head's (rows x vocabulary) tiles on the scored
  positions. No embedding lookup, norms, rotary embedding, SiLU, gating product, residual adds or
  log-sum-exp: the element-wise work that a perfect fusion could at best hide completely;
- ``peak``: the machine's fp32 matmul peak as ``bench_vs_trl.py`` measures it (``common.measure_peak``).

Each gets the bench's executed FLOPs (``common.flops_of_build``, scaled to the pairs run)
over its seconds, as a share of that round's peak. ``products`` is the ceiling of the pass's share
on this machine; ``pass / products`` the most any rewrite of the element-wise work could gain.
Prints a line per round and a JSON line with the medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

BENCH = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(BENCH), str(BENCH.parent)]  # bench/common.py, and dpocache in a checkout not installed

from common import CONFIGS, bench_pairs, flops_of_build, measure_peak, timed_pass  # noqa: E402

from dpocache.cache.build import reference_batches  # noqa: E402
from dpocache.scoring.logprobs import CPU_TILE_ROWS, CPU_TILE_VOCAB, decoder_layers, unwrap_causal_lm  # noqa: E402
from dpocache.scoring.shared import attention_mask, collate_layout  # noqa: E402
from dpocache.models.reference import ReferenceModel  # noqa: E402

CPU = torch.device("cpu")


def product_work(reference: ReferenceModel, batches: list) -> list[tuple]:
    """Per batch: random hidden states ``(B, T, H)``, its block mask and its scored rows ``M``."""
    config = unwrap_causal_lm(reference.model).config
    work = []
    for batch in batches:
        rows = collate_layout("shared", batch)
        b, t = rows.input_ids.shape
        scored = sum(len(p.chosen_ids) + len(p.rejected_ids) for p in batch)
        work.append((torch.randn(b, t, config.hidden_size), attention_mask(rows, config), scored))
    return work


@torch.no_grad()
def products_pass(reference: ReferenceModel, work: list[tuple]) -> float:
    """Seconds for the pass's products and attention alone (see the module docstring)."""
    lm = unwrap_causal_lm(reference.model)
    config = lm.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    dim = config.hidden_size // heads
    layers = [(layer.self_attn, layer.mlp) for layer in decoder_layers(reference.model)]
    head = lm.get_output_embeddings().weight  # (V, H)
    start = time.perf_counter()
    # Every layer reads the same random x: without the norms a chain of products would drift
    # towards denormal numbers, which the CPU multiplies more slowly.
    for x, mask, scored in work:
        b, t, _ = x.shape
        for attn, mlp in layers:
            q = F.linear(x, attn.q_proj.weight).view(b, t, heads, dim).transpose(1, 2)
            k = F.linear(x, attn.k_proj.weight).view(b, t, kv_heads, dim).transpose(1, 2)
            v = F.linear(x, attn.v_proj.weight).view(b, t, kv_heads, dim).transpose(1, 2)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=kv_heads != heads)
            out = F.linear(o.transpose(1, 2).reshape(b, t, -1), attn.o_proj.weight)
            gate, _up = F.linear(out, mlp.gate_proj.weight), F.linear(out, mlp.up_proj.weight)
            F.linear(gate, mlp.down_proj.weight)
        picked = x.reshape(b * t, -1)[:scored]  # (M, H)
        for h in picked.split(CPU_TILE_ROWS):
            for v0 in range(0, head.shape[0], CPU_TILE_VOCAB):
                F.linear(h, head[v0:v0 + CPU_TILE_VOCAB])
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default="58m", choices=list(CONFIGS))
    parser.add_argument("--budget", type=int, default=1024)
    parser.add_argument("--pairs", type=int, default=None, help="the first N pairs (default: the configuration's)")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    model, pairs = bench_pairs(args.config, args.pairs)
    inputs = model.parent
    flops = flops_of_build(inputs, json.loads((inputs / "info.json").read_text()))
    all_tokens = flops["unique_tokens"]
    executed = flops["executed"] * sum(p.unique_tokens for p in pairs) / all_tokens  # these pairs' share
    reference = ReferenceModel.from_pretrained(model, "float32", CPU, layout="shared",
                                               attention="sdpa")
    batches = reference_batches(reference, pairs, args.budget)
    work = product_work(reference, batches)
    timed_pass(reference, batches[-1:], args.budget, CPU)  # warm-up: allocator, first calls
    products_pass(reference, work[-1:])
    seconds: dict[str, list[float]] = {"pass": [], "products": []}
    peaks: list[float] = []
    for r in range(args.rounds):
        seconds["pass"].append(timed_pass(reference, batches, args.budget, CPU))
        seconds["products"].append(products_pass(reference, work))
        peaks.append(measure_peak("float32", cached=False))  # each round: the machine's speed drifts
        print(f"round {r + 1}: pass {seconds['pass'][-1]:.2f} s, products {seconds['products'][-1]:.2f} s, "
              f"peak {peaks[-1] / 1e9:.0f} GFLOP/s", flush=True)
    share = {name: [executed / s / p for s, p in zip(secs, peaks)] for name, secs in seconds.items()}
    print(json.dumps({
        "config": args.config, "budget": args.budget, "pairs": len(pairs), "batches": len(batches),
        "threads": torch.get_num_threads(), "executed_gflop": round(executed / 1e9, 1),
        "seconds": {n: [round(s, 3) for s in v] for n, v in seconds.items()},
        "peak_gflops": [round(p / 1e9, 1) for p in peaks],
        "share_of_peak_median": {n: round(statistics.median(v), 4) for n, v in share.items()},
        "pass_over_products_median": round(statistics.median(
            a / b for a, b in zip(seconds["pass"], seconds["products"])), 3),
    }))


if __name__ == "__main__":
    main()
