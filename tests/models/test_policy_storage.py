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

    monkeypatch.setattr(policy_mod, "frozen_in_compute_dtype", lambda *a: False)  # the fp32 base, as before
    plain, values, plain_adapters = _lora_run(tmp_path, model, train_jsonl, "plain", monkeypatch, *bf16)
    assert all(m.weight.dtype == torch.float32 for m in plain.modules() if type(m) is torch.nn.Linear)
    assert len(values) == 3 and stored == values  # every logged value, bit for bit
    assert max_abs_diff(adapters, plain_adapters) == 0.0


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
