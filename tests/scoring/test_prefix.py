"""Tests for dpocache.scoring.shared: the shared-prompt layout gives the values of the padded two-row
layout (``CompletionLogProbs`` over ``collate_pairs``), per token, on every tiny architecture,
with padding present in both layouts."""

from __future__ import annotations

import pytest
import torch

from dpocache.cache import CacheStore, build_missing, namespace_for_module
from dpocache.cache.build import score_batch
from dpocache.data.pairs import TokenizedPair, load_preference_data
from dpocache.data.values import PairValues
from dpocache.models.reference import ReferenceModel
from dpocache.models.tiny import ARCHITECTURES, build_model
from dpocache.scoring.layouts import budget_batches
from dpocache.scoring.logprobs import CompletionLogProbs
from dpocache.scoring.packing import place
from dpocache.scoring.padded import collate_pairs
from dpocache.scoring.shared import (
    CHOSEN,
    PAD,
    PROMPT,
    REJECTED,
    attention_mask,
    collate_packed,
    collate_shared,
    sequence_sums,
    shared_prompt_logps,
    split_per_token,
)

TOL = 1e-5


@pytest.fixture(scope="module")
def pairs(tokenizer, make_rows):
    """12 pairs of varied prompt and completion lengths."""
    data = load_preference_data(make_rows(12, seed=7), tokenizer, show_progress=False)
    assert len({p.unique_tokens for p in data.pairs}) > 4  # varied: the shared layout is padded too
    assert len({len(p.chosen_ids) - len(p.rejected_ids) for p in data.pairs}) > 2  # and so is the padded one
    return data.pairs


@pytest.fixture(scope="module")
def mixed_pairs(tokenizer, make_rows):
    """16 pairs from 10 to about 90 tokens: several fit in the row of the longest (packing)."""
    data = load_preference_data(make_rows(16, seed=11, min_prompt=1, max_prompt=40), tokenizer, show_progress=False)
    lengths = sorted(p.unique_tokens for p in data.pairs)
    assert lengths[0] + lengths[1] <= lengths[-1]
    return data.pairs


def padded_values(model, pairs, pad_id):
    """Per-pair per-token chosen and rejected log-probs from the padded layout."""
    batch = collate_pairs(pairs, pad_id)
    with torch.no_grad():
        token_logps = CompletionLogProbs(model)(batch.input_ids, batch.attention_mask,
                                                batch.completion_mask)  # (2B, T)
    mask = batch.completion_mask.bool()
    rows = [token_logps[i][mask[i]] for i in range(token_logps.shape[0])]
    b = len(pairs)
    return rows[:b], rows[b:]


def shared_values(model, pairs, pad_id):
    batch = collate_shared(pairs, pad_id)
    with torch.no_grad():
        logps = shared_prompt_logps(CompletionLogProbs(model), batch)  # (M,)
    return split_per_token(logps, batch), sequence_sums(logps, batch)


def _max_diff(xs, ys):
    return max((x - y).abs().max().item() for x, y in zip(xs, ys))


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_shared_prompt_matches_padded(tiny_models, pairs, tokenizer, arch):
    model = tiny_models[arch]
    pc, pr = padded_values(model, pairs, tokenizer.pad_token_id)
    (sc, sr), (sum_c, sum_r) = shared_values(model, pairs, tokenizer.pad_token_id)
    assert [len(x) for x in sc] == [len(p.chosen_ids) for p in pairs]
    assert [len(x) for x in sr] == [len(p.rejected_ids) for p in pairs]
    assert _max_diff(pc, sc) < TOL
    assert _max_diff(pr, sr) < TOL
    torch.testing.assert_close(sum_c, torch.stack([x.sum() for x in pc]), rtol=1e-6, atol=1e-4)
    torch.testing.assert_close(sum_r, torch.stack([x.sum() for x in pr]), rtol=1e-6, atol=1e-4)


def test_rejected_does_not_see_chosen(tiny_models, pairs, tokenizer):
    """Changing the chosen tokens leaves every rejected log-prob as it was (the block mask)."""
    model = tiny_models["llama"]
    (_, sr), _ = shared_values(model, pairs, tokenizer.pad_token_id)
    altered = [TokenizedPair(p.index, p.prompt_ids, tuple((t + 1) % 300 + 10 for t in p.chosen_ids), p.rejected_ids,
                             p.key) for p in pairs]
    (sc2, sr2), _ = shared_values(model, altered, tokenizer.pad_token_id)
    assert _max_diff(sr, sr2) < TOL


