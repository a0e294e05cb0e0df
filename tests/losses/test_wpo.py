"""WPO (``--loss.use_weighting``) in ``dpocache train``: the policy head's ``log sum_v p(v)^2``
(``CompletionLogProbs(sum_sq_probs=True)``) against a naive full-logits computation in every
path of the head and both layouts, and a training run whose first-step loss equals WPO computed
independently from plain Hugging Face forwards."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from dpocache.data.pairs import load_preference_data
from dpocache.losses.wpo import wpo_sums
from dpocache.models.tiny import build_model
from dpocache.scoring.layouts import layout_logprobs
from dpocache.scoring.logprobs import CompletionLogProbs
from dpocache.scoring.padded import collate_pairs

TOL = 1e-5


def naive(model, batch):
    """``(N, T)`` log-probs and ``(N, T)`` log sum_v p(v)^2 from the full logits (fp32), 0 off the completion."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False).logits
    logp = logits[:, :-1].float().log_softmax(-1)  # (N, T-1, V)
    mask = batch.completion_mask[:, 1:]
    picked = logp.gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1) * mask
    sum_sq = torch.logsumexp(2 * logp, dim=-1) * mask
    return F.pad(picked, (1, 0)), F.pad(sum_sq, (1, 0))


def _max_diff(a, b):
    return (a - b).abs().max().item()


@pytest.fixture(scope="module")
def pairs(tokenizer, make_rows):
    return load_preference_data(make_rows(10, seed=7), tokenizer, show_progress=False).pairs


@pytest.fixture(scope="module")
def batch(pairs, tokenizer):
    return collate_pairs(pairs, tokenizer.pad_token_id)


def test_off_by_default(tiny_models, batch):
    lp = CompletionLogProbs(tiny_models["llama"])
    with torch.no_grad():
        lp(batch.input_ids, batch.attention_mask, batch.completion_mask)
    assert lp.sum_sq_probs is False and lp.log_sum_sq_probs is None


@pytest.mark.parametrize("arch", ["llama", "gpt2", "gemma2"])  # gpt2 ties its head; gemma2 soft-caps
def test_head_sum_sq_matches_full_logits_in_inference(tokenizer, batch, arch):
    """fp32 CPU inference, where the log-prob-only tiles would run: the flag takes the chunked
    head, and both outputs equal the full-logits values."""
    overrides = {"final_logit_softcapping": 0.5} if arch == "gemma2" else {}
    model = build_model(arch, tokenizer, **overrides).eval()
    lp = CompletionLogProbs(model, sum_sq_probs=True)
    assert lp.fast_path is True
    with torch.no_grad():
        logps = lp(batch.input_ids, batch.attention_mask, batch.completion_mask)
        want_logps, want_sq = naive(model, batch)
    assert lp.log_sum_sq_probs.shape == logps.shape == batch.input_ids.shape
    assert lp.log_sum_sq_probs.dtype == torch.float32
    assert _max_diff(logps, want_logps) < TOL
    assert _max_diff(lp.log_sum_sq_probs, want_sq) < TOL
    mask = batch.completion_mask.bool()
    assert (lp.log_sum_sq_probs[~mask] == 0).all() and (lp.log_sum_sq_probs[mask] < 0).all()


def test_head_sum_sq_in_checkpointed_chunks_keeps_log_probs_and_gradients(tokenizer, batch):
    """Training: many checkpointed chunks. The extra output equals the naive one, is detached,
    and the log-probs and their gradients are those of the head without it."""
    model = build_model("llama", tokenizer).eval()
    ids, attn, comp = batch.input_ids, batch.attention_mask, batch.completion_mask
    weights = torch.randn(ids.shape, generator=torch.Generator().manual_seed(0))
    budget = 5 * model.config.vocab_size
    assert int(comp[:, 1:].sum()) // 5 > 20  # many chunks

    plain = CompletionLogProbs(model, logits_budget=budget)
    (plain(ids, attn, comp) * weights).sum().backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    lp = CompletionLogProbs(model, logits_budget=budget, sum_sq_probs=True)
    logps = lp(ids, attn, comp)
    assert not lp.log_sum_sq_probs.requires_grad
    (logps * weights).sum().backward()
    with torch.no_grad():
        want_logps, want_sq = naive(model, batch)
    assert _max_diff(logps.detach(), want_logps) < TOL
    assert _max_diff(lp.log_sum_sq_probs, want_sq) < TOL
    for name, p in model.named_parameters():
        assert _max_diff(p.grad, want[name]) < TOL, name


def test_head_sum_sq_of_the_models_own_forward(tokenizer, batch):
    """A head the chunked path does not reproduce: the model's forward runs, and the extra
    output comes from its logits."""
    model = build_model("llama", tokenizer).eval()
    original = model.forward

    def doubled(*args, **kwargs):
        out = original(*args, **kwargs)
        out.logits = out.logits * 2
        return out

    model.forward = doubled
    lp = CompletionLogProbs(model, sum_sq_probs=True)
    assert lp.fast_path is False
    with torch.no_grad():
        logps = lp(batch.input_ids, batch.attention_mask, batch.completion_mask)
        want_logps, want_sq = naive(model, batch)
    assert _max_diff(logps, want_logps) < TOL
    assert _max_diff(lp.log_sum_sq_probs, want_sq) < TOL


