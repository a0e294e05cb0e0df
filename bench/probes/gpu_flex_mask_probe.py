"""FlexAttention's kernel on the shared and packed layouts' masks, by how the ``mask_mod`` is written.

    python bench/probes/gpu_flex_mask_probe.py [--config 1b-2048] [--budget 32768]

FlexAttention skips the blocks a ``BlockMask`` marks empty and runs full blocks without the
``mask_mod``; on every other block it evaluates the ``mask_mod`` element by element, so how
the rule is written sets the kernel's speed. On the bench data's first packed batch (one row
of ``--budget`` tokens, padded to it) and first shared batch (one pair per row), with the
model's head shape and random bf16 queries, keys and values, this times (median of 10) one
compiled ``flex_attention`` call per rule:

- ``causal``: the whole row causal (the dense kernel's work, for scale);
- ``document``: causal within a pair (torch's document-mask recipe; it lets rejected tokens
  see chosen ones, so it is only a yardstick), from the batch's int16 pair ids, and
  ``document-int32`` from the same ids widened to int32;
- ``segments``: the layouts' rule read from the segment and pair of both the query and the key
  (dpocache's ``mask_mod`` before this probe: int8 segments, int16 pair ids), and
  ``segments-int32`` from the same tensors widened to int32;
- ``ranges``: today's rule, two key ranges per query: the ``mask_mod`` of ``prefix.flex_block_masks``.

It checks that ``segments`` and ``ranges`` mark the same blocks. It also times how the
``BlockMask`` itself is built (median of 10, ``block_mask_build``): ``prefix.flex_block_masks``,
which counts the blocks from the key ranges with no compile, against ``create_block_mask``
compiled with dynamic shapes (the builder it replaced on GPUs: ``compile_s`` is its first call,
the compile included), and checks the two give the same blocks. ``--build-only`` skips the
kernels. Prints one JSON line per batch. Runs on a CPU too (slowly; ``--config 58m --budget
2048`` is a smoke test).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention
from transformers import AutoConfig

BENCH = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(BENCH), str(BENCH.parent)]  # bench/common.py, and dpocache in a checkout not installed

from common import CONFIGS, build_inputs  # noqa: E402

from dpocache.scoring import shared as prefix  # noqa: E402
from dpocache.scoring.layouts import budget_batches  # noqa: E402
from dpocache.cli.cache import load_tokenizer  # noqa: E402
from dpocache.data.pairs import load_preference_data  # noqa: E402
from dpocache.scoring.shared import PAD, PROMPT  # noqa: E402


def median_ms(fn, device: torch.device, n: int = 10) -> float:
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()
    fn()
    fn()
    sync()
    times = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def rules(batch, config):
    """``{name: mask_mod}`` over ``batch``'s ``(B, T)`` tensors; ``ranges`` is the one
    ``prefix.flex_block_masks`` builds for the model's ``config``."""
    def segments(seg, docs):
        def mask_mod(b, h, q, k):
            sq, sk = seg[b, q], seg[b, k]
            attend = (k <= q) & (sk != PAD) & ((sk == PROMPT) | (sk == sq)) & (docs[b, q] == docs[b, k])
            return attend | ((sq == PAD) & (q == k))
        return mask_mod

    def document(docs):
        return lambda b, h, q, k: (k <= q) & (docs[b, q] == docs[b, k])

    seg, docs = batch.segments, batch.documents  # int8, int16
    return {
        "causal": lambda b, h, q, k: k <= q,
        "document": document(docs),
        "document-int32": document(docs.int()),
        "segments": segments(seg, docs),
        "segments-int32": segments(seg.int(), docs.int()),
        "ranges": prefix.flex_block_masks(batch, config).mask_mod,
    }


BLOCK_TENSORS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
                 "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")


def time_builders(batch, config, device: torch.device) -> dict:
    """Milliseconds to build ``batch``'s ``BlockMask``: from the key ranges (today), and with
    ``create_block_mask`` compiled with dynamic shapes (before); whether their blocks are equal."""
    b, t = batch.input_ids.shape
    ranges = prefix.flex_block_masks(batch, config)
    torch._dynamo.reset()
    compiled = torch.compile(create_block_mask, dynamic=True)

    def before():
        return compiled(ranges.mask_mod, b, None, t, t, device=device)

    start = time.perf_counter()
    first = before()
    if device.type == "cuda":
        torch.cuda.synchronize()
    compile_s = time.perf_counter() - start
    return {"ranges_ms": round(median_ms(lambda: prefix.flex_block_masks(batch, config), device), 3),
            "create_block_mask_compiled_ms": round(median_ms(before, device), 3),
            "create_block_mask_compile_s": round(compile_s, 2),
            "same_blocks": all(torch.equal(getattr(first, f), getattr(ranges, f)) for f in BLOCK_TENSORS)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="1b-2048", choices=list(CONFIGS))
    parser.add_argument("--budget", type=int, default=32768)
    parser.add_argument("--build-only", action="store_true", help="time the BlockMask builders alone")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":  # torch 2.13's CPU flex kernel fails to build with dynamic shapes (scoring.attention)
        torch._dynamo.config.automatic_dynamic_shapes = False
    cfg = CONFIGS[args.config]
    inputs = build_inputs(cfg, cfg.pairs)
    tok = load_tokenizer(inputs / "model")
    config = AutoConfig.from_pretrained(inputs / "model")  # a Llama: one BlockMask, no sliding layers
    pairs = load_preference_data(str(inputs / "data.jsonl"), tok, None, None, False, show_progress=False).pairs
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = cfg.hidden_size // heads
    packed = budget_batches(pairs, args.budget, layout="packed")[0]
    shared = budget_batches(pairs, args.budget, layout="shared")[0]
    batches = {"packed": prefix.collate_packed(packed, tok.pad_token_id, args.budget, 128),
               "shared": prefix.collate_layout("shared", shared, tok.pad_token_id, 128)}
    for name, batch in batches.items():
        batch = batch.to(device)
        b, t = batch.input_ids.shape
        q = torch.randn(b, heads, t, head_dim, device=device, dtype=torch.bfloat16)
        k = torch.randn(b, kv_heads, t, head_dim, device=device, dtype=torch.bfloat16)
        v = torch.randn(b, kv_heads, t, head_dim, device=device, dtype=torch.bfloat16)
        result = {"batch": name, "shape": [b, t], "pairs": batch.num_pairs, "device": str(device),
                  "gpu": torch.cuda.get_device_name() if device.type == "cuda" else None, "torch": torch.__version__}
        result["block_mask_build"] = time_builders(batch, config, device)
        if args.build_only:
            print(json.dumps(result), flush=True)
            continue
        masks = {}
        for rule, mask_mod in rules(batch, config).items():
            torch._dynamo.reset()
            masks[rule] = mask = create_block_mask(mask_mod, b, None, t, t, device=device)
            flex = torch.compile(flex_attention, dynamic=False)
            result[rule] = {"ms": round(median_ms(lambda: flex(q, k, v, block_mask=mask, enable_gqa=True), device), 3),
                            "sparsity_percent": round(float(mask.sparsity()), 1),
                            "partial_blocks": int(mask.kv_num_blocks.sum()),
                            "full_blocks": int(mask.full_kv_num_blocks.sum())}
        result["same_blocks"] = all(torch.equal(getattr(masks["segments"], f), getattr(masks["ranges"], f))
                                    for f in BLOCK_TENSORS)
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
