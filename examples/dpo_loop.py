"""DPO in a training loop of your own, the reference from dpocache's cache, nothing downloaded:
with its defaults (60 steps) about 6 s on a 2-core CPU, the model built (2026-11-28;
tests/e2e/test_examples.py runs it).

The task is the demo's (``dpocache.training.demo``): the prompt is a list of numbers, the chosen
completion the list sorted, the rejected one shuffled. The reference's log-probs are computed once
into the cache (``build_missing``: a second run computes none) and read back as one record
(``CacheStore.lookup``); each step the policy's log-probs of a batch come from ``policy_logps``
and the loss from ``preference_loss``, the formulas ``dpocache train`` runs. The policy starts as
the reference, so the first loss is ln 2 = 0.6931 and the rewards start at 0.

    python examples/dpo_loop.py                       # sigmoid DPO, beta 0.1
    python examples/dpo_loop.py --loss dpo_norm --beta 5 --steps 100
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import dpocache
from dpocache.data.rows import write_jsonl
from dpocache.models.tiny import save_tiny_model
from dpocache.training.demo import sorting_pairs


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("dpo-loop-example"), help="where the model, data and cache go")
    p.add_argument("--loss", default="sigmoid", help="a loss name or spec (docs/losses.md)")
    p.add_argument("--beta", type=float, default=0.1)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch", type=int, default=16, help="pairs a step")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    model_dir, data_file, cache_dir = args.out / "model", args.out / "pairs.jsonl", args.out / "cache"
    if not (model_dir / "config.json").exists():
        save_tiny_model(model_dir, "llama", seed=args.seed)
        write_jsonl(sorting_pairs(400, seed=args.seed), data_file)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    pad_id = tokenizer.pad_token_id or 0
    data = dpocache.load_preference_data(data_file, tokenizer, max_length=128, show_progress=False)

    # The reference: computed where the cache lacks it, then read as one record of N pairs, on the CPU.
    store = dpocache.CacheStore(cache_dir, dpocache.namespace_for_dir(model_dir, torch.float32, cache_dir)).open()
    built = dpocache.build_missing(store, data.pairs, lambda: dpocache.ReferenceModel.from_pretrained(
        model_dir, "float32", device), pad_id=pad_id, show_progress=False)
    print(f"reference: {built.computed} pairs computed, {built.reused} reused from {cache_dir}")
    ref = store.lookup([pair.key for pair in data.pairs])  # PairValues: chosen_logps, rejected_logps, ... (N,)

    policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
    policy.eval()  # no dropout: at step 0 the policy computes exactly the reference's numbers
    scorer = dpocache.CompletionLogProbs(policy)  # made once: the body once, the head on completions only
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.lr)
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(args.seed))
    print(f"{'step':>4} {'loss':>8} {'accuracy':>9} {'margin':>8}")
    for step in range(args.steps):
        start = step * args.batch % len(data)
        idx = order[start:start + args.batch].tolist()
        pi = dpocache.policy_logps(scorer, [data.pairs[i] for i in idx], pad_id, device)  # (B,) with their graph
        r = ref.select(idx).to(device)
        losses, chosen_rewards, rejected_rewards = dpocache.preference_loss(
            args.loss, pi.chosen_logps, pi.rejected_logps, r.chosen_logps, r.rejected_logps,
            r.chosen_tokens, r.rejected_tokens, beta=args.beta)
        loss = losses.mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if step % 10 == 0 or step == args.steps - 1:
            margin = chosen_rewards - rejected_rewards
            print(f"{step:>4} {loss.item():>8.4f} {(margin > 0).float().mean().item():>9.3f} "
                  f"{margin.mean().item():>8.3f}")
    print(f"ln 2 = {math.log(2):.4f}: the first loss of a policy that starts as the reference under sigmoid DPO")


if __name__ == "__main__":
    main()