def test_gemma2_sliding_window_on_positions(tokenizer, pairs):
    """A window shorter than the sequences: the shared layout must apply it on positions (the
    rejected tokens sit further from the prompt in the row than in their own sequence)."""
    model = build_model("gemma2", tokenizer, sliding_window=6).eval()
    assert max(p.unique_tokens for p in pairs) > 12
    pc, pr = padded_values(model, pairs, tokenizer.pad_token_id)
    (sc, sr), _ = shared_values(model, pairs, tokenizer.pad_token_id)
    assert _max_diff(pc, sc) < TOL
    assert _max_diff(pr, sr) < TOL


def test_window_on_every_layer_in_the_shared_and_packed_layouts(tokenizer, pairs, mixed_pairs):
    """A ``sliding_window`` without ``layer_types`` (Mistral, Mixtral, Phi-3, Starcoder2) slides on
    every layer. The block masks applied it only with ``layer_types``: the cache build and
    training got full-attention values for sequences longer than the window."""
    model = build_model("mixtral", tokenizer, sliding_window=6).eval()
    pad = tokenizer.pad_token_id
    for data in (pairs, mixed_pairs):
        assert max(p.unique_tokens for p in data) > 12
        pc, pr = padded_values(model, data, pad)
        for batch in (collate_shared(data, pad), collate_packed(data, pad)):
            with torch.no_grad():
                logps = shared_prompt_logps(CompletionLogProbs(model), batch)  # (M,)
            sc, sr = split_per_token(logps, batch)
            assert _max_diff(pc, sc) < TOL and _max_diff(pr, sr) < TOL


def test_models_sliding_on_every_layer_get_a_namespace_of_their_own():
    """Their values stored before the window rule may be wrong; no other model's namespace moves."""
    import hashlib
    import json

    from dpocache.cache.fingerprint import config_sha256

    def before(config):  # the digest as it was computed until the window rule
        return hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()

    llama = {"model_type": "llama", "hidden_size": 64}
    gemma2 = {"model_type": "gemma2", "sliding_window": 6, "layer_types": ["sliding_attention", "full_attention"]}
    qwen3_moe = {"model_type": "qwen3_moe", "sliding_window": 4096, "use_sliding_window": False}
    mistral = {"model_type": "mistral", "sliding_window": 4096}
    for unchanged in (llama, gemma2, qwen3_moe, {**mistral, "sliding_window": None}):
        assert config_sha256(unchanged) == before(unchanged)
    assert config_sha256(mistral) != before(mistral)


def test_layout_of_one_pair(tokenizer, pairs):
    p = pairs[0]
    batch = collate_shared([p], tokenizer.pad_token_id)
    n_p, n_c, n_r = len(p.prompt_ids), len(p.chosen_ids), len(p.rejected_ids)
    assert batch.segments[0].tolist() == [PROMPT] * n_p + [CHOSEN] * n_c + [REJECTED] * n_r
    assert batch.position_ids[0].tolist() == list(range(n_p + n_c)) + list(range(n_p, n_p + n_r))
    # The first chosen and the first rejected token are both predicted from the prompt's last token.
    assert batch.source[0].item() == n_p - 1 and batch.source[n_c].item() == n_p - 1
    assert batch.labels.tolist() == list(p.chosen_ids) + list(p.rejected_ids)


def test_mask_has_no_empty_row(tokenizer, pairs):
    batch = collate_shared(pairs, tokenizer.pad_token_id)
    assert (batch.segments == PAD).any()
    mask = attention_mask(batch, build_model("llama", tokenizer).config)  # (B, 1, T, T) bool
    assert mask.any(-1).all()


def test_budget_batches_cover_every_pair_once(pairs):
    batches = budget_batches(pairs, max_tokens=200, layout="shared")
    assert sorted(p.index for b in batches for p in b) == sorted(p.index for p in pairs)
    for b in batches:
        assert len(b) == 1 or len(b) * max(p.unique_tokens for p in b) <= 200


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_cache_build_same_values_either_layout(tiny_models, pairs, tokenizer, tmp_path, arch):
    """``build_missing`` with the shared layout stores the padded layout's values."""
    model = tiny_models[arch]
    stored = {}
    for layout in ("padded", "shared", "packed"):
        ref = ReferenceModel(model, torch.float32, layout=layout)
        assert ref.layout == layout
        store = CacheStore(tmp_path / layout, namespace_for_module(model, torch.float32)).open()
        build_missing(store, pairs, lambda: ref, pad_id=tokenizer.pad_token_id, max_tokens=256, show_progress=False,
                      per_token=True)
        stored[layout] = store.lookup([p.key for p in pairs])
    for layout in ("shared", "packed"):
        got, want = stored[layout], stored["padded"]
        torch.testing.assert_close(got.chosen_logps, want.chosen_logps, rtol=1e-6, atol=1e-4)
        torch.testing.assert_close(got.rejected_logps, want.rejected_logps, rtol=1e-6, atol=1e-4)
        assert torch.equal(got.chosen_tokens, want.chosen_tokens)


