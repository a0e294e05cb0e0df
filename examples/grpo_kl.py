"""A tiny GRPO loop with the reference as a service, nothing downloaded: with its defaults (20
steps) about 8 s on a 2-core CPU, 18 s with ``--ray`` (2026-11-25; tests/e2e/test_examples.py runs it).

The task is the demo's (``dpocache.training.demo``): the prompt is a list of numbers, a good completion
is the list sorted. Each step the policy samples G = 8 completions per prompt, a rule scores
them, the group-normalised rewards are the advantages (GRPO, Shao et al. 2024, arXiv
2402.03300), the ``ReferenceService`` returns the reference's per-token log-probs of every
completion (each prompt run once for its 8 completions), and the clipped policy objective
with the k3 KL estimator ``exp(ref - pi) - (ref - pi) - 1`` (Schulman 2020) is stepped. The
policy starts as the reference, so the KL starts at 0 and rises as the policy moves.

    python examples/grpo_kl.py                 # in-process ReferenceService
    python examples/grpo_kl.py --ray           # a ReferencePool of two Ray replicas
    python examples/grpo_kl.py --steps 40 --cache-dir ref-cache
"""

from __future__ import annotations

import argparse
import random
import re
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from dpocache.models.loading import disable_dropout
from dpocache.models.tiny import save_tiny_model
from dpocache.scoring.groups import Group, collate_sequences, per_sequence
from dpocache.scoring.logprobs import CompletionLogProbs
from dpocache.service import ReferencePool, ReferenceService


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("grpo-kl-example"), help="where the tiny model is written")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--prompts", type=int, default=4, help="prompts per step")
    p.add_argument("--group", type=int, default=8, help="completions per prompt (G)")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--beta", type=float, default=0.04, help="KL coefficient")
    p.add_argument("--clip", type=float, default=0.2, help="PPO clip range epsilon")
    p.add_argument("--inner-epochs", type=int, default=2, help="policy updates per batch of samples")
    p.add_argument("--cache-dir", type=Path, default=None, help="the service's look-aside cache (default: none)")
    p.add_argument("--ray", action="store_true", help="score with a ReferencePool of two Ray replicas")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def make_prompt(rng: random.Random) -> tuple[str, list[int]]:
    nums = [rng.randint(0, 99) for _ in range(rng.randint(3, 6))]
    return "sort: " + " ".join(map(str, nums)), nums


def reward(text: str, nums: list[int]) -> float:
    """1 for the sorted list; else partial credit for the prompt's numbers it contains, less a
    little for every number that is not one of them."""
    got = [int(x) for x in re.findall(r"\d+", text)]
    if got == sorted(nums):
        return 1.0
    wanted = set(nums)
    return 0.5 * len(wanted & set(got)) / len(wanted) - 0.05 * sum(x not in wanted for x in got)


@torch.no_grad()
def sample(policy, tokenizer, prompt_ids: list[int], g: int, max_new_tokens: int) -> list[list[int]]:
    """G completions of one prompt, each cut after its first EOS (kept: it is scored)."""
    ids = torch.tensor([prompt_ids] * g)
    out = policy.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, max_new_tokens=max_new_tokens,
                          pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    completions = []
    for row in out[:, len(prompt_ids):].tolist():
        if tokenizer.eos_token_id in row:
            row = row[:row.index(tokenizer.eos_token_id) + 1]
        completions.append(row)
    return completions


def policy_logps(scorer: CompletionLogProbs, groups: list[Group], pad_id: int) -> list[torch.Tensor]:
    """Per-token log-probs of every completion under the policy (with gradients)."""
    batch = collate_sequences(groups, pad_id)
    return per_sequence(scorer(batch.input_ids, batch.attention_mask, batch.completion_mask), batch)


def grpo_loss(new: list[torch.Tensor], old: list[torch.Tensor], ref: list[torch.Tensor], adv: torch.Tensor,
              beta: float, clip: float) -> tuple[torch.Tensor, float]:
    """The clipped objective plus beta * k3 KL, each sequence's tokens averaged, then sequences
    (GRPO's normalisation). Returns (loss, mean per-token KL)."""
    losses, kls = [], []
    for n, o, r, a in zip(new, old, ref, adv):
        ratio = (n - o).exp()  # (c,)
        surrogate = torch.minimum(ratio * a, ratio.clamp(1 - clip, 1 + clip) * a)
        log_ratio = r - n
        kl = log_ratio.exp() - log_ratio - 1  # k3: unbiased, non-negative
        losses.append((-surrogate + beta * kl).mean())
        kls.append(kl.detach().mean())
    return torch.stack(losses).mean(), float(torch.stack(kls).mean())


def main() -> None:
    args = parse_args()
    model_dir = args.out / "base-model"
    if not (model_dir / "config.json").exists():
        save_tiny_model(model_dir, "llama", seed=args.seed)
    # Seeded after the model is built (which draws from torch's generator on the first run only),
    # so that every run with the same seed samples the same rollouts: a rerun's look-aside cache hits.
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    disable_dropout(policy)
    scorer = CompletionLogProbs(policy)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.lr)
    # The reference is the initial policy, read from the same directory: frozen, fp32.
    service_args = dict(dtype="float32", device="cpu", cache_dir=args.cache_dir)
    if args.ray:
        reference = ReferencePool(model_dir, num_replicas=2, **service_args)
    else:
        reference = ReferenceService.from_pretrained(model_dir, **service_args)
    print(f"{'step':>4} {'reward':>8} {'kl':>9} {'loss':>9} {'ref s':>7}")
    for step in range(args.steps):
        groups, advantages, rewards_all = [], [], []
        policy.eval()
        for i in range(args.prompts):
            text, nums = make_prompt(rng)
            prompt_ids = [tokenizer.bos_token_id] + tokenizer(text, add_special_tokens=False)["input_ids"]
            completions = sample(policy, tokenizer, prompt_ids, args.group, args.max_new_tokens)
            rewards = torch.tensor([reward(tokenizer.decode(c, skip_special_tokens=True), nums) for c in completions])
            advantages.append((rewards - rewards.mean()) / (rewards.std() + 1e-4))
            rewards_all.append(rewards)
            groups.append(Group(i, tuple(prompt_ids), tuple(map(tuple, completions)), tuple(range(args.group))))
        policy.train()
        start = time.perf_counter()
        requests = [{"prompt_ids": list(g.prompt), "completion_ids": list(g.completions)} for g in groups]
        ref = [v for per_group in reference.score(requests) for v in per_group]  # (c,) fp32 per completion
        ref_seconds = time.perf_counter() - start
        adv = torch.cat(advantages)
        with torch.no_grad():
            old = policy_logps(scorer, groups, tokenizer.pad_token_id)
        for epoch in range(args.inner_epochs):
            new = policy_logps(scorer, groups, tokenizer.pad_token_id)
            loss, kl = grpo_loss(new, old, ref, adv, args.beta, args.clip)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
            optimizer.step()
            if epoch == 0:  # the KL of the policy that sampled this step's completions
                step_kl, step_loss = kl, float(loss.detach())
        print(f"{step:>4} {float(torch.cat(rewards_all).mean()):>8.3f} {step_kl:>9.5f} {step_loss:>9.4f} "
              f"{ref_seconds:>7.2f}")
    stats = reference.stats()
    print(f"reference: {stats['forward_passes']} forward passes, {stats['forward_sequences']} sequences, "
          f"{stats['prompt_tokens_saved']} prompt tokens saved by sharing, {stats['cache_hits']} cache hits")


if __name__ == "__main__":
    main()
