"""A LoRA policy's frozen base stored in the compute dtype (``models.policy.load_policy``): its
matrices (and an embedding table saved in bf16) take half the memory, its adapters stay fp32,
and training computes bit for bit what it computed with the fp32 base under autocast (the cast
autocast makes at every call is the one made once at load)."""

from __future__ import annotations

import importlib

import pytest
import torch
from train_fixtures import (  # noqa: F401 (fixtures)
    base_model,
    flags,
    load_tensors,
    max_abs_diff,
    one_thread,
    run_training,
    train_jsonl,
    train_records,
)

from dpocache.models import policy as policy_mod

setup_mod = importlib.import_module("dpocache.training.setup")  # the package's name "setup" is the function
TIMING = {"seconds", "tokens_per_s", "mfu"}


def _lora_run(tmp_path, base_model, train_jsonl, name, monkeypatch, *extra):  # noqa: F811
    loaded = []
    real = setup_mod.load_policy

    def kept(*args, **kwargs):
        loaded.append(real(*args, **kwargs))
        return loaded[-1]

    monkeypatch.setattr(setup_mod, "load_policy", kept)
    out = tmp_path / name
    run_training(*flags(base_model, train_jsonl, out, tmp_path / f"cache-{name}", "--lora-r", "4", "--max-steps", "3",
                        "--lr", "1e-2", *extra))
    values = [{k: v for k, v in r.items() if k not in TIMING} for r in train_records(out)]
    return loaded[0], values, load_tensors(out / "final" / "adapter_model.safetensors")


def test_a_lora_base_stored_in_bf16_trains_exactly_as_the_fp32_base(tmp_path, base_model, train_jsonl,  # noqa: F811
                                                                    monkeypatch):
    # The native bf16 kernels, as on a GPU: a CPU without AMX would route bf16 through the fp32
    # GEMM (dpocache.scoring.bf16_matmul), which keeps fp32 weights and so the fp32 base.
    monkeypatch.setenv("DPOCACHE_BF16_MATMUL", "native")
    bf16 = ("--dtype", "bfloat16")
    model = _saved_in_bf16(base_model, tmp_path / "model")
    policy, stored, adapters = _lora_run(tmp_path, model, train_jsonl, "stored", monkeypatch, *bf16)
    linears = [m for m in policy.modules() if type(m) is torch.nn.Linear]
    frozen = [m for m in linears if not m.weight.requires_grad]
    trained = [m for m in linears if m.weight.requires_grad]
    assert frozen and trained
    assert all(m.weight.dtype == torch.bfloat16 for m in frozen)  # the base's matrices and the head
    assert all(m.weight.dtype == torch.float32 for m in trained)  # LoRA's A and B
    # The table's values are bf16 values (the checkpoint's): stored in bf16, each lookup cast back to fp32.
    assert policy.get_input_embeddings().weight.dtype == torch.bfloat16
    assert _input_casts(policy) == [False]  # the adapters take bf16 inputs as they come

    monkeypatch.setattr(policy_mod, "frozen_in_compute_dtype", lambda *a: False)  # the fp32 base, as before
    plain, values, plain_adapters = _lora_run(tmp_path, model, train_jsonl, "plain", monkeypatch, *bf16)
    assert all(m.weight.dtype == torch.float32 for m in plain.modules() if type(m) is torch.nn.Linear)
    assert _input_casts(plain) == [True]  # PEFT's cast to the adapters' fp32
    assert len(values) == 3 and stored == values  # every logged value, bit for bit
    assert max_abs_diff(adapters, plain_adapters) == 0.0


def _input_casts(policy) -> list[bool]:
    """The distinct ``cast_input_dtype_enabled`` of the policy's LoRA layers."""
    from peft.tuners.lora import LoraLayer

    return sorted({getattr(m, "cast_input_dtype_enabled", True) for m in policy.modules() if isinstance(m, LoraLayer)})


def test_adapters_on_a_bf16_base_skip_the_round_trip_through_fp32(tmp_path, base_model, monkeypatch):  # noqa: F811
    """``keep_adapter_inputs_``: in a forward and backward under bf16 autocast, every adapted
    layer whose input is bf16 (attention's output projection, the MLP's down projection) makes
    four fewer copies of activation size (its input to fp32 and back, and their gradients), and
    the outputs and gradients are the same, bit for bit."""
    from test_lora_fused import SelectedOps

    monkeypatch.setenv("DPOCACHE_BF16_MATMUL", "native")
    monkeypatch.setattr(policy_mod, "fuses_lora_updates", lambda *a: False)  # PEFT's forward (lora_fused's has tests)
    policy = policy_mod.load_policy(_lora_config(_saved_in_bf16(base_model, tmp_path / "model")),
                                    torch.device("cpu"), None, torch.bfloat16)
    config = policy.config
    ids = torch.randint(0, config.vocab_size, (2, 24))
    bf16_inputs = 2 * config.num_hidden_layers  # o_proj and down_proj of every layer
    runs = {}
    for keep in (True, False):
        for layer in policy.modules():
            if hasattr(layer, "cast_input_dtype_enabled"):
                layer.cast_input_dtype_enabled = not keep
        policy.zero_grad()
        least = max(config.hidden_size, config.intermediate_size)  # dtype casts of activations
        mode = SelectedOps(lambda func, args, kwargs, out: func is torch.ops.aten._to_copy.default
                           and args[0].numel() > least)
        with mode, torch.autocast("cpu", torch.bfloat16):
            logits = policy(input_ids=ids).logits
            logits.float().logsumexp(-1).sum().backward()
        grads = [p.grad.clone() for p in policy.parameters() if p.requires_grad]
        runs[keep] = (len(mode.names), logits.detach(), grads)
    assert runs[False][0] - runs[True][0] == 4 * bf16_inputs
    assert torch.equal(runs[True][1], runs[False][1])
    assert all(torch.equal(a, b) for a, b in zip(runs[True][2], runs[False][2], strict=True))


