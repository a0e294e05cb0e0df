"""Tests for dpocache.scoring.logprobs, dpocache.scoring.padded and dpocache.models.reference.

Every value is compared with the naive computation — the model's full logits, upcast, log-softmax,
gather — in float32 at the shapes the cache build runs: a batch of pairs of varied lengths,
right-padded.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from dpocache.data.pairs import load_preference_data
from dpocache.models.reference import ReferenceModel
from dpocache.models.tiny import ARCHITECTURES, build_model
from dpocache.scoring.logprobs import CompletionLogProbs
from dpocache.scoring.padded import collate_pairs, pair_logprobs

TOL = 1e-5


def naive_logps(model, input_ids, attention_mask, completion_mask):
    """``(N, T)`` reference implementation: full logits in fp32, 0 off the completion."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits.float()  # (N, T, V)
    logps = logits[:, :-1].log_softmax(-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)  # (N, T-1)
    return F.pad(logps * completion_mask[:, 1:], (1, 0))  # (N, T)


@pytest.fixture(scope="module")
def pairs(tokenizer, make_rows):
    """12 pairs of varied lengths (prompt 5-35 tokens, completions 2-25)."""
    data = load_preference_data(make_rows(12, seed=5), tokenizer, show_progress=False)
    lengths = {len(p.prompt_ids) + max(len(p.chosen_ids), len(p.rejected_ids)) for p in data.pairs}
    assert len(lengths) > 4  # varied, so the batch is padded
    return data.pairs


@pytest.fixture(scope="module")
def batch(pairs, tokenizer):
    b = collate_pairs(pairs, tokenizer.pad_token_id)
    assert b.num_pairs >= 8 and (b.attention_mask == 0).any()
    return b


def _max_diff(a, b):
    return (a - b).abs().max().item()


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_fast_path_matches_naive(tiny_models, batch, arch):
    model = tiny_models[arch]
    lp = CompletionLogProbs(model)
    assert lp.fast_path is True
    with torch.no_grad():
        fast = lp(batch.input_ids, batch.attention_mask, batch.completion_mask)
        naive = naive_logps(model, batch.input_ids, batch.attention_mask, batch.completion_mask)
    assert fast.dtype == torch.float32 and fast.shape == batch.input_ids.shape
    assert _max_diff(fast, naive) < TOL
    mask = batch.completion_mask.bool()
    assert (fast[~mask] == 0).all()
    assert (fast[mask] < 0).all()


def test_gemma2_soft_capping_is_reproduced(tokenizer, batch):
    """A cap small enough to matter: the fast path must apply it, and without it the values
    would be far off (so the comparison above can tell)."""
    model = build_model("gemma2", tokenizer, final_logit_softcapping=0.5).eval()
    lp = CompletionLogProbs(model)
    assert lp.fast_path is True
    with torch.no_grad():
        fast = lp(batch.input_ids, batch.attention_mask, batch.completion_mask)
        naive = naive_logps(model, batch.input_ids, batch.attention_mask, batch.completion_mask)
        lp._transform = lambda logits: logits  # what a head that forgot the cap computes
        uncapped = lp(batch.input_ids, batch.attention_mask, batch.completion_mask)
    assert _max_diff(fast, naive) < TOL
    assert _max_diff(uncapped, naive) > 1e-2


