"""The memory plan: parameter counts against real models, the activation formula against what
autograd actually saves, and the command's table."""

from __future__ import annotations

import pytest
import torch

from dpocache.models.memory_plan import (
    LLAMA_3_8B,
    LLAMA_3_70B,
    ModelShape,
    RESIDUAL_BYTES,
    activation_bytes_per_token,
    lora_bottom_turn_memory,
    lora_training_memory,
    main,
    page_locked_bytes,
    plan,
    reference_memory,
    training_memory,
    turn_layers_below_peak,
)


@pytest.mark.parametrize("tied", [False, True])
def test_parameter_count_matches_a_built_model(tied):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=301, hidden_size=96, intermediate_size=200, num_hidden_layers=3,
                         num_attention_heads=6, num_key_value_heads=2, tie_word_embeddings=tied)
    model = LlamaForCausalLM(config)
    shape = ModelShape.from_config(config.to_dict())
    assert shape.params == sum(p.numel() for p in model.parameters())


def test_parameter_counts_of_the_public_llama_configs():
    # Published sizes of Llama 3.1 8B and 70B (their safetensors index "total_size" / 2 bytes).
    assert LLAMA_3_8B.params == 8_030_261_248
    assert LLAMA_3_70B.params == 70_553_706_496


def _saved_bytes_per_token(hidden: int, intermediate: int) -> float:
    """Bytes autograd saves per token for one Llama decoder layer under CPU bf16 autocast: the
    difference between two sequence lengths, each storage counted once."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    config = LlamaConfig(hidden_size=hidden, intermediate_size=intermediate, num_attention_heads=8,
                         num_key_value_heads=2, num_hidden_layers=1, vocab_size=64)
    config._attn_implementation = "sdpa"
    layer, rope = LlamaDecoderLayer(config, 0), LlamaRotaryEmbedding(config)

    def saved(tokens: int) -> int:
        storages: dict[int, int] = {}

        def pack(t):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        x = torch.randn(1, tokens, hidden, requires_grad=True)
        positions = torch.arange(tokens)[None]
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
            layer(x, attention_mask=None, position_ids=positions, position_embeddings=rope(x, positions))
        return sum(storages.values())

    return (saved(512) - saved(256)) / 256


@pytest.mark.parametrize("hidden,intermediate", [(256, 688), (384, 1024)])
def test_activation_formula_matches_autograd(hidden, intermediate):
    shape = ModelShape(vocab=64, hidden=hidden, layers=1, intermediate=intermediate, heads=8, kv_heads=2,
                       head_dim=hidden // 8)
    measured = _saved_bytes_per_token(hidden, intermediate)
    assert activation_bytes_per_token(shape) == pytest.approx(measured, rel=0.02)


def test_sharding_divides_the_state_and_keeps_the_gathered_units():
    whole = reference_memory(LLAMA_3_70B, 1, weight_bytes=2)
    sharded = reference_memory(LLAMA_3_70B, 8, weight_bytes=2, sharded=True)
    assert sharded["weights (1/N shard)"] == pytest.approx(whole["weights"] / 8)
    one, eight = training_memory(LLAMA_3_8B, 1), training_memory(LLAMA_3_8B, 8)
    assert eight["AdamW moments (1/N)"] == pytest.approx(one["AdamW moments (1/N)"] / 8)
    assert eight["gathered units (root + 2 layers)"] == one["gathered units (root + 2 layers)"]


def test_sharded_reference_gathers_two_matrices_and_streams_the_vocabulary_tables():
    """An untied reference's embeddings and head are streamed from their shards a tile at a
    time (dpocache.distributed.vocab_stream), and each matrix of a layer is a unit of its own
    (dpocache.distributed.fsdp.matrix_units): two of the largest (Llama 3.1 8B's MLP projections, 4096 x
    14336) and a tile are gathered at once; a tied one also gathers its root."""
    from dataclasses import replace

    from dpocache.distributed.vocab_stream import TILE_BYTES

    untied = reference_memory(LLAMA_3_8B, 8, weight_bytes=2, sharded=True)
    assert untied["gathered units (2 matrices + a vocabulary tile)"] == 2 * 4096 * 14336 * 2 + TILE_BYTES
    tied_shape = replace(LLAMA_3_8B, tied=True)
    tied = reference_memory(tied_shape, 8, weight_bytes=2, sharded=True)
    assert tied["gathered units (root + 2 matrices)"] == (tied_shape.root_params + 2 * 4096 * 14336) * 2


def test_plan_table_names_what_fits(capsys):
    rows = {(r.model, r.job, r.devices): r for r in plan(LLAMA_3_70B, (1, 8))}
    # 70B in fp32 is 263 GiB of weights: no single 80 GB device holds it; sharded over 8 it fits.
    assert not rows[("Llama-3.1-70B", "reference, fp32 weights, whole model per device", 8)].fits
    assert rows[("Llama-3.1-70B", "reference, bf16 weights, FSDP2-sharded", 8)].fits
    main(["--devices", "1", "8"])
    out = capsys.readouterr().out
    assert "Llama-3.1-8B" in out and "Llama-3.1-70B" in out and out.count("\n") > 10


def test_a_streamed_reference_holds_the_root_and_two_layers():
    """``--stream-reference``: the embeddings, final norm and head plus two layer slots, in bf16;
    70B, whose bf16 weights no 80 GB device holds, fits one streamed."""
    streamed = reference_memory(LLAMA_3_8B, weight_bytes=2, streamed=True)
    assert streamed["embeddings, final norm, head"] == (2 * 128256 * 4096 + 4096) * 2
    assert streamed["2 layer slots"] == 2 * LLAMA_3_8B.layer_params * 2
    assert "weights" not in streamed
    rows = {(r.job, r.devices): r for r in plan(LLAMA_3_70B, (1, 8))}
    assert not rows[("reference, bf16 weights, whole model per device", 1)].fits
    assert rows[("reference, bf16 weights, layers streamed from host", 1)].fits
    assert ("reference, bf16 weights, layers streamed from host", 8) not in rows


def test_a_lora_run_holds_its_bf16_base_or_two_slots_its_adapters_and_the_kept_products():
    """LoRA on one device: the frozen base in bf16, or (``--stream-base``) its root and two layer
    slots; the adapters' fp32 state at 16 bytes per parameter, their count that of PEFT's
    all-linear adapter on a built model; ``--checkpoint-keep down_proj``: tokens x hidden in bf16
    per block."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, intermediate_size=88,
                         num_attention_heads=4, num_key_value_heads=2)
    shape = ModelShape.from_config(config)
    model = get_peft_model(LlamaForCausalLM(config), LoraConfig(r=4, target_modules="all-linear"))
    adapters = sum(p.numel() for p in model.parameters() if p.requires_grad)
    parts = lora_training_memory(shape, tokens=100, rank=4, keep=("down_proj",))
    assert parts["adapters (fp32, gradients, AdamW)"] == 16 * adapters
    assert parts["bf16 base"] == 2 * (sum(p.numel() for p in model.parameters()) - adapters)
    assert parts["kept products (down_proj)"] == 100 * 32 * 2 * 2
    streamed = lora_training_memory(LLAMA_3_8B, tokens=7200, streamed=True)
    assert streamed["2 layer slots (bf16)"] == 2 * LLAMA_3_8B.layer_params * 2 and "bf16 base" not in streamed
    rows = {(r.job, r.devices) for r in plan(LLAMA_3_8B, (1, 8), keep=("down_proj",))}
    assert ("training, LoRA r16, bf16 base streamed, down_proj kept", 1) in rows
    assert ("training, LoRA r16, bf16 base, checkpointed", 8) not in rows


