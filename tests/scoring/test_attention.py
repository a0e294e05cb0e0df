"""Tests for dpocache.scoring.attention: the FlexAttention backend (a compiled ``flex_attention`` with a
``BlockMask``, forward only on CPU in torch 2.13) gives the padded layout's values per token
in every layout, on every tiny architecture that supports it; ``auto`` picks it on CUDA only,
and a fallback says why."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import needs_cpu_compile
from test_prefix import _max_diff, padded_values
from transformers import AttentionInterface

from dpocache.cli.entry import main
from dpocache.data.pairs import load_preference_data
from dpocache.models.reference import ReferenceModel
from dpocache.models.tiny import build_model
from dpocache.scoring.attention import FLEX, FLEX_BLOCK, use_attention
from dpocache.scoring.layouts import training_layout
from dpocache.scoring.logprobs import CompletionLogProbs
from dpocache.scoring.shared import collate_layout, shared_prompt_logps, split_per_token

TOL = 1e-5
FLEX_ARCHS = ("llama", "qwen2", "gemma2", "mixtral")  # GPT-2 has no flex_attention in transformers


@pytest.fixture(scope="module")
def pairs(tokenizer, make_rows):
    """10 short pairs of 8 to about 60 tokens: rows of one 128-token block, several pairs each."""
    return load_preference_data(make_rows(10, seed=5, min_prompt=1, max_prompt=30, max_completion=12), tokenizer,
                                show_progress=False).pairs


def _model(arch, tokenizer):
    # Gemma 2 with a window shorter than the rows: sliding layers on positions, and soft-capping.
    return build_model(arch, tokenizer, **({"sliding_window": 6} if arch == "gemma2" else {})).eval()


@pytest.fixture
def flex_calls(monkeypatch):
    """The masks transformers' flex_attention_forward receives (proof that flex ran)."""
    calls = []
    flex = AttentionInterface._global_mapping[FLEX]

    def counted(module, query, key, value, attention_mask, *args, **kwargs):
        calls.append(type(attention_mask).__name__)
        return flex(module, query, key, value, attention_mask, *args, **kwargs)

    monkeypatch.setitem(AttentionInterface._global_mapping, FLEX, counted)
    return calls


def _flex_values(lp, layout, pairs, pad):
    """Per-pair chosen and rejected per-token log-probs of ``lp`` (its model on flex)."""
    if layout == "padded":
        return padded_values(lp.model, pairs, pad)  # transformers' own BlockMask from the 2D mask
    batch = collate_layout(layout, pairs, pad, multiple=FLEX_BLOCK)
    assert batch.input_ids.shape[1] == FLEX_BLOCK
    with torch.no_grad():
        return split_per_token(shared_prompt_logps(lp, batch), batch)


# Each shape compiles a kernel (3-30 s on 2 cores; static on CPU: attention.compile_settings).
# The compile cache is reset before each layout, so each layout's kernel is its own.
@needs_cpu_compile
@pytest.mark.slow
@pytest.mark.parametrize("arch", FLEX_ARCHS)
def test_flex_matches_padded(tokenizer, pairs, arch, flex_calls):
    model = _model(arch, tokenizer)
    pad = tokenizer.pad_token_id
    want_c, want_r = padded_values(model, pairs, pad)  # sdpa, padded layout
    loaded = model.config._attn_implementation  # sdpa (Gemma 2: eager)
    assert use_attention(model, "flex", "cpu") is None and model.config._attn_implementation == FLEX
    lp = CompletionLogProbs(model)
    for layout in ("packed", "shared", "padded"):
        torch._dynamo.reset()
        got_c, got_r = _flex_values(lp, layout, pairs, pad)
        assert _max_diff(want_c, got_c) < TOL and _max_diff(want_r, got_r) < TOL, layout
    assert flex_calls and set(flex_calls) == {"BlockMask"}  # flex ran, with a BlockMask
    use_attention(model, "sdpa", "cpu")
    assert model.config._attn_implementation == loaded


