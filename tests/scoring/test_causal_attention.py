"""Tests for dpocache.scoring.attention's ``causal`` backend: each sequence (a prompt and one completion)
gathered into a row of its own and run through SDPA's causal kernel, no mask. Its values equal
the padded layout's per token in the shared and packed layouts, its gradients equal the masked
sdpa backend's, its sequence rows point every token at itself, and a model it cannot serve
falls back to sdpa and says why."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from conftest import needs_cpu_compile
from test_prefix import _max_diff, padded_values
from transformers import AttentionInterface

from dpocache.cli.entry import main
from dpocache.data.pairs import load_preference_data
from dpocache.models.tiny import ARCHITECTURES, build_model
from dpocache.scoring.attention import register_causal, use_attention
from dpocache.scoring.layout_choice import CAUSAL
from dpocache.scoring.layouts import layout_logprobs, training_layout
from dpocache.scoring.logprobs import CompletionLogProbs
from dpocache.scoring.shared import (
    PAD,
    PROMPT,
    ROW_GROUPS,
    collate_shared,
    layout_batch,
    row_groups,
    shared_prompt_logps,
    split_per_token,
)

TOL = 1e-5
CAUSAL_ARCHS = ("llama", "qwen2", "gpt2", "mixtral")  # Gemma 2 has sliding layers and soft-capping


@pytest.fixture(scope="module")
def pairs(tokenizer, make_rows):
    """10 short pairs of 8 to about 60 tokens: several pairs per packed row."""
    return load_preference_data(make_rows(10, seed=5, min_prompt=1, max_prompt=30, max_completion=12), tokenizer,
                                show_progress=False).pairs


@pytest.fixture
def causal_calls(monkeypatch):
    """Per call of the causal backend, whether it got sequence rows (proof that it ran on them)."""
    calls = []
    register_causal()
    real = AttentionInterface._global_mapping[CAUSAL]

    def counted(module, query, key, value, attention_mask, *args, **kwargs):
        calls.append(kwargs.get("dpocache_gather") is not None)
        return real(module, query, key, value, attention_mask, *args, **kwargs)

    monkeypatch.setitem(AttentionInterface._global_mapping, CAUSAL, counted)
    return calls


@pytest.mark.parametrize("arch", CAUSAL_ARCHS)
def test_causal_matches_padded(tokenizer, pairs, arch, causal_calls):
    model = build_model(arch, tokenizer).eval()
    pad = tokenizer.pad_token_id
    want_c, want_r = padded_values(model, pairs, pad)  # sdpa, padded layout
    loaded = model.config._attn_implementation
    lp = CompletionLogProbs(model)
    assert use_attention(model, "causal", "cpu") is None and model.config._attn_implementation == CAUSAL
    for layout in ("shared", "packed"):
        batch = layout_batch(layout, pairs, pad, model.config)
        assert batch.rows is not None
        with torch.no_grad():
            got_c, got_r = split_per_token(shared_prompt_logps(lp, batch), batch)
        assert _max_diff(want_c, got_c) < TOL and _max_diff(want_r, got_r) < TOL, layout
    assert causal_calls and all(causal_calls)  # the backend ran, on sequence rows
    # A plain forward of the switched model (a head probe) is sdpa with transformers' mask.
    assert CompletionLogProbs(model).fast_path
    use_attention(model, "sdpa", "cpu")
    assert model.config._attn_implementation == loaded


def test_causal_gradients_equal_masked_sdpa(tokenizer, pairs):
    """Training through the causal backend: the packed layout's sums and every parameter's
    gradient equal the masked sdpa backend's (prompt keys shared by two rows sum their
    gradients; the discarded copies of prompt queries add nothing)."""
    model = build_model("llama", tokenizer).train()
    out = {a: packed_sums_and_grads(model, pairs, tokenizer.pad_token_id, a, "cpu") for a in ("sdpa", "causal")}
    for a, b in zip(out["causal"], out["sdpa"]):  # fp32 sums in another order: rows of other widths
        torch.testing.assert_close(a, b, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("layout", ["shared", "packed"])
def test_causal_rows_gradients_equal_index_selects_bit_for_bit(tokenizer, pairs, layout, monkeypatch):
    """The rows' gathers and the outputs' take-back have backward passes that gather instead of
    scatter-adding (``attention._GatherRows``, ``attention._TakeOutputs``): every parameter's
    gradient equals, bit for bit, the one autograd derives from plain ``index_select`` (an
    ``index_add_`` over every slot), with padding (shared: pairs of different lengths) and
    without (packed, one row)."""
    from dpocache.scoring import attention

    class Plain:  # index_select, with its own backward
        @staticmethod
        def apply(x, index, *_):
            return x.index_select(0, index)

    model = build_model("llama", tokenizer).train()
    lp = CompletionLogProbs(model)
    assert training_layout(lp, layout, "causal").attention == CAUSAL
    batch = layout_batch(layout, pairs, tokenizer.pad_token_id, model.config)
    assert (batch.segments == PAD).any() == (layout == "shared")
    grads = []
    for plain in (False, True):
        if plain:
            monkeypatch.setattr(attention, "_GatherRows", Plain)
            monkeypatch.setattr(attention, "_TakeOutputs", Plain)
        model.zero_grad()
        chosen, rejected = split_per_token(shared_prompt_logps(lp, batch), batch)
        (sum(c.sum() for c in chosen) - 0.5 * sum(r.sum() for r in rejected)).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))
    assert any(g.abs().sum() > 0 for g in grads[0])


def test_the_causal_rows_keep_off_cudnn_and_leave_the_process_flags_alone(tokenizer, pairs, monkeypatch):
    """The causal rows' SDPA calls run with cuDNN excluded (``sdpa_kernels``), in training and
    in the reference pass; a plain forward of the switched model (a head probe: sdpa with its
    mask) keeps SDPA's own choice. The process's SDPA flags are the same afterwards: a library
    user's other models are untouched."""
    seen = []  # per SDPA call: (on sequence rows, with gradients, cuDNN allowed, flash allowed)
    on_rows = [False]
    real_sdpa = torch.nn.functional.scaled_dot_product_attention
    register_causal()
    real_backend = AttentionInterface._global_mapping[CAUSAL]

    def spy(*args, **kwargs):
        seen.append((on_rows[0], torch.is_grad_enabled(), torch.backends.cuda.cudnn_sdp_enabled(),
                     torch.backends.cuda.flash_sdp_enabled()))
        return real_sdpa(*args, **kwargs)

    def backend(*args, **kwargs):
        on_rows[0] = kwargs.get("dpocache_gather") is not None
        try:
            return real_backend(*args, **kwargs)
        finally:
            on_rows[0] = False

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    monkeypatch.setitem(AttentionInterface._global_mapping, CAUSAL, backend)
    flags = (torch.backends.cuda.cudnn_sdp_enabled(), torch.backends.cuda.flash_sdp_enabled())
    assert flags == (True, True)  # torch's defaults, so the checks below could fail
    model = build_model("llama", tokenizer).train()
    packed_sums_and_grads(model, pairs, tokenizer.pad_token_id, "causal", "cpu")  # its head probe first
    with torch.no_grad():
        layout_logprobs(CompletionLogProbs(model), "packed", pairs, tokenizer.pad_token_id, "cpu")
    rows_calls = {(grad, cudnn, flash) for rows, grad, cudnn, flash in seen if rows}
    plain_calls = {(cudnn, flash) for rows, _, cudnn, flash in seen if not rows}
    assert rows_calls == {(True, False, True), (False, False, True)}  # training and the reference pass
    assert plain_calls == {flags}
    assert (torch.backends.cuda.cudnn_sdp_enabled(), torch.backends.cuda.flash_sdp_enabled()) == flags


