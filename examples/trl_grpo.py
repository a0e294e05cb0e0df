"""GRPO with TRL's trainer and dpocache's reference, nothing downloaded: ``CachedGRPOTrainer`` is
TRL 1.16's ``GRPOTrainer`` whose reference pass goes through dpocache's ``ReferenceService``
(each group's prompt run once, completion positions only). With its defaults (20 steps) about 10 s
on a 2-core CPU, 18 s with ``--ray``, imports included (2026-11-28; needs ``pip install 'dpocache[trl]'``, and
``'dpocache[trl,ray]'`` for ``--ray``). tests/integrations/test_trl_grpo.py runs it.

The task is the demo's (``dpocache.training.demo``): the prompt is a list of numbers, a good
completion is the list sorted. Each step TRL samples G = 8 completions for each of 4 prompts,
scores them with the rule below, and steps the GRPO loss with the KL to the reference
(``beta``). The policy starts as the reference, so the KL starts at 0 and rises as it moves.

    python examples/trl_grpo.py                  # the reference in this process (reference=None: TRL's own)
    python examples/trl_grpo.py --ray            # a ReferencePool: one Ray replica in another process
    python examples/trl_grpo.py --steps 40 --lora
"""

from __future__ import annotations

import argparse
import random
import re
from pathlib import Path

import torch
from datasets import Dataset
from peft import LoraConfig
from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback, TrainerCallback
from trl import GRPOConfig

from dpocache.integrations.trl_grpo import CachedGRPOTrainer
from dpocache.models.tiny import save_tiny_model
from dpocache.service import ReferencePool


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("trl-grpo-example"), help="where the model and run are written")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--prompts", type=int, default=4, help="prompts per step")
    p.add_argument("--group", type=int, default=8, help="completions per prompt (G)")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--beta", type=float, default=0.04, help="KL coefficient")
    p.add_argument("--lora", action="store_true", help="train a LoRA adapter; the reference is its base")
    p.add_argument("--ray", action="store_true", help="score with a ReferencePool (one Ray replica)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def sorting_prompts(n: int, seed: int) -> Dataset:
    """``n`` prompts "sort: 7 2 9", each with its numbers (TRL passes the column to the reward)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        nums = [rng.randint(0, 99) for _ in range(rng.randint(3, 6))]
        rows.append({"prompt": "sort: " + " ".join(map(str, nums)), "nums": nums})
    return Dataset.from_list(rows)


def sorted_reward(completions: list[str], nums: list[list[int]], **_) -> list[float]:
    """1 for the sorted list; else partial credit for the prompt's numbers it contains, less a
    little for every number that is not one of them (examples/grpo_kl.py's rule)."""
    out = []
    for text, wanted in zip(completions, nums):
        got = [int(x) for x in re.findall(r"\d+", text)]
        if got == sorted(wanted):
            out.append(1.0)
            continue
        out.append(0.5 * len(set(wanted) & set(got)) / len(set(wanted)) - 0.05 * sum(x not in wanted for x in got))
    return out


class PrintSteps(TrainerCallback):
    """One line per step: step, mean reward, KL to the reference, loss."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "kl" in logs:
            print(f"{state.global_step - 1:>4} {logs['reward']:>8.3f} {logs['kl']:>9.5f} {logs['loss']:>9.4f}",
                  flush=True)


def reference_for(args: argparse.Namespace, model_dir: Path):
    """None (the policy's starting weights, loaded in this process) or a one-replica pool."""
    if not args.ray:
        return None
    return ReferencePool(model_dir, num_replicas=1, dtype="float32", device="cpu", temperature=1.0)


def main() -> None:
    args = parse_args()
    model_dir = args.out / "base-model"
    if not (model_dir / "config.json").exists():
        save_tiny_model(model_dir, "llama", seed=args.seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = GRPOConfig(
        output_dir=str(args.out / "run"), per_device_train_batch_size=args.prompts * args.group,
        num_generations=args.group, max_completion_length=args.max_new_tokens, max_steps=args.steps,
        learning_rate=args.lr, beta=args.beta, temperature=1.0, logging_steps=1, report_to=[], use_cpu=True,
        bf16=False, seed=args.seed, save_strategy="no", disable_tqdm=True,
    )
    peft = {}
    if args.lora:
        peft["peft_config"] = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM")
    trainer = CachedGRPOTrainer(
        model=policy, reward_funcs=sorted_reward, args=config, processing_class=tokenizer,
        train_dataset=sorting_prompts(args.steps * args.prompts, args.seed), callbacks=[PrintSteps()],
        reference=reference_for(args, model_dir), **peft,
    )
    trainer.remove_callback(PrinterCallback)  # TRL's dict per step; PrintSteps prints a row instead
    print(f"{'step':>4} {'reward':>8} {'kl':>9} {'loss':>9}")
    trainer.train()
    stats = trainer.dpocache_reference.stats()
    print(f"reference: {stats['trainer_calls']} passes in {stats['trainer_seconds']:.2f} s, "
          f"{stats.get('sequences', 'n/a')} completions, {stats.get('prompt_tokens_saved', 'n/a')} prompt tokens "
          "saved by sharing")


if __name__ == "__main__":
    main()