def test_unknown_head_falls_back_to_the_models_forward(tokenizer, batch, caplog):
    model = build_model("llama", tokenizer).eval()
    original = model.forward

    def doubled(*args, **kwargs):  # a head transform the fast path does not know
        out = original(*args, **kwargs)
        out.logits = out.logits * 2
        return out

    model.forward = doubled
    with caplog.at_level(logging.WARNING, logger="dpocache.scoring.logprobs"):
        lp = CompletionLogProbs(model)
    assert lp.fast_path is False
    assert "falling back" in caplog.text
    with torch.no_grad():
        values = lp(batch.input_ids, batch.attention_mask, batch.completion_mask)
        naive = naive_logps(model, batch.input_ids, batch.attention_mask, batch.completion_mask)
        lp.fast_path = True  # the chunked head regardless of the probe's verdict
        fast = lp(batch.input_ids, batch.attention_mask, batch.completion_mask)
    assert _max_diff(values, naive) < TOL
    assert _max_diff(fast, naive) > 1e-2  # the fast path would have been wrong


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_independent_of_batch_composition_and_padding(tiny_models, pairs, tokenizer, arch):
    lp = CompletionLogProbs(tiny_models[arch])

    def width(p):
        return len(p.prompt_ids) + max(len(p.chosen_ids), len(p.rejected_ids))

    by_length = sorted(pairs, key=width)
    short = by_length[0]
    with torch.no_grad():
        mixed_pairs = [by_length[-1], short] + by_length[-4:-1]
        alone = pair_logprobs(lp, collate_pairs([short], tokenizer.pad_token_id), [short])
        batch = collate_pairs(mixed_pairs, tokenizer.pad_token_id)
        mixed = pair_logprobs(lp, batch, mixed_pairs)
        mixed_rows = lp(batch.input_ids, batch.attention_mask, batch.completion_mask)  # (2B, T)
    assert width(by_length[-1]) > width(short) + 5  # the short pair is padded in the batch
    assert abs(alone.chosen_logps[0] - mixed.chosen_logps[1]) < TOL
    assert abs(alone.rejected_logps[0] - mixed.rejected_logps[1]) < TOL
    assert len(alone.chosen_token_logps[0]) == len(short.chosen_ids) > 0
    assert _max_diff(alone.chosen_token_logps[0], mixed.chosen_token_logps[1]) < TOL
    assert _max_diff(alone.rejected_token_logps[0], mixed.rejected_token_logps[1]) < TOL
    assert (mixed_rows[1, width(short):] == 0).all()  # padding scores 0


def test_small_logits_budget_chunks_to_the_same_values(tiny_models, batch, monkeypatch):
    # The row-chunked head (training, bf16, GPUs); fp32 CPU inference would take the tiles.
    monkeypatch.setattr(CompletionLogProbs, "_tiles_apply", staticmethod(lambda head, hidden: False))
    model = tiny_models["llama"]
    vocab = model.config.vocab_size
    scored = int(batch.completion_mask[:, 1:].sum())
    chunked = CompletionLogProbs(model, logits_budget=3 * vocab)  # 3 rows of logits at a time
    assert scored // 3 > 20  # many chunks
    whole = CompletionLogProbs(model)
    with torch.no_grad():
        a = chunked(batch.input_ids, batch.attention_mask, batch.completion_mask)
        b = whole(batch.input_ids, batch.attention_mask, batch.completion_mask)
        naive = naive_logps(model, batch.input_ids, batch.attention_mask, batch.completion_mask)
    assert _max_diff(a, b) < TOL
    assert _max_diff(a, naive) < TOL