@needs_cpu_compile
@pytest.mark.slow
def test_compiled_training_through_the_causal_rows_has_no_graph_break(tokenizer, pairs):
    """The layers compiled (training's ``--compile on``): the kernel choice is traced into the
    graph with no break, and the sums and gradients equal the eager run's."""
    from torch._dynamo.utils import counters

    from dpocache.scoring.compiling import compile_layers

    eager = build_model("llama", tokenizer).train()
    compiled = build_model("llama", tokenizer).train()
    compiled.load_state_dict(eager.state_dict())
    want = packed_sums_and_grads(eager, pairs, tokenizer.pad_token_id, "causal", "cpu")
    torch._dynamo.reset()
    breaks = sum(counters["graph_break"].values())
    compile_layers(compiled)
    got = packed_sums_and_grads(compiled, pairs, tokenizer.pad_token_id, "causal", "cpu")
    assert sum(counters["graph_break"].values()) == breaks
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@needs_cpu_compile
@pytest.mark.slow
def test_compiled_layers_keep_their_graphs_when_the_longest_sequence_stands_apart(tokenizer):
    """Batches of one size whose lengths spread differently (the longest far past the rest, or
    not) run the graphs the compiled layers made for the first two: no row group has one row,
    a size the compiler specialises (a new graph for every layer, compiled again mid-run)."""
    from torch._dynamo.utils import counters

    from dpocache.data.pairs import TokenizedPair
    from dpocache.scoring.compiling import compile_layers

    def batch(offset: int, apart: bool) -> list[TokenizedPair]:
        """4 pairs (8 sequences, 3 groups); ``apart``: the first pair's chosen far the longest."""
        return [TokenizedPair(i, (5,) * (6 + i + offset), (6,) * (90 if apart and i == 0 else 8 + 2 * i),
                              (7,) * (5 + i), key=bytes(16)) for i in range(4)]

    model = build_model("llama", tokenizer).train()
    torch._dynamo.reset()
    compile_layers(model)
    for offset in (0, 3):  # the first shapes, then others: the graphs with dynamic sizes
        packed_sums_and_grads(model, batch(offset, False), tokenizer.pad_token_id, "causal", "cpu")
    graphs = counters["stats"]["unique_graphs"]
    layout = layout_batch("packed", batch(1, True), tokenizer.pad_token_id, model.config)
    assert [len(group) for group in layout.rows.gather][0] == 2  # the longest beside the next, not alone
    packed_sums_and_grads(model, batch(1, True), tokenizer.pad_token_id, "causal", "cpu")
    assert counters["stats"]["unique_graphs"] == graphs