def test_score_batch_dispatches_on_layout(tiny_models, pairs, tokenizer):
    model = tiny_models["qwen2"]
    shared = score_batch(ReferenceModel(model, layout="shared"), pairs, tokenizer.pad_token_id)
    padded = score_batch(ReferenceModel(model, layout="padded"), pairs, tokenizer.pad_token_id)
    for name in PairValues.pair_fields():
        torch.testing.assert_close(getattr(shared, name).float(), getattr(padded, name).float(), rtol=1e-6, atol=1e-4)
    assert _max_diff(shared.chosen_token_logps, padded.chosen_token_logps) < TOL
    assert _max_diff(shared.rejected_token_logps, padded.rejected_token_logps) < TOL


def test_unsupported_attention_falls_back_to_padded(tokenizer, monkeypatch):
    import dpocache.scoring.layout_choice

    model = build_model("llama", tokenizer).eval()
    monkeypatch.setattr(dpocache.scoring.layout_choice, "BLOCK_MASK_ATTENTION", ("eager",))  # sdpa: no mask
    reference = ReferenceModel(model, layout="shared")
    assert reference.layout == "padded" and "sdpa" in reference.layout_choice.reason
    assert ReferenceModel(model).layout_choice.to_json()["requested"] == "auto"
    with pytest.raises(ValueError):
        ReferenceModel(model, layout="bogus")


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_training_layout_same_values_and_gradients(tokenizer, pairs, arch):
    """The shared-prompt training forward gives the padded layout's sums and gradients: the
    prompt's gradient is the sum of what its two sequences send it."""
    from dpocache.models.loading import disable_dropout
    from dpocache.scoring.layouts import layout_logprobs, training_layout

    model = build_model(arch, tokenizer).train()
    disable_dropout(model)  # as training does; GPT-2's dropout would make the two passes differ
    lp = CompletionLogProbs(model)
    assert training_layout(lp, "auto").used == "packed" and training_layout(lp, "shared").used == "shared"
    assert training_layout(lp, "padded").used == "padded" and training_layout(lp, "packed").used == "packed"
    grads, sums = {}, {}
    for name in ("padded", "shared", "packed"):
        model.zero_grad()
        out, tokens = layout_logprobs(lp, name, pairs, tokenizer.pad_token_id, "cpu")
        (out.chosen_logps.sum() - 0.5 * out.rejected_logps.sum()).backward()
        grads[name] = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        sums[name] = (out.chosen_logps.detach(), out.rejected_logps.detach(), out.chosen_tokens, tokens)
    for name in ("shared", "packed"):
        torch.testing.assert_close(sums[name][0], sums["padded"][0], rtol=1e-6, atol=1e-4)
        torch.testing.assert_close(sums[name][1], sums["padded"][1], rtol=1e-6, atol=1e-4)
        assert torch.equal(sums[name][2], sums["padded"][2])
        assert sums[name][3] == sum(p.unique_tokens for p in pairs) < sums["padded"][3]
        torch.testing.assert_close(grads[name], grads["padded"], rtol=1e-4, atol=1e-5)


def test_shared_layout_runs_through_the_wrapped_modules_forward(tiny_models, pairs, tokenizer):
    """DDP reduces gradients and FSDP2 gathers parameters in hooks around ``forward``: the
    shared layout must call the (wrapped) scorer itself, once per micro-batch, and a wrapped
    or sharded scorer keeps the shared layout."""
    from dpocache.scoring.layouts import layout_logprobs, training_layout

    lp = CompletionLogProbs(tiny_models["llama"])
    calls = []
    hook = lp.register_forward_pre_hook(lambda module, args: calls.append(len(args)))
    try:
        with torch.no_grad():
            layout_logprobs(lp, "shared", pairs, tokenizer.pad_token_id, "cpu")
    finally:
        hook.remove()
    assert calls == [2]  # input ids and the block mask; positions and scored tokens by keyword

    wrapper = torch.nn.Module()  # as DistributedDataParallel holds it
    wrapper.module = lp
    assert training_layout(wrapper, "auto").used == "packed"
    sharded = CompletionLogProbs(tiny_models["llama"])
    sharded.__class__ = type("FSDPCompletionLogProbs", (CompletionLogProbs,), {})  # what fully_shard makes of it
    assert training_layout(sharded, "shared").used == "shared"
    with pytest.raises(ValueError):
        training_layout(wrapper, "bogus")


