"""``--checkpoint-keep attention`` (``dpocache.models.kept_attention``): a checkpointed LoRA
model on the causal rows that keeps its attention's output and log-sum-exp through the recompute
computes the loss and every adapter gradient of the model that runs the attention forward again,
bit for bit in fp32 and under bf16 autocast (compiled inside its checkpoint: the values exactly,
the gradients within float rounding), with the flash forward run once per layer and group instead
of twice; outside a checkpointed call it is
the causal rows' attention; where flash attention cannot run it leaves the rows as they were;
what it keeps is released; bad uses are refused with one line before any model loads."""

from __future__ import annotations

import gc
import weakref
from types import SimpleNamespace

import pytest
import torch
from conftest import needs_cpu_compile
from train_fixtures import (  # noqa: F401 (fixtures)
    flags,
    load_tensors,
    run_json,
    run_training,
    train_jsonl,
    train_records,
)

from dpocache.models import checkpoint_phases, kept_attention
from dpocache.models.checkpointing import enable_checkpointing
from dpocache.models.tiny import build_model
from dpocache.scoring.layouts import layout_logprobs, training_layout
from dpocache.scoring.logprobs import CompletionLogProbs, decoder_layers
from dpocache.scoring.shared import ROW_GROUPS


@pytest.fixture(scope="module")
def pairs(tokenizer, make_rows):
    """12 pairs of 8 to about 60 tokens: three groups of causal rows."""
    from dpocache.data.pairs import load_preference_data

    return load_preference_data(make_rows(12, seed=7, min_prompt=1, max_prompt=30, max_completion=14), tokenizer,
                                show_progress=False).pairs