@needs_cpu_compile
@pytest.mark.slow
def test_flex_on_cpu_runs_batches_of_several_row_widths(tokenizer, make_rows):
    """A run's batches have rows of several widths. Left to transformers' compile (dynamo's
    automatic dynamic shapes), the second width recompiled FlexAttention with a symbolic key
    length, which torch 2.13's CPU inductor fails to build (a C++ error at the third batch);
    ``attention.compile_settings`` compiles each shape statically on the CPU, and every batch
    gives the padded sdpa values."""
    model = _model("llama", tokenizer)
    pad = tokenizer.pad_token_id
    # (pairs, prompt words): the batch grows at one width (dynamo marks the batch dimension
    # dynamic), then the width changes (the key length would go dynamic too).
    shapes = ((2, 140), (3, 140), (4, 10))
    rows = [make_rows(k, seed=20 + i, min_prompt=n, max_prompt=n, max_completion=8) for i, (k, n) in enumerate(shapes)]
    batches = [load_preference_data(r, tokenizer, show_progress=False).pairs for r in rows]
    wants = [padded_values(model, b, pad) for b in batches]
    assert use_attention(model, "flex", "cpu") is None
    lp = CompletionLogProbs(model)
    torch._dynamo.reset()
    widths = []
    for batch_pairs, (want_c, want_r) in zip(batches, wants):
        batch = collate_layout("shared", batch_pairs, pad, multiple=FLEX_BLOCK)
        widths.append(batch.input_ids.shape[1])
        with torch.no_grad():
            got_c, got_r = split_per_token(shared_prompt_logps(lp, batch), batch)
        assert _max_diff(want_c, got_c) < TOL and _max_diff(want_r, got_r) < TOL
    assert widths[0] == widths[1] != widths[2], widths
    # A second scorer of the same model (a reference beside a policy) probes its head with a
    # forward of another shape: under the same settings, or the kernel recompiles dynamic and fails.
    assert CompletionLogProbs(model).fast_path
    use_attention(model, "sdpa", "cpu")


def test_block_masks_from_key_ranges_equal_create_block_mask(tokenizer, make_rows):
    """``prefix.flex_block_masks`` counts its blocks from each query's key ranges
    (``block_mask_from_ranges``); ``create_block_mask`` evaluates the same ``mask_mod`` on every
    (row, query, key) and sums the blocks. Every tensor of the two ``BlockMask``s must be equal
    (partial and full blocks, by key block and by query block): shared, packed (with padding,
    and one row) and group rows, with and without a sliding window, at blocks of 16 (many
    blocks per row, a row width not a multiple of 16) and of 128 (rows of several blocks)."""
    from torch.nn.attention.flex_attention import create_block_mask

    from dpocache.scoring import shared as prefix
    from dpocache.scoring.groups import Group, collate_groups

    pad = tokenizer.pad_token_id
    short = load_preference_data(make_rows(9, seed=41, min_prompt=1, max_prompt=20, max_completion=9), tokenizer,
                                 show_progress=False).pairs
    long = load_preference_data(make_rows(4, seed=31, min_prompt=140, max_prompt=300, max_completion=40), tokenizer,
                                show_progress=False).pairs
    batches = {
        "shared": collate_layout("shared", short, pad),
        "shared, long": collate_layout("shared", long, pad, multiple=FLEX_BLOCK),
        "packed": collate_layout("packed", short, pad, multiple=FLEX_BLOCK),
        "packed, one row": collate_layout("packed", long + short, pad, multiple=FLEX_BLOCK, one_row=True),
        "groups": collate_groups([Group(0, (5, 6, 7), ((1, 2), (3,), (4, 4, 4)), (0, 1, 2)),
                                  Group(1, tuple(range(9, 20)), ((1,), (2, 3, 4, 5, 6, 7)), (0, 1))], pad),
    }
    names = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
             "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")
    compared = {"full": 0, "partial": 0}
    for window in (None, 3, 40):
        kinds = ["full_attention", "sliding_attention"] if window else ["full_attention"]
        config = type("C", (), {"_attn_implementation": "sdpa", "layer_types": kinds, "sliding_window": window})()
        for block in (16, FLEX_BLOCK):
            for name, batch in batches.items():
                b, t = batch.input_ids.shape
                got = prefix.flex_block_masks(batch, config, block=block)
                for kind in kinds:
                    want = create_block_mask(got[kind].mask_mod, b, None, t, t, device="cpu", BLOCK_SIZE=block)
                    for attr in names:
                        g, w = getattr(got[kind], attr), getattr(want, attr)
                        assert g.shape == w.shape and torch.equal(g, w), (name, window, block, kind, attr)
                    compared["full"] += int(want.full_kv_num_blocks.sum())
                    compared["partial"] += int(want.kv_num_blocks.sum())
    assert compared["full"] > 0 and compared["partial"] > 0  # both kinds of block occur