def test_moe_training_keeps_the_padded_layout_and_says_why(tiny_models):
    from dpocache.scoring.layouts import training_layout

    arch = next(a for a in ARCHITECTURES if CompletionLogProbs(tiny_models[a], probe=False).router_loss)
    choice = training_layout(CompletionLogProbs(tiny_models[arch]), "auto")
    assert (choice.requested, choice.used) == ("auto", "padded") and "load-balancing" in choice.reason
    packed = training_layout(CompletionLogProbs(tiny_models[arch]), "packed")
    assert packed.used == "padded" and "load-balancing" in packed.reason
    # The reference pass has no router loss: it packs (test_packed_matches_padded checks its values).
    assert ReferenceModel(tiny_models[arch], layout="packed").layout == "packed"


# --------------------------------------------------------------------------------- packed


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_packed_matches_padded(tiny_models, tokenizer, mixed_pairs, arch):
    """Several pairs per row, block-diagonal, positions restarting per pair: the padded
    layout's values per token, in the pairs' order."""
    model = build_model("gemma2", tokenizer, sliding_window=6).eval() if arch == "gemma2" else tiny_models[arch]
    pad = tokenizer.pad_token_id
    pc, pr = padded_values(model, mixed_pairs, pad)
    for batch in (collate_packed(mixed_pairs, pad), collate_packed(mixed_pairs, pad, width=160, multiple=32)):
        assert batch.input_ids.shape[0] < len(mixed_pairs) and batch.documents.amax() > 0  # pairs share rows
        with torch.no_grad():
            logps = shared_prompt_logps(CompletionLogProbs(model), batch)  # (M,)
        sc, sr = split_per_token(logps, batch)
        assert _max_diff(pc, sc) < TOL and _max_diff(pr, sr) < TOL
        sum_c, sum_r = sequence_sums(logps, batch)
        torch.testing.assert_close(sum_r, torch.stack([x.sum() for x in pr]), rtol=1e-6, atol=1e-4)
    assert batch.input_ids.shape[1] == 160


def test_packed_pairs_do_not_see_each_other(tiny_models, tokenizer, mixed_pairs):
    """Changing one pair's tokens leaves the values of the pairs packed beside it as they were."""
    pad = tokenizer.pad_token_id
    lp = CompletionLogProbs(tiny_models["llama"])
    before = collate_packed(mixed_pairs, pad, width=200)
    row = before.input_ids.shape[1]
    first_row = {i for i in range(len(mixed_pairs)) if before.source[before.sequence == i][0] < row}
    assert len(first_row) > 2
    victim = min(first_row)
    altered = list(mixed_pairs)
    p = altered[victim]
    altered[victim] = TokenizedPair(p.index, tuple((t + 3) % 300 + 10 for t in p.prompt_ids), p.chosen_ids,
                              p.rejected_ids, p.key)
    after = collate_packed(altered, pad, width=200)
    assert torch.equal(after.documents, before.documents)  # same places
    with torch.no_grad():
        a, b = shared_prompt_logps(lp, before), shared_prompt_logps(lp, after)
    others = (before.sequence % len(mixed_pairs)) != victim
    assert (a[others] - b[others]).abs().max() < TOL and (a[~others] - b[~others]).abs().max() > 1e-3


def test_packed_positions_and_scored_order(tokenizer, mixed_pairs):
    pad = tokenizer.pad_token_id
    batch = collate_packed(mixed_pairs, pad)
    width = batch.input_ids.shape[1]
    assert width == max(p.unique_tokens for p in mixed_pairs)
    assert batch.labels.tolist() == [t for p in mixed_pairs for t in p.chosen_ids + p.rejected_ids]
    assert batch.num_pairs == len(mixed_pairs) and batch.num_tokens == sum(p.unique_tokens for p in mixed_pairs)
    for i, p in enumerate(mixed_pairs):
        flat = batch.source[batch.sequence == i][0].item() - (len(p.prompt_ids) - 1)  # the pair's first token
        row, start = divmod(flat, width)
        n_p, n_c, n_r = len(p.prompt_ids), len(p.chosen_ids), len(p.rejected_ids)
        assert batch.position_ids[row, start:start + p.unique_tokens].tolist() == (
            list(range(n_p + n_c)) + list(range(n_p, n_p + n_r)))
        assert batch.segments[row, start:start + p.unique_tokens].tolist() == (
            [PROMPT] * n_p + [CHOSEN] * n_c + [REJECTED] * n_r)