def test_the_lora_rows_take_a_rank_and_the_products_to_keep(capsys):
    """``--checkpoint-keep`` keeps the products named, but the down projections', which the
    recompute skips instead (as ``train`` does), unless ``--skip-unread-products false``;
    ``attention`` keeps the attention's output and log-sum-exp."""
    for skip, kept in (("false", ("down_proj", "o_proj")), ("true", ("o_proj",))):
        main(["--devices", "1", "--lora-r", "8", "--checkpoint-keep", "down_proj,o_proj", "--tokens", "1000",
              "--skip-unread-products", skip])
        out = capsys.readouterr().out
        assert out.startswith("down_proj: skipped in the recompute, not kept") == (skip == "true")
        row = next(x for x in out.splitlines() if "Llama-3.1-8B | training, LoRA r8, bf16 base streamed, " in x)
        assert f"{','.join(kept)} kept" in row
        parts = lora_training_memory(LLAMA_3_8B, 1000, rank=8, streamed=True, keep=kept)
        assert float(row.split("|")[4]) == pytest.approx(sum(parts.values()) / (1 << 30), abs=0.05)
    main(["--devices", "1", "--checkpoint-keep", "none"])
    assert " kept " not in capsys.readouterr().out
    main(["--devices", "1", "--checkpoint-keep", "attention", "--tokens", "1000"])  # its output, no matrix's
    lines = capsys.readouterr().out.splitlines()
    row = next(x for x in lines if "8B | training, LoRA r16, bf16 base streamed, attention kept" in x)
    parts = lora_training_memory(LLAMA_3_8B, 1000, streamed=True, keep=("attention",))
    assert parts["kept products (attention)"] == 1000 * (4096 * 2 + 32 * 4) * 32
    assert float(row.split("|")[4]) == pytest.approx(sum(parts.values()) / (1 << 30), abs=0.05)
    with pytest.raises(SystemExit) as stop:
        main(["--checkpoint-keep", "dwn_proj"])
    assert stop.value.code == 2 and "'dwn_proj' is no matrix of a Llama block" in capsys.readouterr().err