def _dense_mask_mod(block_mask, b: int, t: int) -> torch.Tensor:
    """``block_mask.mask_mod`` evaluated on every (row, query, key): ``(B, T, T)`` bool."""
    rows, q, k = torch.arange(b)[:, None, None], torch.arange(t)[None, :, None], torch.arange(t)[None, None, :]
    return block_mask.mask_mod(rows, None, q, k).expand(b, t, t)


def test_the_flex_mask_rule_equals_the_dense_mask_element_by_element(tokenizer, make_rows):
    """The ``mask_mod`` reads two key ranges per query (``prefix.key_ranges``), not the segments
    of both tokens; it must allow exactly what the dense SDPA mask allows: shared rows, packed
    rows with padding, rows of a group (G completions), and a sliding window shorter than the
    rows (counted on positions). A padding query attends itself alone (the dense mask of a row
    without ``documents`` lets it see the prompt too; its output is never read)."""
    from dpocache.scoring import shared as prefix
    from dpocache.scoring.groups import Group, collate_groups

    pad = tokenizer.pad_token_id
    pairs = load_preference_data(make_rows(9, seed=41, min_prompt=1, max_prompt=20, max_completion=9), tokenizer,
                                 show_progress=False).pairs
    batches = {
        "shared": collate_layout("shared", pairs, pad),
        "packed": collate_layout("packed", pairs, pad, multiple=FLEX_BLOCK),
        "packed, one row": collate_layout("packed", pairs, pad, multiple=FLEX_BLOCK, one_row=True),
        "groups": collate_groups([Group(0, (5, 6, 7), ((1, 2), (3,), (4, 4, 4)), (0, 1, 2)),
                                  Group(1, tuple(range(9, 20)), ((1,), (2, 3, 4, 5, 6, 7)), (0, 1))], pad),
    }
    for window in (None, 3):
        kinds = ["full_attention", "sliding_attention"] if window else ["full_attention"]
        config = type("C", (), {"_attn_implementation": "sdpa", "layer_types": kinds, "sliding_window": window})()
        for name, batch in batches.items():
            b, t = batch.input_ids.shape
            dense, flex = prefix.attention_mask(batch, config), prefix.flex_block_masks(batch, config)
            real = batch.segments != prefix.PAD  # (B, T): padding queries' outputs are never read
            for kind in kinds:
                got, want = _dense_mask_mod(flex[kind], b, t), dense[kind][:, 0]
                assert torch.equal(got[real], want[real]), (name, window, kind)
                assert torch.equal(got[~real], torch.eye(t, dtype=torch.bool).expand(b, t, t)[~real])  # itself only