def _saved_in_bf16(base_model, out):  # noqa: F811
    """``base_model`` saved in bf16, as most checkpoints are."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    AutoModelForCausalLM.from_pretrained(base_model, dtype=torch.bfloat16).save_pretrained(out)
    AutoTokenizer.from_pretrained(base_model).save_pretrained(out)
    return out


@pytest.mark.parametrize("extra", [("--lora-r", "4", "--dtype", "float32"), ("--lora-r", "0", "--dtype", "bfloat16")],
                         ids=["lora-fp32", "full-bf16"])
def test_fp32_runs_and_full_training_keep_every_weight_in_fp32(tmp_path, base_model, train_jsonl,  # noqa: F811
                                                               monkeypatch, extra):
    monkeypatch.setenv("DPOCACHE_BF16_MATMUL", "native")
    loaded = []
    real = setup_mod.load_policy
    monkeypatch.setattr(setup_mod, "load_policy", lambda *a, **k: loaded.append(real(*a, **k)) or loaded[-1])
    run_training(*flags(base_model, train_jsonl, tmp_path / "run", tmp_path / "cache", "--max-steps", "1", *extra))
    assert all(p.dtype == torch.float32 for p in loaded[0].parameters())


def _lora_config(path, r: int = 4):
    from dpocache.config import Config

    cfg = Config()
    cfg.model.path, cfg.lora.r = str(path), r
    return cfg


def test_a_lora_policy_on_a_bf16_checkpoint_never_holds_the_fp32_base(tmp_path, base_model, monkeypatch):  # noqa: F811
    """The base is read in bf16 on the host (``loading.load_for_storage``): never loaded in fp32,
    whose copy took an 8B LoRA run's host memory to 49 GB on a GPU machine."""
    from dpocache.models import loading

    monkeypatch.setenv("DPOCACHE_BF16_MATMUL", "native")
    model = _saved_in_bf16(base_model, tmp_path / "model")
    read_in = []
    real = loading.load_causal_lm

    def recorded(path, device="cpu", attn_implementation="sdpa", dtype=torch.float32):
        read_in.append(dtype)
        return real(path, device, attn_implementation, dtype)

    monkeypatch.setattr(loading, "load_causal_lm", recorded)
    monkeypatch.setattr(policy_mod, "load_causal_lm", recorded)
    policy = policy_mod.load_policy(_lora_config(model), torch.device("cpu"), None, torch.bfloat16)
    assert read_in == [torch.bfloat16]
    trained = [p for p in policy.parameters() if p.requires_grad]
    assert trained and all(p.dtype == torch.float32 for p in trained)
    assert all(m.weight.dtype == torch.bfloat16 for m in policy.modules()
               if type(m) is torch.nn.Linear and not m.weight.requires_grad)


def test_a_saved_adapter_keeps_its_fp32_values_on_a_base_stored_in_bf16(tmp_path, base_model, monkeypatch):  # noqa: F811
    """The policy's trainable adapter holds the file's fp32 values on a base stored in bf16, as on
    the fp32 base: PEFT casts a trainable adapter to fp32 before it reads the file (were it read
    in the base layers' dtype, as a fresh adapter's init is cast, its values would be bf16's)."""
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file

    from dpocache.models import loading

    monkeypatch.setenv("DPOCACHE_BF16_MATMUL", "native")
    model = _saved_in_bf16(base_model, tmp_path / "model")
    adapter = get_peft_model(loading.load_causal_lm(model),
                             LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False))
    adapter.save_pretrained(tmp_path / "adapter")  # random fp32 A and B, not bf16 values
    saved = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert any(not torch.equal(t, t.bfloat16().float()) for t in saved.values())
    cfg = _lora_config(tmp_path / "adapter", r=0)
    for dtype in (torch.bfloat16, torch.float32):  # the base stored in bf16, then the fp32 base
        policy = policy_mod.load_policy(cfg, torch.device("cpu"), None, dtype)
        trained = {name: p for name, p in policy.named_parameters() if p.requires_grad}
        assert len(trained) == len(saved)
        for name, value in saved.items():
            key = next(k for k in trained if k.replace(".default", "").endswith(name.removeprefix("base_model.")))
            assert trained[key].dtype == torch.float32 and torch.equal(trained[key], value), (dtype, name)
