"""First-step loss of TRL 1.16's DPOTrainer against dpocache.losses.formulas for the loss options
(``ld_alpha``, ``use_weighting``, ``f_divergence_type``), on the same tiny model, reference
(the policy's weights perturbed: different from the policy) and tokenized data, in fp32 on the CPU.

TRL tokenizes the data; dpocache scores the same token ids with its own log-prob code
(``CompletionLogProbs``) and loss functions, so only the formulas are compared.

    python bench/trl_loss_options.py            # prints one line per option set, exit 1 on a mismatch
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from conftest import make_rows  # noqa: E402  (the test suite's row generator)

from dpocache.integrations.trl import truncated_pair  # noqa: E402
from dpocache.losses.formulas import ld_pair_logps  # noqa: E402
from dpocache.losses.registry import preference_loss  # noqa: E402
from dpocache.losses.wpo import wpo_sums  # noqa: E402
from dpocache.models.tiny import save_tiny_model  # noqa: E402
from dpocache.scoring.logprobs import CompletionLogProbs  # noqa: E402
from dpocache.scoring.padded import collate_pairs, pair_logprobs  # noqa: E402

OPTIONS = [
    {"loss_type": ["sigmoid"]},
    {"loss_type": ["sigmoid"], "ld_alpha": 0.5},
    {"loss_type": ["sigmoid"], "use_weighting": True},
    {"loss_type": ["ipo"], "use_weighting": True},
    {"loss_type": ["sigmoid"], "use_weighting": True, "ld_alpha": 0.5},
    {"loss_type": ["apo_zero"], "use_weighting": True},
    {"loss_type": ["sigmoid"], "f_divergence_type": "forward_kl"},
    {"loss_type": ["sigmoid"], "f_divergence_type": "js_divergence"},
    {"loss_type": ["sigmoid"], "f_divergence_type": "alpha_divergence", "f_alpha_divergence_coef": 0.3},
    {"loss_type": ["ipo"], "f_divergence_type": "forward_kl"},
    {"loss_type": ["hinge"], "ld_alpha": 0.3, "f_divergence_type": "js_divergence"},
]
ROWS, MAX_LENGTH, BETA = 8, 48, 0.1


def trl_first_loss(policy_dir, ref_dir, dataset, out, opts):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    args = DPOConfig(output_dir=str(out), per_device_train_batch_size=ROWS, max_steps=1, logging_steps=1,
                     report_to="none", use_cpu=True, max_length=MAX_LENGTH, learning_rate=0.0, save_strategy="no",
                     beta=BETA, disable_tqdm=True, bf16=False, fp16=False, **opts)  # fp32: DPOConfig defaults to bf16
    trainer = DPOTrainer(model=AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32),
                         ref_model=AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32), args=args,
                         train_dataset=dataset, processing_class=AutoTokenizer.from_pretrained(policy_dir))
    trainer.train()
    loss = next(r["loss"] for r in trainer.state.log_history if "loss" in r)
    return loss, trainer.train_dataset


def dpocache_loss(policy_dir, ref_dir, tokenized, opts):
    from transformers import AutoModelForCausalLM

    pairs = [truncated_pair(i, r["prompt_ids"], r["chosen_ids"], r["rejected_ids"], MAX_LENGTH, "keep_start")
             for i, r in enumerate(tokenized)]
    batch = collate_pairs(pairs)
    b, ld_alpha = len(pairs), opts.get("ld_alpha")
    sums, weighting = {}, bool(opts.get("use_weighting"))
    for side, path in (("policy", policy_dir), ("ref", ref_dir)):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        # WPO as dpocache train computes it: log sum_v p(v)^2 from the policy's chunked head (dpocache.losses.wpo).
        scorer = CompletionLogProbs(model, sum_sq_probs=weighting and side == "policy")
        with torch.no_grad():
            lp = pair_logprobs(scorer, batch)
            if ld_alpha is None:
                sums[side] = lp.chosen_logps, lp.rejected_logps
            else:
                # LD-DPO weighs tokens past the shorter completion's length: it needs the (2B, T) values.
                token_logps = scorer(batch.input_ids, batch.attention_mask, batch.completion_mask)
                m = batch.completion_mask
                sums[side] = ld_pair_logps(token_logps[:b], m[:b], token_logps[b:], m[b:], ld_alpha)
            if scorer.sum_sq_probs:
                wpo = wpo_sums(lp, scorer.log_sum_sq_probs)
    counts = batch.completion_mask.sum(-1).float()
    params = {k: v for k, v in opts.items() if k != "loss_type"}
    extra = {"chosen_wpo_logps": wpo[0], "rejected_wpo_logps": wpo[1]} if weighting else {}
    losses, _, _ = preference_loss(",".join(opts["loss_type"]), *sums["policy"], *sums["ref"], counts[:b], counts[b:],
                                   beta=BETA, **params, **extra)
    return float(losses.mean())


def perturbed_copy(model_dir: Path, out: Path, scale: float = 0.05) -> Path:
    """The model with every weight moved by ``scale`` times its own spread: a reference that
    differs from the policy but stays near it, as a policy does during training."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale * p.float().std().nan_to_num(0.0))
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(out)
    return out


def main() -> int:
    from datasets import Dataset

    torch.manual_seed(0)
    work = Path(tempfile.mkdtemp(prefix="trl-loss-options-"))
    policy_dir = save_tiny_model(work / "policy", "llama", seed=0)
    ref_dir = perturbed_copy(policy_dir, work / "ref")
    dataset = Dataset.from_list(make_rows(ROWS, max_prompt=8))
    worst = 0.0
    for i, opts in enumerate(OPTIONS):
        theirs, tokenized = trl_first_loss(policy_dir, ref_dir, dataset, work / f"trl{i}", opts)
        ours = dpocache_loss(policy_dir, ref_dir, tokenized, opts)
        worst = max(worst, abs(ours - theirs))
        print(f"{opts}: TRL {theirs:.6f}  dpocache {ours:.6f}  |diff| {abs(ours - theirs):.2e}")
    print(f"max |diff| {worst:.2e} (tolerance 1e-4)")
    return 0 if worst <= 1e-4 else 1


if __name__ == "__main__":
    sys.exit(main())