def test_auto_is_sdpa_on_cpu_and_flex_falls_back_with_a_reason(tokenizer):
    model = build_model("llama", tokenizer).eval()
    assert use_attention(model, "auto", "cpu") is None and model.config._attn_implementation == "sdpa"
    assert use_attention(model, None, "cpu") is None and model.config._attn_implementation == "sdpa"
    with pytest.raises(ValueError, match="auto, sdpa, flex"):
        use_attention(model, "flash", "cpu")
    gpt2 = build_model("gpt2", tokenizer).eval()
    reason = use_attention(gpt2, "flex", "cpu")
    assert "GPT2LMHeadModel does not support flex_attention" in reason and gpt2.config._attn_implementation == "sdpa"
    ref = ReferenceModel(gpt2, layout="packed", attention="flex")
    assert ref.layout_choice.to_json() == {"requested": "packed", "used": "packed", "attention": "sdpa",
                                           "reason": reason}
    # Training differentiates through attention: no FlexAttention backward on CPU.
    choice = training_layout(CompletionLogProbs(build_model("llama", tokenizer)), "packed", "flex")
    assert (choice.used, choice.attention) == ("packed", "sdpa") and "no backward on CPU" in choice.reason


@needs_cpu_compile
def test_the_padded_layout_runs_the_loaded_attention(tokenizer):
    """FlexAttention serves the shared and packed layouts' block masks. A reference that runs
    the padded layout (asked for, or a fallback) puts a model switched to flex back on its
    loaded attention and says so; a later shared reference of the same model switches it again."""
    model = build_model("llama", tokenizer).eval()
    assert ReferenceModel(model, layout="shared", attention="flex").layout_choice.attention == FLEX
    padded = ReferenceModel(model, layout="padded", attention="flex")
    assert model.config._attn_implementation == "sdpa"
    choice = padded.layout_choice.to_json()
    assert (choice["used"], choice["attention"]) == ("padded", "sdpa")
    assert "padded layout runs the model's loaded attention" in choice["reason"]
    assert ReferenceModel(model, layout="shared", attention="flex").layout_choice.to_json() == {
        "requested": "shared", "used": "shared", "attention": FLEX, "reason": None}
    use_attention(model, "sdpa", "cpu")
    # Asked for sdpa, or flex on a model without it: nothing to switch back, no added reason.
    assert ReferenceModel(model, layout="padded", attention="sdpa").layout_choice.reason is None
    gpt2 = build_model("gpt2", tokenizer).eval()
    reason = ReferenceModel(gpt2, layout="padded", attention="flex").layout_choice.reason
    assert "does not support flex_attention" in reason and "loaded attention" not in reason