def test_the_bottom_turn_holds_the_kept_layers_where_the_activations_above_are_gone(capsys):
    """``--turn-layers``: at the bottom turn a streamed LoRA run holds what it holds throughout,
    the kept layers and the first layer's checkpointed input, products and activations only;
    the most kept layers below the step's peak are bounded by the memory freed above and by the
    streaming's own bound (``most_turn_layers``); the command prints both."""
    keep, layer = ("down_proj",), LLAMA_3_8B.layer_params * 2.0
    peak = lora_training_memory(LLAMA_3_8B, 7200, streamed=True, keep=keep, resident=6)
    bottom = lora_bottom_turn_memory(LLAMA_3_8B, 7200, keep=keep, resident=6)
    kept8 = lora_bottom_turn_memory(LLAMA_3_8B, 7200, keep=keep, resident=6, turn=8)
    assert sum(kept8.values()) - sum(bottom.values()) == 8 * layer
    assert peak["checkpointed layer inputs"] == 32 * bottom["the first layer's checkpointed input"]
    assert bottom["the first layer's checkpointed input"] == 7200 * 4096 * RESIDUAL_BYTES
    assert peak["kept products (down_proj)"] == 32 * bottom["the first layer's kept products"]
    assert {name: peak[name] for name in bottom if name in peak} == {
        name: bottom[name] for name in bottom if name in peak}  # the parts held throughout: the same
    # at 7,200 tokens the activations above leave room for more than the streaming's bound (11 of 26)
    assert (sum(peak.values()) - sum(bottom.values())) // layer > 11
    assert turn_layers_below_peak(LLAMA_3_8B, 7200, keep=keep, resident=6) == 11
    # at 512 tokens they leave room for fewer
    room = (sum(lora_training_memory(LLAMA_3_8B, 512, streamed=True, keep=keep, resident=6).values())
            - sum(lora_bottom_turn_memory(LLAMA_3_8B, 512, keep=keep, resident=6).values())) // layer
    assert turn_layers_below_peak(LLAMA_3_8B, 512, keep=keep, resident=6) == room < 11
    main(["--devices", "1", "--tokens", "7200", "--turn-layers", "8"])  # 10 resident, nothing kept
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("Llama-3.1-8B, LoRA streamed"))
    gib = lambda parts: f"{sum(parts.values()) / 2**30:.1f}"  # noqa: E731
    kept8 = lora_bottom_turn_memory(LLAMA_3_8B, 7200, resident=10, turn=8)
    peak = lora_training_memory(LLAMA_3_8B, 7200, streamed=True, resident=10)
    most = turn_layers_below_peak(LLAMA_3_8B, 7200, resident=10)
    assert most == 9  # 22 streamed layers: the streaming's bound
    assert line == (f"Llama-3.1-8B, LoRA streamed, 10 resident: --turn-layers 8 takes {gib(kept8)} GiB at the bottom "
                    f"turn against the step's {gib(peak)} GiB peak; at most {most} stay below it")