def test_place_first_fit():
    assert place([5, 3, 4, 2], 7) == [(0, 0), (1, 4), (1, 0), (0, 5)]  # decreasing: 5, 4, 3, 2
    with pytest.raises(ValueError):
        place([8], 7)


def test_packed_budget_batches_fill_rows_of_the_budget(mixed_pairs):
    """The reference pass's packed batches: one row each, at most the budget, every pair once,
    fewer row slots (padding included) than the shared layout's batches."""
    budget = 200
    batches = budget_batches(mixed_pairs, max_tokens=budget, layout="packed")
    assert sorted(p.index for b in batches for p in b) == sorted(p.index for p in mixed_pairs)
    assert all(sum(p.unique_tokens for p in b) <= budget for b in batches)
    assert sum(len(b) for b in batches[:-1]) > len(batches) - 1  # rows hold several pairs
    shared = budget_batches(mixed_pairs, max_tokens=budget, layout="shared")
    assert sum(p.unique_tokens for p in mixed_pairs) < sum(len(b) * max(p.unique_tokens for p in b) for b in shared)
    assert len(budget_batches(mixed_pairs, max_tokens=50, layout="packed")[0]) == 1  # longer than the budget


def test_packed_training_layout_packs_and_matches_padded(tokenizer, mixed_pairs):
    """A micro-batch's pairs first fit into rows of its longest pair: fewer rows, the padded
    layout's sums and gradients."""
    from dpocache.scoring.layouts import layout_logprobs

    model = build_model("qwen2", tokenizer).train()
    lp = CompletionLogProbs(model)
    grads, sums = {}, {}
    for name in ("padded", "packed"):
        model.zero_grad()
        out, tokens = layout_logprobs(lp, name, mixed_pairs, tokenizer.pad_token_id, "cpu")
        (out.chosen_logps.sum() - 0.5 * out.rejected_logps.sum()).backward()
        grads[name] = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        sums[name] = (out.chosen_logps.detach(), out.rejected_logps.detach())
    torch.testing.assert_close(sums["packed"], sums["padded"], rtol=1e-6, atol=1e-4)
    torch.testing.assert_close(grads["packed"], grads["padded"], rtol=1e-4, atol=1e-5)


def test_sequence_sums_are_each_sequences_sum_in_token_order():
    """Each pair's chosen and rejected sums (a completion may be empty) against a sum of each
    sequence's values taken out by ``batch.sequence`` (within float rounding: torch sums in
    another order); on a CPU bit for bit the sequential sum (``index_add``, as before); no
    host synchronisation; the gradient the sum's weight for every token."""
    torch.manual_seed(0)
    pairs = [TokenizedPair(i, tuple(range(5, 5 + p)), tuple(range(9, 9 + c)), tuple(range(30, 30 + r)), f"k{i}")
             for i, (p, c, r) in enumerate([(3, 40, 7), (1, 1, 0), (6, 300, 250), (2, 5, 1), (4, 0, 3)])]
    batch = collate_shared(pairs, 0)
    logps = (torch.randn(batch.sequence.shape[0]) * 3 - 2).requires_grad_()
    chosen, rejected = sequence_sums(logps, batch)
    n = len(pairs)
    naive = torch.stack([logps[batch.sequence == s].sum() for s in range(2 * n)]).detach()
    torch.testing.assert_close(torch.cat((chosen, rejected)).detach(), naive, rtol=1e-6, atol=1e-5)
    sequential = torch.zeros(2 * n).index_add(0, batch.sequence, logps.detach())
    assert torch.equal(torch.cat((chosen, rejected)).detach(), sequential)
    assert rejected[1] == 0 and chosen[4] == 0
    with torch.profiler.profile() as prof:  # no .item(): on a GPU each is a wait for the device
        sequence_sums(logps, batch)
    assert not {e.name for e in prof.events()} & {"aten::item", "aten::_local_scalar_dense"}
    (chosen.sum() + 2 * rejected.sum()).backward()
    assert torch.equal(logps.grad, torch.where(batch.sequence < n, 1.0, 2.0))