@needs_cpu_compile
@pytest.mark.slow
def test_packed_flex_reference_rows_are_padded_to_the_budget(tokenizer, pairs):
    """A packed reference pass under FlexAttention pads every row to the token budget (one
    shape, so one compile for the whole pass); the padding changes no value. Other layouts and
    backends keep rows as wide as their pairs."""
    from dpocache.cache.build import score_batch
    from dpocache.scoring.layouts import reference_row_width

    model = _model("llama", tokenizer)
    assert reference_row_width(ReferenceModel(model, layout="packed"), 1000) is None  # sdpa
    ref = ReferenceModel(model, layout="packed", attention="flex")  # switches the model to flex
    assert reference_row_width(ref, 1000) == 1024 and reference_row_width(ref, None) is None
    assert reference_row_width(ReferenceModel(model, layout="shared"), 1000) is None  # flex, shared
    widths = []
    model.get_input_embeddings().register_forward_pre_hook(lambda module, args: widths.append(tuple(args[0].shape)))
    budget = sum(p.unique_tokens for p in pairs) + 200
    pad = tokenizer.pad_token_id
    want, got = score_batch(ref, pairs, pad), score_batch(ref, pairs, pad, budget)
    assert widths == [(1, FLEX_BLOCK * -(-(budget - 200) // FLEX_BLOCK)), (1, FLEX_BLOCK * -(-budget // FLEX_BLOCK))]
    for w, g in ((want.chosen_logps, got.chosen_logps), (want.rejected_logps, got.rejected_logps)):
        assert torch.allclose(w, g, atol=TOL, rtol=0)
    use_attention(model, "sdpa", "cpu")


@needs_cpu_compile
def test_cache_build_with_flex_stores_the_sdpa_values(tmp_path, model_dir, pref_jsonl, capsys):
    """``cache build --attention flex --layout packed`` on CPU names flex in its summary, and
    ``cache verify`` with flex recomputes every value a default (sdpa, shared) build stored."""
    args = ["--model", str(model_dir), "--data", str(pref_jsonl), "--dtype", "float32", "--device", "cpu"]
    flex = ("--attention", "flex", "--layout", "packed")
    assert main(["cache", "build", *args, "--cache-dir", str(tmp_path / "flex"), "--json", *flex]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["layout"] == {"requested": "packed", "used": "packed", "attention": FLEX, "reason": None}
    assert summary["computed"] == 48
    assert main(["cache", "build", *args, "--cache-dir", str(tmp_path / "sdpa")]) == 0
    capsys.readouterr()
    assert main(["cache", "verify", *args, "--cache-dir", str(tmp_path / "sdpa"), "--samples", "48", *flex]) == 0
    out = capsys.readouterr().out
    assert "checked 48 pairs" in out and float(out.split("= ")[1].split()[0]) < 1e-4


@needs_cpu_compile
@pytest.mark.slow
def test_compiled_layers_under_flex_on_cpu_build_every_row_width(tmp_path, model_dir, make_rows, capsys):
    """``cache build --attention flex --layout shared --compile on`` on the CPU: compiled with
    dynamic shapes, the decoder layer's graph held FlexAttention with a symbolic key length, which
    torch 2.13's CPU inductor fails to build (a C++ compile error at the second batch shape);
    compiled per shape (``compiling.flex_on_cpu``) every batch runs, and the values are those a
    default build verifies."""
    from dpocache.data.rows import write_jsonl
    from dpocache.scoring.compiling import flex_on_cpu

    # Two batch shapes under a budget of 256: one row of 256 tokens, then two rows of 128.
    rows = make_rows(1, seed=1, min_prompt=140, max_prompt=140, max_completion=8) + make_rows(2, max_prompt=10)
    data = write_jsonl(rows, tmp_path / "prefs.jsonl")
    args = ["--model", str(model_dir), "--data", str(data), "--dtype", "float32", "--device", "cpu"]
    flex = ("--attention", "flex", "--layout", "shared", "--compile", "on", "--max-tokens", "256")
    assert main(["cache", "build", *args, "--cache-dir", str(tmp_path / "c"), "--json", *flex]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["layout"]["attention"] == FLEX and summary["compiled_layers"] > 0
    assert (summary["computed"], summary["forward_passes"]) == (3, 2)
    assert main(["cache", "verify", *args, "--cache-dir", str(tmp_path / "c"), "--samples", "3"]) == 0
    out = capsys.readouterr().out
    assert "checked 3 pairs" in out and float(out.split("= ")[1].split()[0]) < 1e-4
    model = ReferenceModel.from_pretrained(model_dir, "float32", "cpu", attention="flex").model
    assert flex_on_cpu(model) and not flex_on_cpu(ReferenceModel.from_pretrained(model_dir, "float32", "cpu").model)


# ---------------------------------------------------------------------------------- CUDA


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_flex_on_cuda_equals_sdpa_on_cuda_with_gradients(tokenizer, pairs, arch):
    """flex on CUDA: the packed layout's sums and gradients equal sdpa's."""
    from test_causal_attention import packed_sums_and_grads

    model = _model(arch, tokenizer).to("cuda").train()
    out = {a: packed_sums_and_grads(model, pairs, tokenizer.pad_token_id, a, "cuda") for a in ("sdpa", "flex")}
    assert model.config._attn_implementation == FLEX
    for a, b in zip(out["flex"], out["sdpa"]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
