"""WPO (``--loss.use_weighting``) in ``dpocache train``: the policy head's ``log sum_v p(v)^2``
(``CompletionLogProbs(sum_sq_probs=True)``) against a naive full-logits computation in every
path of the head and both layouts, and a training run whose first-step loss equals WPO computed
independently from plain Hugging Face forwards."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from dpocache.batching import collate_pairs, pair_logprobs
from dpocache.data import load_preference_data
from dpocache.logprobs import CompletionLogProbs
from dpocache.prefix import layout_logprobs
from dpocache.tiny import build_model
from dpocache.wpo import wpo_sums

TOL = 1e-5


def naive(model, batch):
    """``(N, T)`` log-probs and ``(N, T)`` log sum_v p(v)^2 from the model's full logits (fp32), 0 off the completion."""
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
    assert out.token_logps.dim() == (1 if layout == "shared" else 2)
    aligned = (want_logps - want_sq).sum(-1)  # (2B,)
    b = len(pairs)
    assert _max_diff(chosen, aligned[:b]) < 1e-4 and _max_diff(rejected, aligned[b:]) < 1e-4
    assert aligned[:b].abs().min() > 1e-2  # not trivially 0
