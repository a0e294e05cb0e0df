"""Attention of shared-prompt rows on a GPU: the dense boolean mask through SDPA against
varlen flash attention (``torch.nn.attention.varlen.varlen_attn``) over two sequences per pair.

    python bench/probes/gpu_varlen_probe.py [--rows 12] [--prompt 1280] [--completion 640]

A shared row is ``[prompt | chosen | rejected]``: chosen tokens attend the prompt and the
chosen tokens before them, rejected tokens the prompt and the rejected tokens before them.
Varlen flash attention runs that as two causal sequences per pair, with no mask at all:
``[prompt, chosen]`` against itself, and ``rejected`` against ``[prompt, rejected]`` (causal
aligned bottom-right, as flash attention aligns it when there are fewer queries than keys);
the prompt's keys and values are gathered a second time for the second sequence. Prints the
largest difference from the masked SDPA output and the time of each (median of 20).
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics

import torch
import torch.nn.functional as F


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=12)
    p.add_argument("--prompt", type=int, default=1280)
    p.add_argument("--completion", type=int, default=640)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    args = p.parse_args()
    from torch.nn.attention import varlen

    print(json.dumps({"torch": torch.__version__, "varlen_attn": str(inspect.signature(varlen.varlen_attn))}))
    dev, dt = torch.device("cuda"), torch.bfloat16
    B, P, C, H, KV, D = args.rows, args.prompt, args.completion, args.heads, args.kv_heads, args.head_dim
    T = P + 2 * C
    torch.manual_seed(0)
    q = torch.randn(B, H, T, D, device=dev, dtype=dt)
    k = torch.randn(B, KV, T, D, device=dev, dtype=dt)
    v = torch.randn(B, KV, T, D, device=dev, dtype=dt)

    # The dense rule: causal, and a rejected token never sees a chosen one.
    pos = torch.arange(T, device=dev)
    seg = torch.where(pos < P, 0, torch.where(pos < P + C, 1, 2))
    allowed = (pos[None, :] <= pos[:, None]) & ~((seg[:, None] == 2) & (seg[None, :] == 1))
    mask = allowed.expand(B, 1, T, T)

    def masked():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    # Varlen: tokens-major (N, heads, D); per pair two sequences, [P C] and R (keys [P R]).
    pc, r = slice(0, P + C), slice(P + C, T)
    gqa = "enable_gqa" in inspect.signature(varlen.varlen_attn).parameters
    lens_q = torch.tensor([P + C, C] * B, device=dev, dtype=torch.int32)
    lens_k = torch.tensor([P + C, P + C] * B, device=dev, dtype=torch.int32)
    cu_q = F.pad(lens_q.cumsum(0, dtype=torch.int32), (1, 0))
    cu_k = F.pad(lens_k.cumsum(0, dtype=torch.int32), (1, 0))
    # Which row token each packed key is: [0..P+C) then [0..P) ++ [P+C..T), per row.
    key_index = torch.cat([torch.arange(0, P + C), torch.arange(0, P), torch.arange(P + C, T)]).to(dev)

    def packed_varlen():
        qt = q.transpose(1, 2)  # (B, T, H, D)
        qp = torch.cat([qt[:, pc], qt[:, r]], 1).reshape(-1, H, D)
        kt, vt = k.transpose(1, 2).index_select(1, key_index), v.transpose(1, 2).index_select(1, key_index)
        if not gqa:
            kt, vt = kt.repeat_interleave(H // KV, 2), vt.repeat_interleave(H // KV, 2)
        kp, vp = kt.reshape(-1, kt.shape[2], D), vt.reshape(-1, vt.shape[2], D)
        kwargs = {"enable_gqa": True} if gqa else {}
        if "window_size" in inspect.signature(varlen.varlen_attn).parameters:
            kwargs["window_size"] = (-1, 0)
        else:
            kwargs["is_causal"] = True
        out = varlen.varlen_attn(qp, kp, vp, cu_q, cu_k, P + C, P + C, **kwargs)  # (N, H, D)
        out = out.view(B, T, H, D)  # per row: [P C] then R, the row's own order
        return out.transpose(1, 2)

    want, got = masked(), packed_varlen()
    diff = float((want.float() - got.float()).abs().max())

    def time_ms(fn, n=20):
        for _ in range(3):
            fn()
        times = []
        for _ in range(n):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b))
        return statistics.median(times)

    print(json.dumps({"rows": B, "prompt": P, "completion": C, "max_abs_diff": diff, "gqa_native": gqa,
                      "ms_sdpa_bool_mask": time_ms(masked), "ms_varlen_two_sequences": time_ms(packed_varlen)}))


if __name__ == "__main__":
    main()