def packed_sums_and_grads(model, pairs, pad_id, attention, device):
    """``model``'s packed-layout chosen and rejected sums of ``pairs`` under ``attention`` (which
    must run, with no fallback), and every parameter's gradient of a mix of them, flattened."""
    lp = CompletionLogProbs(model)
    choice = training_layout(lp, "packed", attention)
    assert choice.reason is None and choice.attention == {"causal": CAUSAL, "flex": "flex_attention"}.get(attention,
                                                                                                    attention)
    model.zero_grad()
    logps, _ = layout_logprobs(lp, "packed", pairs, pad_id, device)
    (logps.chosen_logps.sum() - 0.5 * logps.rejected_logps.sum()).backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    return logps.chosen_logps.detach(), logps.rejected_logps.detach(), grads


def test_sequence_rows_point_every_token_at_itself(tokenizer, pairs):
    """Each real token's output comes from a slot holding that same token; each row is one
    pair's prompt, then one of its completions, in order, then its last token repeated; the rows
    longest first in ``ROW_GROUPS`` groups (fewer with fewer sequences), each as wide as its
    longest sequence plus one, rounded up to 8. Pairs with an empty completion (or two) still
    give their prompt a row."""
    pad = tokenizer.pad_token_id
    odd = [SimpleNamespace(prompt_ids=[5, 6, 7], chosen_ids=[], rejected_ids=[8, 9], unique_tokens=5, index=90),
           SimpleNamespace(prompt_ids=[5, 6], chosen_ids=[], rejected_ids=[], unique_tokens=2, index=91),
           SimpleNamespace(prompt_ids=[4], chosen_ids=[3], rejected_ids=[], unique_tokens=2, index=92)]
    packed = layout_batch("packed", pairs, pad, SimpleNamespace(_attn_implementation=CAUSAL))
    # Every pair in one row, without padding: the attention runs on the sequence rows, so rows of
    # the longest pair's width would only add padding for the projections and MLPs.
    assert packed.input_ids.shape == (1, sum(p.unique_tokens for p in pairs))
    assert layout_batch("packed", pairs, pad, SimpleNamespace(_attn_implementation="sdpa")).input_ids.shape[0] > 1
    for batch, rows in ((packed, 2 * len(pairs)), (collate_shared([*pairs[:3], *odd], pad, rows=True), 2 * 3 + 3)):
        groups, scatter, second = batch.rows
        assert len(groups) == min(ROW_GROUPS, rows) == 3
        assert sum(g.shape[0] for g in groups) == rows  # two rows for each pair with two completions, one for others
        flat = torch.cat([g.reshape(-1) for g in groups])
        row_of = torch.cat([torch.arange(g.numel()) // g.shape[1] + sum(h.shape[0] for h in groups[:i])
                            for i, g in enumerate(groups)])  # each slot's row, counted over the groups
        real = (batch.segments.reshape(-1) != PAD).nonzero().squeeze(1)
        assert torch.equal(flat[scatter[real]], real)
        # Every row ends past its sequence; a padding token takes the longest row's last slot.
        past = groups[0].shape[1] - 1
        assert torch.all(scatter[batch.segments.reshape(-1) == PAD] == past)
        # A prompt token of a pair with two rows has its copy in the second; any other token's
        # ``second`` is a slot past a sequence's end.
        copied = second != past
        assert torch.equal(flat[second[copied]], copied.nonzero().squeeze(1))
        assert torch.all(row_of[second[copied]] != row_of[scatter[copied]])
        assert torch.all(batch.segments.reshape(-1)[copied] == PROMPT)
        seg, docs = batch.segments.reshape(-1), batch.documents.reshape(-1)
        lengths = []
        for group in groups:
            longest = None
            for row in group:
                n = int((row[1:] != row[:-1]).sum()) + 1  # the sequence's own slots, before the repeats
                longest = n if longest is None else longest
                lengths.append(n)
                own = row[:n]
                assert torch.all(row[n:] == own[-1]) and torch.all(own[1:] > own[:-1])
                kinds = seg[own]
                p = int((kinds == PROMPT).sum())
                assert p > 0 and torch.all(kinds[:p] == PROMPT) and kinds[p:].unique().numel() <= 1
                assert docs[own].unique().numel() == 1 and own[0] // batch.input_ids.shape[1] == own[-1] // \
                    batch.input_ids.shape[1]
            assert group.shape[1] == -(-(longest + 1) // 8) * 8  # one width kind: no recompile on CUDA
        assert lengths == sorted(lengths, reverse=True)


def test_row_groups_cut_where_the_attention_does_least_work():
    """Against every way to cut the lengths into the same number of runs of two or more (a
    run of one row would be a size the compiler specialises: a new graph)."""
    import itertools
    import random

    def work(lengths, starts):
        bounds = [0, *starts, len(lengths)]
        return sum((hi - lo) * (-(-(1 + lengths[lo]) // 8) * 8) ** 2 for lo, hi in zip(bounds, bounds[1:]))

    rng = random.Random(0)
    for n in range(1, 13):
        lengths = sorted((rng.randint(3, 2000) for _ in range(n)), reverse=True)
        starts = row_groups(lengths)
        assert len(starts) == max(1, min(ROW_GROUPS, n // 2)) - 1 and starts == sorted(set(starts)) and 0 not in starts
        bounds = [0, *starts, n]
        assert n == 1 or min(hi - lo for lo, hi in zip(bounds, bounds[1:])) >= 2, (n, starts)
        best = min(work(lengths, list(cut)) for cut in itertools.combinations(range(1, n), len(starts))
                   if n == 1 or all(hi - lo >= 2 for lo, hi in zip([0, *cut], [*cut, n])))
        assert work(lengths, starts) == best
    # the longest alone would cost least here; it shares its group with the next instead
    assert row_groups([2000, 300, 290, 280, 270, 260], 2) == [2]
    # one width for all: half the work or more is padding where the lengths spread (Tulu-shaped)
    lengths = sorted((rng.randint(300, 2000) for _ in range(16)), reverse=True)
    assert work(lengths, row_groups(lengths)) < 0.8 * work(lengths, [])


def test_row_groups_env_sets_the_groups_and_a_wrong_value_stops_the_command(tmp_path, monkeypatch, capsys):
    """``$DPOCACHE_ROW_GROUPS=1``: every row as wide as the longest, read at import (in a fresh
    process); a value not offered: one line and status 2."""
    code = ("from types import SimpleNamespace as N; from dpocache.scoring.shared import layout_batch; "
            "from dpocache.data.pairs import TokenizedPair as P; "
            "pairs = [P(i, (5,) * (3 + i), (6,) * (2 + 3 * i), (7,) * (4 + i), key=bytes(16)) for i in range(4)]; "
            "print(len(layout_batch('packed', pairs, 0, N(_attn_implementation='dpocache_causal')).rows.gather))")
    for env, groups in (({"DPOCACHE_ROW_GROUPS": "1"}, 1), ({"DPOCACHE_ROW_GROUPS": "2"}, 2), ({}, ROW_GROUPS)):
        environ = {k: v for k, v in os.environ.items() if k != "DPOCACHE_ROW_GROUPS"} | env
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=environ, check=True)
        assert int(out.stdout) == groups, (env, out.stdout, out.stderr)
    monkeypatch.setenv("DPOCACHE_ROW_GROUPS", "5")
    assert main(["cache", "info", "--cache-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "$DPOCACHE_ROW_GROUPS must be 3 or 1 or 2 or 4; got '5'" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("arch", sorted(set(ARCHITECTURES) - set(CAUSAL_ARCHS)))
def test_causal_falls_back_with_a_reason(tokenizer, arch):
    """Gemma 2 (sliding layers, soft-capping): causal cannot serve it; sdpa's mask runs and the
    choice says why."""
    model = build_model(arch, tokenizer, sliding_window=6).eval()
    loaded = model.config._attn_implementation
    lp = CompletionLogProbs(model)
    choice = training_layout(lp, "packed", "causal")
    assert choice.used == "packed" and choice.attention == loaded
    assert "sliding-window" in choice.reason and choice.reason.endswith(f"{loaded} ran")


def test_cache_build_names_the_causal_backend(tmp_path, model_dir, pref_jsonl, capsys):
    """``cache build --attention causal`` runs it and its summary names it; its values equal a
    build under sdpa's mask. Its ``auto`` layout is packed: one row per forward, no padding."""
    values = {}
    for attention in ("sdpa", "causal"):
        common = ["--model", str(model_dir), "--data", str(pref_jsonl), "--cache-dir", str(tmp_path / attention),
                  "--dtype", "float32", "--device", "cpu"]
        assert main(["cache", "build", *common, "--attention", attention, "--json"]) == 0
        summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert summary["layout"]["used"] == ("shared" if attention == "sdpa" else "packed")
        assert summary["layout"]["reason"] is None
        assert summary["layout"]["attention"] == ("sdpa" if attention == "sdpa" else CAUSAL)
        out = tmp_path / f"{attention}.jsonl"
        assert main(["cache", "export", *common, "--out", str(out), "--format", "keys"]) == 0
        rows = [json.loads(line) for line in out.read_text().splitlines()]
        values[attention] = torch.tensor([[r["chosen_logps"], r["rejected_logps"]] for r in rows])
    torch.testing.assert_close(values["causal"], values["sdpa"], rtol=1e-5, atol=1e-5)


def test_causal_sdpa_switch_leaves_the_choice_to_sdpa_and_a_bad_value_is_status_2(tmp_path, model_dir, pref_jsonl,
                                                                                   monkeypatch, capsys):
    """``$DPOCACHE_CAUSAL_SDPA=any`` (read at import) leaves the rows to SDPA's own choice; a
    value that is neither mode stops the command with one line and status 2, before any model
    loads."""
    import dpocache.scoring.attention as attention

    monkeypatch.setattr(attention, "CAUSAL_SDPA", "any")
    with attention.sdpa_kernels():
        assert torch.backends.cuda.cudnn_sdp_enabled()
    monkeypatch.setenv("DPOCACHE_CAUSAL_SDPA", "cudnn")
    assert main(["cache", "build", "--model", str(model_dir), "--data", str(pref_jsonl),
                 "--cache-dir", str(tmp_path / "c")]) == 2
    err = capsys.readouterr().err
    assert "$DPOCACHE_CAUSAL_SDPA must be no-cudnn or any; got 'cudnn'" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "c").exists()


# ---------------------------------------------------------------------------------- CUDA


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@cuda
def test_causal_on_cuda_equals_sdpa_on_cuda_with_gradients(tokenizer, pairs):
    """causal on CUDA (SDPA's causal kernel) in bf16 autocast: the packed layout's sums and
    gradients equal the masked sdpa backend's."""
    model = build_model("llama", tokenizer).to("cuda").train()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = {a: packed_sums_and_grads(model, pairs, tokenizer.pad_token_id, a, "cuda") for a in ("sdpa", "causal")}
    for a, b in zip(out["causal"], out["sdpa"]):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)


def test_auto_is_causal_on_gpus_where_it_serves_the_model(tokenizer):
    """``auto`` picks causal for a CUDA run of a model it serves, sdpa on the CPU, and for a
    model it cannot serve the loaded attention with no reason (nothing was asked for)."""
    llama = build_model("llama", tokenizer).eval()
    assert use_attention(llama, "auto", "cpu") is None and llama.config._attn_implementation == "sdpa"
    assert use_attention(llama, "auto", "cuda") is None and llama.config._attn_implementation == CAUSAL
    assert use_attention(llama, "sdpa", "cuda") is None and llama.config._attn_implementation == "sdpa"
    gemma = build_model("gemma2", tokenizer, sliding_window=6).eval()
    loaded = gemma.config._attn_implementation
    assert use_attention(gemma, "auto", "cuda") is None and gemma.config._attn_implementation == loaded