def _lora_model(tokenizer, keep: tuple[str, ...], compiled: bool = False):
    """The tiny Llama with every linear layer adapted (both matrices drawn, so every adapter
    weight has a gradient), checkpointed keeping ``keep``, on the causal rows."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(build_model("llama", tokenizer), LoraConfig(r=4, target_modules="all-linear",
                                                                      init_lora_weights=False))
    model.train()
    products = enable_checkpointing(model, keep, compiled=compiled)
    model.enable_input_require_grads()
    scorer = CompletionLogProbs(model)
    assert training_layout(scorer, "packed", "causal").reason is None
    return model, scorer, products


def _step(model, scorer, pairs, pad_id: int, bf16: bool):
    """A packed forward and backward: (chosen sums, rejected sums, every adapter's gradient)."""
    model.zero_grad()
    with torch.autocast("cpu", torch.bfloat16, enabled=bf16):
        logps, _ = layout_logprobs(scorer, "packed", pairs, pad_id, "cpu")
    (logps.chosen_logps.sum() - 0.5 * logps.rejected_logps.sum()).backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return logps.chosen_logps.detach(), logps.rejected_logps.detach(), grads


@pytest.fixture
def flash_calls(monkeypatch):
    """Per causal row group's attention forward: "rows" (the causal rows' SDPA call) or "kept"
    (``kept_attention``'s own flash forward)."""
    calls = []
    real_sdpa = torch.nn.functional.scaled_dot_product_attention
    real_flash = kept_attention._flash_forward

    def sdpa(query, *args, is_causal=False, **kwargs):
        if is_causal:
            calls.append("rows")
        return real_sdpa(query, *args, is_causal=is_causal, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", sdpa)
    monkeypatch.setattr(kept_attention, "_flash_forward", lambda *a: calls.append("kept") or real_flash(*a))
    return calls


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_kept_attention_trains_as_the_recompute_bit_for_bit_with_one_flash_forward(tokenizer, pairs, bf16,
                                                                                   flash_calls):
    pad = tokenizer.pad_token_id
    plain = _lora_model(tokenizer, ())
    model, scorer, products = _lora_model(tokenizer, ("attention",))
    layers = len(decoder_layers(model))
    flash_calls.clear()  # the scorers' head probes: plain forwards
    want = _step(*plain[:2], pairs, pad, bf16)
    assert flash_calls == ["rows"] * (2 * layers * ROW_GROUPS)  # the forward's, then the recompute's
    flash_calls.clear()
    got = _step(model, scorer, pairs, pad, bf16)
    assert flash_calls == ["kept"] * (layers * ROW_GROUPS)  # the forward's only
    assert len(products.attention) == layers and all(name.endswith(".self_attn") for name in products.attention)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert got[2].keys() == want[2].keys() and len(want[2]) == layers * 7 * 2
    assert all(torch.equal(got[2][name], want[2][name]) for name in want[2])


def test_with_kept_products_too_and_without_the_down_projections_product(tokenizer, pairs):
    """Kept beside the o projection's product, the recompute skipping the down projection's:
    the same values and gradients again (each keeps under its own key, in its own order)."""
    pad = tokenizer.pad_token_id
    want = _step(*_lora_model(tokenizer, ())[:2], pairs, pad, bf16=False)
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(build_model("llama", tokenizer), LoraConfig(r=4, target_modules="all-linear",
                                                                      init_lora_weights=False)).train()
    products = enable_checkpointing(model, ("o_proj", "attention"), skip_unread=True)
    model.enable_input_require_grads()
    scorer = CompletionLogProbs(model)
    training_layout(scorer, "packed", "causal")
    got = _step(model, scorer, pairs, pad, bf16=False)
    assert sum(name.endswith("o_proj.base_layer") for name in products.kept) == len(products.skipped) > 0
    assert torch.equal(got[0], want[0]) and all(torch.equal(got[2][n], want[2][n]) for n in want[2])


@needs_cpu_compile
@pytest.mark.slow
def test_a_layer_compiled_inside_its_checkpoint_keeps_its_attention(tokenizer, pairs, flash_calls):
    """``LayerCheckpoint``'s compiled layer (a streamed base under ``--compile on``): the kept
    attention is one opaque operation in the graph, no graph break, the flash forward runs once
    per layer and group, and the values and gradients are the eager recompute's within float
    rounding (eager, the kept attention equals the recompute bit for bit: the test above; one
    compiled model here, not two, keeps the test within the suite's time)."""
    from torch._dynamo.utils import counters

    pad = tokenizer.pad_token_id
    want = _step(*_lora_model(tokenizer, ())[:2], pairs, pad, bf16=False)
    torch._dynamo.reset()
    breaks = sum(counters["graph_break"].values())
    model, scorer, _ = _lora_model(tokenizer, ("attention",), compiled=True)
    flash_calls.clear()
    got = _step(model, scorer, pairs, pad, bf16=False)
    assert sum(counters["graph_break"].values()) == breaks
    assert flash_calls == ["kept"] * (len(decoder_layers(model)) * ROW_GROUPS)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-6)
    for name, grad in want[2].items():  # the compiler's rounding, as the streamed compiled tests allow
        torch.testing.assert_close(got[2][name], grad, rtol=1e-4, atol=1e-5 * grad.abs().max().item())


def test_outside_a_checkpointed_call_it_is_the_rows_attention_and_keeps_nothing(tokenizer, pairs, monkeypatch):
    kept = []
    monkeypatch.setattr(checkpoint_phases.Phase, "keep", lambda self, key, product: kept.append(key))
    pad = tokenizer.pad_token_id
    plain = _lora_model(tokenizer, ())
    model = _lora_model(tokenizer, ("attention",))
    for m in (plain[0], model[0]):
        m.eval()  # transformers checkpoints in training only
    with torch.no_grad():
        want = layout_logprobs(plain[1], "packed", pairs, pad, "cpu")[0]
        got = layout_logprobs(model[1], "packed", pairs, pad, "cpu")[0]
    assert torch.equal(got.chosen_logps, want.chosen_logps) and torch.equal(got.rejected_logps, want.rejected_logps)
    assert kept == []


def test_where_flash_cannot_run_the_rows_run_as_before(tokenizer, pairs, monkeypatch, flash_calls):
    """Attention dropout, or inputs no flash kernel takes (``flash_serves``): the causal rows'
    own SDPA calls run, forward and recompute, with the same values."""
    monkeypatch.setattr(kept_attention, "flash_serves", lambda query, dtype: False)
    pad = tokenizer.pad_token_id
    want = _step(*_lora_model(tokenizer, ())[:2], pairs, pad, bf16=False)
    model, scorer, _ = _lora_model(tokenizer, ("attention",))
    flash_calls.clear()
    got = _step(model, scorer, pairs, pad, bf16=False)
    assert set(flash_calls) == {"rows"} and torch.equal(got[0], want[0])
    query = torch.zeros(1, 2, 3, 8)
    assert kept_attention.kept_rows_attention(query, query, query, (), None, None, dropout=0.1) is None
    assert not kept_attention.flash_serves(query, torch.float64)


def test_what_the_forward_keeps_is_released_by_the_backward(tokenizer, pairs, monkeypatch):
    refs = []
    real = checkpoint_phases.Phase.keep

    def keep(self, key, product):
        real(self, key, product)
        refs.append(weakref.ref(self.store[key][-1][0]))

    monkeypatch.setattr(checkpoint_phases.Phase, "keep", keep)
    model, scorer, _ = _lora_model(tokenizer, ("attention",))
    _step(model, scorer, pairs, tokenizer.pad_token_id, bf16=False)
    assert len(refs) == 2 * len(decoder_layers(model))  # the output and the log-sum-exp, per layer
    gc.collect()
    assert all(ref() is None for ref in refs)


def test_flash_serves_gpus_in_half_precision_only():
    for dtype, head, want in [(torch.bfloat16, 128, True), (torch.float16, 64, True), (torch.float32, 128, False),
                              (torch.bfloat16, 100, False), (torch.bfloat16, 512, False)]:
        query = SimpleNamespace(device=torch.device("cuda"), dtype=dtype, shape=(1, 32, 9, head))
        assert kept_attention.flash_serves(query, dtype) is want, (dtype, head)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_kept_attention_on_a_gpu_trains_as_the_recompute(tokenizer, pairs):
    """On CUDA under bf16 autocast through flash attention's own operations: the same values
    (the forward is the same kernels, and each sequence's sum a segment's in a fixed order; an
    H200 found them apart in their last bits while they were ``index_add``'s atomic sums, in no
    fixed order), gradients within 1% (a GPU's attention backward sums in no fixed order)."""
    pad = tokenizer.pad_token_id
    runs = []
    for keep in ((), ("attention",)):
        model, scorer, _ = _lora_model(tokenizer, keep)
        model.cuda()
        model.zero_grad()
        with torch.autocast("cuda", torch.bfloat16):
            logps, _ = layout_logprobs(scorer, "packed", pairs, pad, "cuda")
        (logps.chosen_logps.sum() - 0.5 * logps.rejected_logps.sum()).backward()
        runs.append((logps.chosen_logps.detach(), {n: p.grad for n, p in model.named_parameters()
                                                   if p.grad is not None}))
    (want, want_grads), (got, got_grads) = runs
    assert torch.equal(got, want)
    for name, grad in want_grads.items():
        assert (got_grads[name] - grad).norm() <= 1e-2 * grad.norm(), name


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    from dpocache.models.tiny import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("kept-attention"), "llama", num_hidden_layers=3)


