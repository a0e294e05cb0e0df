"""Tests for dpocache.scoring.layout_choice: one selection rule for the cache build and training, and the
``layout`` object that ``run.json`` and the cache build's JSON summary carry."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from dpocache.cli.entry import main
from dpocache.config import Config
from dpocache.scoring.layout_choice import LAYOUTS, LayoutChoice, select_layout


def _config(attention: str) -> SimpleNamespace:
    return SimpleNamespace(_attn_implementation=attention)


@pytest.mark.parametrize("requested, attention, fast_path, router_loss, used, reason", [
    ("auto", "sdpa", True, False, "shared", None),
    ("shared", "eager", True, False, "shared", None),
    ("padded", "sdpa", True, False, "padded", None),
    ("padded", "flash_attention_2", False, True, "padded", None),  # asked for: no fallback to explain
    ("auto", "flash_attention_2", True, False, "padded", "custom 4D mask"),
    ("shared", "flex_attention", True, False, "shared", None),  # a BlockMask (dpocache.scoring.attention)
    ("packed", "sdpa", True, False, "packed", None),
    ("packed", "eager", True, False, "packed", None),
    ("packed", "flash_attention_2", True, False, "padded", "packed layout needs"),
    ("packed", "sdpa", True, True, "padded", "load-balancing"),  # a MoE's training; its reference pass packs
    ("auto", "sdpa", False, False, "padded", "output head"),
    ("auto", "sdpa", True, True, "padded", "load-balancing"),
])
def test_select_layout(requested, attention, fast_path, router_loss, used, reason):
    choice = select_layout(requested, _config(attention), fast_path=fast_path, router_loss=router_loss)
    assert (choice.requested, choice.used, choice.attention) == (requested, used, attention)
    assert (choice.reason is None) if reason is None else (reason in choice.reason)
    assert choice.to_json() == {"requested": requested, "used": used, "attention": attention, "reason": choice.reason}


def test_auto_packs_in_training_and_shares_in_the_reference_pass():
    assert select_layout("auto", _config("sdpa"), training=True).used == "packed"
    assert select_layout("auto", _config("sdpa")).used == "shared"
    assert select_layout("auto", _config("sdpa"), router_loss=True, training=True).used == "padded"
    # Under the causal backend the reference pass packs too: one full row per forward, no padding.
    assert select_layout("auto", _config("dpocache_causal")).used == "packed"
    assert select_layout("shared", _config("dpocache_causal")).used == "shared"  # asked for


def test_unknown_layout_is_refused():
    with pytest.raises(ValueError, match="auto, padded, shared, packed"):
        select_layout("bogus", _config("sdpa"))


def test_auto_is_the_default_and_a_valid_choice():
    cfg = Config()
    assert cfg.train.layout == cfg.cache.layout == "auto" and set(LAYOUTS) == {"auto", "padded", "shared", "packed"}


def test_cache_build_summary_names_the_layout(tmp_path, model_dir, pref_jsonl, capsys):
    """The JSON summary says which layout the reference pass ran, and says so as None when no
    pass ran (every pair cached)."""
    args = ["cache", "build", "--model", str(model_dir), "--data", str(pref_jsonl), "--cache-dir", str(tmp_path),
            "--dtype", "float32", "--device", "cpu", "--json"]
    summaries = []
    for extra in ((), ("--layout", "padded")):
        assert main([*args, *extra]) == 0
        summaries.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1]))
    assert summaries[0]["layout"] == LayoutChoice("auto", "shared", "sdpa").to_json()
    assert summaries[0]["computed"] > 0 and summaries[1]["computed"] == 0 and summaries[1]["layout"] is None
    assert main([*args, "--cache-dir", str(tmp_path / "padded"), "--layout", "padded"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["layout"] == {
        "requested": "padded", "used": "padded", "attention": "sdpa", "reason": None}


@pytest.mark.parametrize("command", ["train", "cache build"])
def test_bad_attention_or_layout_is_one_line_and_status_2(command, tmp_path, model_dir, pref_jsonl, capsys):
    args = [*command.split(), "--model", str(model_dir), "--data", str(pref_jsonl), "--cache-dir", str(tmp_path),
            "--output-dir", str(tmp_path / "run")]
    if command != "train":
        args = args[:-2]
    assert main([*args, "--attention", "flash"]) == 2
    err = capsys.readouterr().err
    assert "--attention (model.attention): must be one of auto, sdpa, flex, causal; got 'flash'" in err
    flag = "--train.layout" if command == "train" else "--layout"
    assert main([*args, flag, "bogus"]) == 2
    assert "must be one of auto, padded, shared, packed" in capsys.readouterr().err


# ------------------------------------------------------------------------------------ policy_logps


def test_policy_logps_equal_a_naive_forward_with_their_graph(model_dir, data):
    """``policy_logps`` (a loop of one's own) against each sequence's log-softmax summed over its
    completion tokens, in every layout; the gradient reaches the weights."""
    import torch
    from transformers import AutoModelForCausalLM

    from dpocache.scoring.layouts import policy_logps
    from dpocache.scoring.logprobs import CompletionLogProbs

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    scorer, pairs = CompletionLogProbs(model), list(data.pairs[:6])
    naive = []
    with torch.no_grad():
        for p in pairs:
            sums = []
            for completion in (p.chosen_ids, p.rejected_ids):
                ids = torch.tensor([p.prompt_ids + completion])
                logps = model(input_ids=ids).logits[0, :-1].log_softmax(-1)  # (T-1, V)
                start = len(p.prompt_ids) - 1  # predicts the first completion token
                sums.append(logps[start:].gather(-1, ids[0, start + 1:, None]).sum())
            naive.append(sums)
    naive = torch.tensor(naive)  # (B, 2)
    for layout in ("padded", "shared", "packed"):
        values = policy_logps(scorer, pairs, pad_id=0, layout=layout)
        got = torch.stack([values.chosen_logps, values.rejected_logps], dim=1)
        torch.testing.assert_close(got.detach(), naive, rtol=0, atol=1e-4)
        assert values.chosen_tokens.tolist() == [len(p.chosen_ids) for p in pairs]
        model.zero_grad()
        got.sum().backward()
        assert model.model.embed_tokens.weight.grad.abs().sum() > 0


def test_policy_logps_mistakes_are_named(model_dir, data):
    import torch
    from transformers import AutoModelForCausalLM

    from dpocache.scoring.layouts import policy_logps
    from dpocache.scoring.logprobs import CompletionLogProbs

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with pytest.raises(TypeError, match=r"^scorer: expected a CompletionLogProbs, got LlamaForCausalLM; wrap the "
                       r"model once: scorer = dpocache.CompletionLogProbs\(model\)"):
        policy_logps(model, data.pairs[:2], pad_id=0)
    with pytest.raises(ValueError, match="^layout must be one of padded, shared, packed; got 'paded'"):
        policy_logps(CompletionLogProbs(model), data.pairs[:2], pad_id=0, layout="paded")