def test_a_streamed_rows_host_memory_is_its_layers_allocations_rounded_up_to_powers_of_two(capsys):
    """A streamed row's last column: its layers in the host's page-locked memory as
    ``StreamedLayers`` allocates them (several to an allocation, each rounded up to a power of
    two: ``streaming.page_locked_chunks``). 8B: 14.5 GiB for 32 layers of 0.41 GiB, 10.0 for the
    22 the LoRA row streams with 10 resident; 70B: 128 GiB for 80 layers of 1.59 GiB."""
    assert 2 * LLAMA_3_8B.layer_params / (1 << 30) == pytest.approx(0.406, abs=1e-3)
    assert 2 * LLAMA_3_70B.layer_params / (1 << 30) == pytest.approx(1.594, abs=1e-3)
    rows = {r.job: r for r in plan(LLAMA_3_8B, (1,), tokens=7200)}
    assert rows["reference, bf16 weights, layers streamed from host"].host_gib == 14.5
    assert rows["training, LoRA r16, bf16 base streamed, 10 layers resident"].host_gib == 10.0
    assert rows["training, LoRA r16, bf16 base, checkpointed"].host_gib is None
    assert page_locked_bytes(LLAMA_3_70B, 80) == 128 * (1 << 30)
    main(["--devices", "1"])
    out = capsys.readouterr().out
    assert "host page-locked GiB" in out.splitlines()[0]
    row = next(line for line in out.splitlines() if "Llama-3.1-70B | reference, bf16 weights, layers streamed" in line)
    assert row.split("|")[6].strip() == "128.0"


@pytest.mark.parametrize("args, line", [
    (["--devices", "0"], "--devices: must be at least 1, got 0"),  # a ZeroDivisionError
    (["--tokens", "-5"], "--tokens: must be at least 1, got -5"),  # a table of negative memory
    (["--lora-r", "0"], "--lora-r: must be at least 1, got 0"),  # rows named "LoRA r0"
    (["--resident-layers", "40"], "--resident-layers 40: Llama-3.1-8B has 32 decoder layers"),  # the row dropped
    (["--config", "absent.json"], "--config absent.json: cannot read absent.json (No such file or directory)"),
    (["--config", "gpt2.json"], "--config gpt2.json: not a Llama-style decoder's config"),  # a TypeError
    # planned here, refused by train (streaming.check_streamed_layers)
    (["--turn-layers", "10"], "--turn-layers 10: at most 9 for the 22 layers Llama-3.1-8B streams with "
                              "--resident-layers 10, as train takes"),
    (["--turn-layers", "-1"], "--turn-layers: must be at least 0, got -1"),
])
def test_a_mistake_is_one_line(args, line, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "gpt2.json").write_text('{"model_type": "gpt2", "n_embd": 768, "n_layer": 12}')
    with pytest.raises(SystemExit) as raised:
        main(args)
    err = capsys.readouterr().err.strip().splitlines()
    assert raised.value.code == 2 and line in err[-1], err


def test_a_model_directory_is_read_as_its_config(capsys, model_dir):
    """What train's --model takes: an IsADirectoryError traceback before."""
    main(["--config", str(model_dir), "--devices", "1", "--skip-unread-products"])  # a bare switch, as train's
    assert f"| {model_dir.name} | reference" in capsys.readouterr().out


def test_the_head_chunk_is_no_larger_than_the_tokens_logits():
    """A chunk of ``DEFAULT_LOGITS_BUDGET`` fp32 logits, but never more than the micro-batch's
    tokens x vocabulary (a tiny model's row was 0.38 GiB over)."""
    from dpocache.scoring.logprobs import DEFAULT_LOGITS_BUDGET

    tiny = ModelShape(vocab=1024, hidden=64, layers=2, intermediate=128, heads=4, kv_heads=2, head_dim=16)
    for tokens in (16, 4096):
        chunk = min(DEFAULT_LOGITS_BUDGET, tokens * 1024) * 4.0
        assert reference_memory(tiny, tokens=tokens)["head chunk logits"] == chunk
        assert lora_training_memory(tiny, tokens=tokens)["head chunk logits + grad"] == 3 * chunk
    # an 8B model's 128k vocabulary: a row at least, whatever the budget
    assert reference_memory(LLAMA_3_8B, tokens=4096)["head chunk logits"] == 4.0 * max(DEFAULT_LOGITS_BUDGET, 128256)
