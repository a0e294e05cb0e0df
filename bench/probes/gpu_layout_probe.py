"""The reference pass's layouts and attention kernels on a GPU, in one process (no TRL).

    python bench/probes/gpu_layout_probe.py        # needs CUDA; builds bench/work/1b-2048-256 if missing

1. ``shared`` against ``padded`` layout: reference-pass tokens/s (prompt once) on the ``1b-2048``
   configuration (1.1B Llama, bf16 autocast, sequences up to 2,048 tokens) at token budgets of
   16k, 32k and 64k, two passes each (the first includes warm-up).
2. A ``torch.profiler`` table of three shared-layout batches (which kernels the time goes to).
3. Attention alone on one batch of 12 shared rows (prompt 1,280, chosen 640, rejected 640; 32
   heads, 4 KV heads, head dim 64): SDPA with the boolean block mask (today's path), compiled
   FlexAttention with the same mask as a ``BlockMask``, and, for scale, SDPA causal (flash) on
   the padded layout's 24 rows of prompt + completion.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention
from torch.profiler import ProfilerActivity, profile

BENCH = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(BENCH), str(BENCH.parent)]  # bench/common.py, and dpocache in a checkout not installed

from common import CONFIGS, build_inputs  # noqa: E402

from dpocache.scoring.layouts import budget_batches  # noqa: E402
from dpocache.cache.build import score_batch  # noqa: E402
from dpocache.cli.cache import load_tokenizer  # noqa: E402
from dpocache.data.pairs import load_preference_data  # noqa: E402
from dpocache.models.reference import ReferenceModel  # noqa: E402


def pass_tokens_per_s(ref: ReferenceModel, pairs, budget: int) -> int:
    batches = budget_batches(pairs, budget, layout=ref.layout)
    score_batch(ref, batches[0], 0)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for b in batches:
        score_batch(ref, b, 0)
    torch.cuda.synchronize()
    return round(sum(p.unique_tokens for p in pairs) / (time.perf_counter() - start))


def layouts(inputs: Path) -> None:
    tok = load_tokenizer(inputs / "model")
    pairs = load_preference_data(str(inputs / "data.jsonl"), tok, None, None, False, show_progress=False).pairs
    for layout in ("shared", "padded"):
        ref = ReferenceModel.from_pretrained(inputs / "model", "bfloat16", "cuda", layout=layout)
        for budget in (16384, 32768, 65536):
            print(layout, budget, [pass_tokens_per_s(ref, pairs, budget) for _ in range(2)], flush=True)
        if layout == "shared":
            batches = budget_batches(pairs, 32768, layout="shared")
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for b in batches[2:5]:
                    score_batch(ref, b, 0)
                torch.cuda.synchronize()
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=22, max_name_column_width=60))
        del ref
        torch.cuda.empty_cache()


def milliseconds(fn, n: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / n * 1e3


def attention(rows=12, heads=32, kv_heads=4, head_dim=64, prompt=1280, completion=640, dev="cuda") -> None:
    t = prompt + 2 * completion
    seg = torch.cat([torch.zeros(prompt), torch.ones(completion), 2 * torch.ones(completion)]).to(dev).int()
    q = torch.randn(rows, heads, t, head_dim, device=dev, dtype=torch.bfloat16)
    k = torch.randn(rows, kv_heads, t, head_dim, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    idx = torch.arange(t, device=dev)
    allowed = (idx[None] <= idx[:, None]) & ((seg[None] == 0) | (seg[None] == seg[:, None]))  # (T, T)
    mask = allowed[None, None].expand(rows, 1, t, t).contiguous()

    def mask_mod(b, h, qi, ki):
        return (ki <= qi) & ((seg[ki] == 0) | (seg[ki] == seg[qi]))

    block_mask = create_block_mask(mask_mod, None, None, t, t, device=dev)
    flex = torch.compile(flex_attention)
    kr, vr = k.repeat_interleave(heads // kv_heads, 1), v.repeat_interleave(heads // kv_heads, 1)
    sdpa = F.scaled_dot_product_attention(q, kr, vr, attn_mask=mask)
    diff = (sdpa - flex(q, k, v, block_mask=block_mask, enable_gqa=True)).abs().max().item()
    print("flex vs sdpa-mask max diff", diff)
    print("ms sdpa bool mask", milliseconds(lambda: F.scaled_dot_product_attention(q, kr, vr, attn_mask=mask)))
    print("ms flex block mask", milliseconds(lambda: flex(q, k, v, block_mask=block_mask, enable_gqa=True)))
    qp = torch.randn(2 * rows, heads, prompt + completion, head_dim, device=dev, dtype=torch.bfloat16)
    kp = torch.randn_like(qp)
    print("ms sdpa causal padded rows (2B x (P+C))",
          milliseconds(lambda: F.scaled_dot_product_attention(qp, kp, kp, is_causal=True)))


if __name__ == "__main__":
    layouts(build_inputs(CONFIGS["1b-2048"], 256))
    attention()