@pytest.mark.parametrize("layout", ["padded", "shared"])
def test_wpo_sums_in_either_layout_equal_full_logits(tiny_models, pairs, batch, tokenizer, layout):
    """Per-pair sums of log p(y_t) - log sum_v p(v)^2 through training's layout_logprobs."""
    model = tiny_models["llama"]
    lp = CompletionLogProbs(model, sum_sq_probs=True)
    with torch.no_grad():
        out, _ = layout_logprobs(lp, layout, pairs, tokenizer.pad_token_id, "cpu")
        chosen, rejected = wpo_sums(out, lp.log_sum_sq_probs)
        want_logps, want_sq = naive(model, batch)
    assert lp.log_sum_sq_probs.dim() == (1 if layout == "shared" else 2)
    aligned = (want_logps - want_sq).sum(-1)  # (2B,)
    b = len(pairs)
    assert _max_diff(chosen, aligned[:b]) < 1e-4 and _max_diff(rejected, aligned[b:]) < 1e-4
    assert aligned[:b].abs().min() > 1e-2  # not trivially 0


# ------------------------------------------------------------------ WPO in dpocache train

from train_fixtures import (  # noqa: E402,F401
    base_model, eval_jsonl, eval_records, flags, one_thread, run_training, train_jsonl, train_records,
)


@pytest.fixture(scope="module")
def other_reference(tmp_path_factory):
    from dpocache.models.tiny import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("wpo-ref"), "llama", seed=1)


def _hf_values(model, prompt, completion):
    """Per-token ``log p(y_t)`` and ``log sum_v p(v)^2`` of ``completion`` after ``prompt`` by a
    plain Hugging Face forward (full logits)."""
    ids = torch.tensor([list(prompt) + list(completion)])
    with torch.no_grad():
        logp = model(input_ids=ids).logits[0, :-1].float().log_softmax(-1)  # (T-1, V)
    start = len(prompt) - 1
    picked = logp.gather(-1, ids[0, 1:, None])[start:, 0]
    return picked, torch.logsumexp(2 * logp, dim=-1)[start:]


def _sequence(values, shared, ld_alpha):
    return float(values[:shared].sum() + (1.0 if ld_alpha is None else ld_alpha) * values[shared:].sum())


def _expected_first_step(base_model, data, other_reference, ld_alpha=None, beta=0.1):
    """Step 1's batch (seed 42's order, 4 pairs): per-pair WPO weights and sigmoid losses
    written out from HF forwards (TRL 1.16's use_weighting: weights from the plain per-token
    values even under ld_alpha)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dpocache.data.order import training_order

    tokenizer = AutoTokenizer.from_pretrained(base_model)
    pairs = load_preference_data(str(data), tokenizer, 64, None, False, show_progress=False).pairs
    batch = [pairs[i] for i in training_order(len(pairs), 42, 0)[:4]]
    policy = AutoModelForCausalLM.from_pretrained(base_model, dtype=torch.float32).eval()
    reference = AutoModelForCausalLM.from_pretrained(other_reference, dtype=torch.float32).eval()
    weights, losses = [], []
    for p in batch:
        shared = min(len(p.chosen_ids), len(p.rejected_ids)) if ld_alpha is not None else 10**9
        pc, sq_c = _hf_values(policy, p.prompt_ids, p.chosen_ids)
        pr, sq_r = _hf_values(policy, p.prompt_ids, p.rejected_ids)
        rc, _ = _hf_values(reference, p.prompt_ids, p.chosen_ids)
        rr, _ = _hf_values(reference, p.prompt_ids, p.rejected_ids)
        margin = (_sequence(pc, shared, ld_alpha) - _sequence(rc, shared, ld_alpha)
                  - _sequence(pr, shared, ld_alpha) + _sequence(rr, shared, ld_alpha))
        weight = math.exp(float((pc - sq_c).mean() + (pr - sq_r).mean()))
        weights.append(weight)
        losses.append(weight * math.log1p(math.exp(-beta * margin)))
    return weights, losses


@pytest.mark.parametrize("layout,ld_alpha", [("shared", None), ("padded", None), ("shared", 0.5)])
def test_wpo_first_step_loss(layout, ld_alpha, tmp_path, base_model, pref_jsonl, other_reference):
    """Step 1's loss with --loss.use_weighting and a reference different from the policy equals
    WPO computed independently (HF forwards, full logits), and the mean weight is logged."""
    out = tmp_path / "run"
    extra = ["--loss.ld_alpha", str(ld_alpha)] if ld_alpha is not None else []
    run_training(*flags(base_model, pref_jsonl, out, tmp_path / "cache", "--ref-model", str(other_reference),
                        "--max-steps", "1", "--loss.use_weighting", "true", "--train.layout", layout, *extra))
    record = train_records(out)[0]
    weights, losses = _expected_first_step(base_model, pref_jsonl, other_reference, ld_alpha)
    assert max(abs(w - 1) for w in weights) > 1e-2  # the weights matter
    assert record["loss"] == pytest.approx(sum(losses) / len(losses), abs=1e-5)
    assert record["wpo/weights"] == pytest.approx(sum(weights) / len(weights), abs=1e-5)


def test_wpo_training_run_with_eval(tmp_path, base_model, train_jsonl, eval_jsonl):
    """A short run (policy = reference at the start) trains with finite losses, logs positive
    finite weights for train and eval, and the eval loss is weighted too."""
    out = tmp_path / "run"
    run_training(*flags(base_model, train_jsonl, out, tmp_path / "cache", "--eval-data", str(eval_jsonl),
                        "--max-steps", "3", "--loss.use_weighting", "true"))
    rows = train_records(out)
    assert len(rows) == 3
    for row in rows:
        assert math.isfinite(row["loss"]) and 0 < row["wpo/weights"] < math.inf
    first_eval = eval_records(out)[0]
    assert 0 < first_eval["eval/wpo/weights"] < math.inf
    # policy = reference at step 0: every pair's DPO loss is log 2, so the eval loss is log 2 x the mean weight
    assert first_eval["eval/loss"] == pytest.approx(math.log(2) * first_eval["eval/wpo/weights"], abs=1e-5)