@pytest.mark.parametrize("streamed", [False, True], ids=["resident", "streamed"])
def test_train_keeping_the_attention_logs_and_saves_what_the_recompute_does(tmp_path, model_path,
                                                                          train_jsonl,  # noqa: F811
                                                                          monkeypatch, streamed):
    """``train --checkpoint-keep attention --attention causal`` through the whole loop: a bf16
    LoRA run with its base stored in bf16 on native kernels, as on a GPU, logs the same values
    and saves the same adapter as the run whose recompute runs the attention again, bit for bit,
    resident and with the base streamed (the CPU standing in for the GPU); run.json names it."""
    import dpocache.config as config_mod

    monkeypatch.setenv("DPOCACHE_BF16_MATMUL", "native")
    monkeypatch.setattr(config_mod, "_validate_streamed", lambda cfg, flag: None)  # past the device check
    runs = {}
    for keep in ("none", "attention"):
        out = tmp_path / keep
        run_training(*flags(model_path, train_jsonl, out, tmp_path / "cache", "--lora-r", "4", "--dtype", "bfloat16",
                            "--gradient-checkpointing", "true", "--max-steps", "3", "--lr", "1e-2",
                            "--checkpoint-keep", keep, "--attention", "causal", "--stream-base", str(streamed),
                            "--kernels", "none"))
        values = [{k: v for k, v in r.items() if k not in {"seconds", "tokens_per_s", "mfu"}}
                  for r in train_records(out)]
        runs[keep] = (values, load_tensors(out / "final" / "adapter_model.safetensors"), run_json(out))
    (want, want_adapter, _), (got, adapter, info) = runs["none"], runs["attention"]
    assert len(got) == 3 and got == want
    assert adapter.keys() == want_adapter.keys() and all(torch.equal(adapter[k], want_adapter[k]) for k in adapter)
    assert info["policy"]["kept_products"] == {"names": ["attention"], "linear_layers": 0, "attention_layers": 3}
    assert runs["none"][2]["policy"]["kept_products"] is None