@pytest.mark.parametrize("arch", ["llama", "gpt2", "gemma2"])  # gpt2 ties its head; gemma2 soft-caps
def test_cpu_tiles_of_rows_and_vocabulary_give_the_naive_values(tokenizer, batch, arch, monkeypatch):
    """fp32 CPU inference: tiles of 7 rows x 110 words (vocab 512: a partial last tile), the
    log-sum-exp carried across tiles; the same values as the full log-softmax."""
    import dpocache.scoring.logprobs as logprobs

    monkeypatch.setattr(logprobs, "CPU_TILE_ROWS", 7)
    monkeypatch.setattr(logprobs, "CPU_TILE_VOCAB", 110)
    overrides = {"final_logit_softcapping": 0.5} if arch == "gemma2" else {}
    model = build_model(arch, tokenizer, **overrides).eval()
    tiled = []
    original = CompletionLogProbs._tiled_head_logps
    monkeypatch.setattr(CompletionLogProbs, "_tiled_head_logps",
                        lambda self, *a: tiled.append(1) or original(self, *a))
    lp = CompletionLogProbs(model)
    assert lp.fast_path is True
    with torch.no_grad():
        fast = lp(batch.input_ids, batch.attention_mask, batch.completion_mask)
        naive = naive_logps(model, batch.input_ids, batch.attention_mask, batch.completion_mask)
    assert tiled and model.config.vocab_size % 110 != 0
    assert _max_diff(fast, naive) < TOL
    labels = batch.input_ids[:, 1:][batch.completion_mask[:, 1:].bool()]
    assert (labels >= model.config.vocab_size // 110 * 110).any()  # some in the partial last tile


@pytest.mark.parametrize("arch", ["llama", "gpt2"])  # gpt2 ties its head to the embeddings
def test_gradients_through_chunked_checkpointed_head_match_naive(tokenizer, batch, arch):
    model = build_model(arch, tokenizer).eval()  # eval: no dropout; gradients still on
    ids, attn, comp = batch.input_ids, batch.attention_mask, batch.completion_mask
    weights = torch.randn(ids.shape, generator=torch.Generator().manual_seed(0))  # (N, T)

    lp = CompletionLogProbs(model, logits_budget=7 * model.config.vocab_size)
    (lp(ids, attn, comp) * weights).sum().backward()
    fast = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    (naive_logps(model, ids, attn, comp) * weights).sum().backward()
    naive = {n: p.grad.clone() for n, p in model.named_parameters()}

    assert fast.keys() == naive.keys()
    head = model.get_output_embeddings().weight
    assert any(p is head for p in model.parameters())
    for name in naive:
        assert naive[name].abs().max() > 0, name
        assert _max_diff(fast[name], naive[name]) < TOL, name


class _WholeLogitsOps(TorchDispatchMode):
    """The names of the ops run inside it that make an fp32 tensor of ``numel`` elements (a
    chunk's whole logits), views aside."""

    def __init__(self, numel: int):
        super().__init__()
        self.numel, self.names = numel, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and out.numel() == self.numel and out.dtype == torch.float32 \
                and not func.is_view:
            self.names.append(func.overloadpacket.__name__)
        return out


def test_a_bf16_chunk_with_gradients_is_the_fp64_log_softmax_in_few_passes(tokenizer):
    """A chunk of bf16 logits under autograd, as the policy's head gives them: the float64
    log-softmax of those logits, and their gradient within bf16 rounding; the backward (the
    chunk's recompute included) makes no fp32 tensor of the whole logits but the cast, the
    log-softmax and the gather's and the log-softmax's backwards (torch's logsumexp and its
    backward made three more: a difference, its exp and a product)."""
    model = build_model("llama", tokenizer).eval().bfloat16()
    lp = CompletionLogProbs(model, probe=False)
    vocab, hidden = model.config.vocab_size, model.config.hidden_size
    gen = torch.Generator().manual_seed(2)
    h = torch.randn(12, hidden, generator=gen).bfloat16().requires_grad_(True)
    labels = torch.randint(0, vocab, (12,), generator=gen)
    weights = torch.randn(12, generator=gen)
    mode = _WholeLogitsOps(12 * vocab)
    with mode:
        out = lp.head_logps(h, labels)
        forward = list(mode.names)
        (out * weights).sum().backward()
    backward = mode.names[len(forward):]
    assert forward == ["_to_copy", "_log_softmax"]
    assert sorted(backward) == sorted(["_to_copy", "_log_softmax", "new_zeros", "scatter_add",
                                       "_log_softmax_backward_data"])
    # independent: float64 from the same bf16 logits (the head's bf16 product)
    h64 = h.detach().double().requires_grad_(True)
    logits = (h64.bfloat16() @ model.get_output_embeddings().weight.T).double()  # the bf16 product, exactly
    want = logits.log_softmax(-1).gather(-1, labels[:, None]).squeeze(-1)
    torch.testing.assert_close(out.double(), want, rtol=0, atol=1e-5)
    grad_logits = torch.autograd.grad((want * weights.double()).sum(), logits)[0]  # (C, V)
    want_grad = grad_logits @ model.get_output_embeddings().weight.double()
    torch.testing.assert_close(h.grad.double(), want_grad, rtol=2e-2, atol=2e-2 * want_grad.abs().max().item())


def test_pair_logprobs_splits_chosen_and_rejected(tiny_models, pairs, batch):
    model = tiny_models["qwen2"]
    with torch.no_grad():
        out = pair_logprobs(CompletionLogProbs(model), batch)
        naive = naive_logps(model, batch.input_ids, batch.attention_mask, batch.completion_mask).sum(-1)
    b = len(pairs)
    assert out.chosen_tokens.tolist() == [len(p.chosen_ids) for p in pairs]
    assert out.rejected_tokens.tolist() == [len(p.rejected_ids) for p in pairs]
    assert _max_diff(out.chosen_logps, naive[:b]) < 1e-4
    assert _max_diff(out.rejected_logps, naive[b:]) < 1e-4


# ------------------------------------------------------------------------------------ reference


def test_reference_model_from_pretrained(model_dir, batch):
    from transformers import AutoModelForCausalLM

    ref = ReferenceModel.from_pretrained(model_dir, "float32", device="cpu")
    assert ref.dtype == torch.float32 and ref.forward_passes == 0
    ids, attn, comp = batch.input_ids, batch.attention_mask, batch.completion_mask
    out = ref.logprobs(ids, attn, comp)
    assert ref.forward_passes == 1 and ref.tokens == int(attn.sum())
    ref.logprobs(ids[:2], attn[:2], comp[:2])
    assert ref.forward_passes == 2 and ref.tokens == int(attn.sum() + attn[:2].sum())

    assert not out.requires_grad
    assert (out[comp == 0] == 0).all()  # prompt and padding
    assert (out[attn == 0] == 0).all()
    assert (out[comp == 1] < 0).all()
    plain = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        naive = naive_logps(plain, ids, attn, comp)
    assert _max_diff(out, naive) < TOL


def test_reference_of_a_lora_policy_is_the_base_model(tokenizer, batch):
    from peft import LoraConfig, get_peft_model

    ids, attn, comp = batch.input_ids, batch.attention_mask, batch.completion_mask
    base = ReferenceModel(build_model("llama", tokenizer, seed=0))
    base_values = base.logprobs(ids, attn, comp)

    policy = get_peft_model(build_model("llama", tokenizer, seed=0),
                            LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"]))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:  # B starts at zero (adapter a no-op): make it matter
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    policy.train()

    ref = ReferenceModel.from_peft_policy(policy)
    values = ref.logprobs(ids, attn, comp)
    assert _max_diff(values, base_values) < 1e-6
    assert ref.forward_passes == 1

    with torch.no_grad():
        adapter_on = CompletionLogProbs(policy)(ids, attn, comp)
    assert _max_diff(adapter_on, base_values) > 1e-3  # the adapter changes the outputs
    # The policy is left as it was: training mode, adapter enabled, LoRA weights trainable.
    assert policy.training
    assert any(p.requires_grad for n, p in policy.named_parameters() if "lora_" in n)
    with torch.no_grad():
        assert _max_diff(CompletionLogProbs(policy)(ids, attn, comp), adapter_on) < TOL


def test_from_peft_policy_rejects_a_plain_model(tiny_models):
    with pytest.raises(TypeError):
        ReferenceModel.from_peft_policy(tiny_models["llama"])


def test_masks_not_in_the_shape_of_the_ids_are_refused(tiny_models):
    """A label-style completion mask, shifted to (N, T - 1), was accepted and scored the wrong tokens."""
    from dpocache.scoring.logprobs import CompletionLogProbs

    scorer = CompletionLogProbs(tiny_models["llama"])
    ids = torch.randint(3, 100, (2, 8))
    mask = torch.zeros_like(ids)
    mask[:, 5:] = 1
    with pytest.raises(ValueError, match=r"^completion_mask: expected the shape of input_ids \(2, 8\), got shape "
                       r"\(2, 7\) \(1 on each completion token itself"):
        scorer(ids, torch.ones_like(ids), mask[:, 1:])
    with pytest.raises(ValueError, match=r"^completion_mask: expected the shape of input_ids \(2, 8\), got None"):
        scorer(ids, torch.ones_like(ids), None)
    with pytest.raises(ValueError, match=r"^attention_mask: expected the shape of input_ids \(2, 8\), got shape "
                       r"\(8,\)"):
        scorer(ids, torch.ones(8), mask)
    with pytest.raises(ValueError, match=r"^input_ids: expected \(N, T\) token ids, got shape \(8,\)"):
        scorer(ids[0], torch.ones(8), mask[0])


def test_a_model_without_its_output_head_is_named(tiny_models):
    """``CompletionLogProbs(model.model)`` failed at the first call on a missing ``logits``."""
    with pytest.raises(TypeError, match="^model: expected a causal language model with its output head .*got "
                       "LlamaModel"):
        CompletionLogProbs(tiny_models["llama"].model)
    with pytest.raises(TypeError, match="got Linear"):
        CompletionLogProbs(torch.nn.Linear(3, 3))