@pytest.mark.parametrize("extra,message", [
    (("--attention", "sdpa"), "sdpa runs none"),
    (("--attention", "causal", "--train.layout", "padded"), "the padded layout"),
    (("--attention", "auto", "--device", "cpu"), "auto runs sdpa on cpu"),
])
def test_keeping_the_attention_where_the_causal_rows_will_not_run_is_refused_before_any_model_loads(
        cli, model_path, pref_jsonl, tmp_path, extra, message):
    rc, out, err = cli("train", "--model", model_path, "--data", pref_jsonl, "--output-dir", tmp_path / "run",
                       "--lora-r", "4", "--gradient-checkpointing", "true", "--checkpoint-keep", "attention,o_proj",
                       "--train.progress", "false", *extra)
    assert rc == 2 and err.count("\n") == 1 and "--checkpoint-keep" in err and message in err, err
    assert "Loading" not in err and not (tmp_path / "run" / "run.json").exists()


def test_a_family_the_causal_rows_cannot_serve_is_refused_by_name(cli, pref_jsonl, tmp_path):
    from dpocache.models.tiny import save_tiny_model

    gemma2 = save_tiny_model(tmp_path / "gemma2", "gemma2")  # sliding layers and soft-capping
    rc, out, err = cli("train", "--model", gemma2, "--data", pref_jsonl, "--output-dir", tmp_path / "run",
                       "--lora-r", "4", "--gradient-checkpointing", "true", "--checkpoint-keep", "attention",
                       "--attention", "causal", "--device", "cpu", "--train.progress", "false")
    line = err.strip().splitlines()[-1]  # after the tiny model's own save
    assert rc == 2 and "Traceback" not in err and "Loading" not in err, err
    assert "--checkpoint-keep" in line and "attention" in line and "sliding-window" in line, err


def test_a_training_layout_without_the_causal_rows_is_refused_by_name():
    from dpocache.config import Config, ConfigError
    from dpocache.scoring.layout_choice import LayoutChoice
    from dpocache.training.setup import check_kept_attention_runs

    cfg = Config()
    cfg.model.checkpoint_keep = "attention"
    check_kept_attention_runs(cfg, LayoutChoice("auto", "packed", "dpocache_causal"))
    with pytest.raises(ConfigError, match=r"--checkpoint-keep .*attention.*training runs sdpa on the padded layout "
                                          r"\(MoE\)"):
        check_kept_attention_runs(cfg, LayoutChoice("auto", "padded", "sdpa", reason="MoE"))
    cfg.model.checkpoint_keep = "o_proj"
    check_kept_attention_runs(cfg, LayoutChoice("auto", "padded", "sdpa"))


def test_what_it_keeps_is_what_the_memory_plan_counts(tokenizer, pairs, monkeypatch):
    """Per layer, under bf16 autocast: the output, one bf16 value per token and query head
    dimension, and the log-sum-exp, one fp32 value per head and row slot; the memory plan's
    ``kept_bytes_per_token`` counts a slot as a token, so it lies between the two counts."""
    from dpocache.models.memory_plan import ModelShape
    from dpocache.scoring.shared import layout_batch

    kept = {}
    real = checkpoint_phases.Phase.keep

    def keep(self, key, product):
        kept.setdefault(key, []).append(product)
        real(self, key, product)

    monkeypatch.setattr(checkpoint_phases.Phase, "keep", keep)
    model, scorer, _ = _lora_model(tokenizer, ("attention",))
    _step(model, scorer, pairs, tokenizer.pad_token_id, bf16=True)
    batch = layout_batch("packed", pairs, tokenizer.pad_token_id, model.config)
    tokens, slots = batch.input_ids.numel(), sum(g.numel() for g in batch.rows.gather)
    config, layers = model.config, len(decoder_layers(model))
    heads, head_dim = config.num_attention_heads, config.hidden_size // config.num_attention_heads
    outputs, sums = kept[kept_attention._OUTPUT], kept[kept_attention._LOGSUMEXP]
    assert len(outputs) == len(sums) == layers
    assert all(o.dtype == torch.bfloat16 and o.numel() == tokens * heads * head_dim for o in outputs)
    assert all(s.dtype == torch.float32 and s.numel() == slots * heads for s in sums)
    per_token = ModelShape.from_config(config).kept_bytes_per_token("attention")
    one_layer = outputs[0].nbytes + sums[0].nbytes
    assert tokens * per_token <= one_layer <= slots * per_token and slots > tokens
