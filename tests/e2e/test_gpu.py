"""CUDA runs of the cache build and training, in bf16 (skipped on machines without a GPU).

On a GPU, bf16 uses the native kernels under autocast (dpocache.scoring.bf16_matmul only acts under
CPU autocast), and the cache still stores the value the policy computes at step 0.
"""

from __future__ import annotations

import math

import pytest
import torch
from train_fixtures import base_model, flags, one_thread, run_json, run_training, train_jsonl, train_records  # noqa: F401

from dpocache.models.reference import ReferenceModel
from dpocache.scoring import bf16_matmul
from dpocache.scoring.logprobs import CompletionLogProbs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_bf16_reference_on_cuda_is_close_to_fp32_on_cpu(base_model):  # noqa: F811
    torch.manual_seed(0)
    ids = torch.randint(3, 400, (3, 48))
    attn = torch.ones_like(ids)
    comp = torch.zeros_like(ids)
    comp[:, 20:] = 1
    cpu = ReferenceModel.from_pretrained(base_model, "float32", "cpu").logprobs(ids, attn, comp)
    ref = ReferenceModel.from_pretrained(base_model, "bfloat16", "cuda")
    assert ref.dtype == torch.bfloat16 and ref.device.type == "cuda"
    gpu = ref.logprobs(ids, attn, comp).cpu()
    # On a GPU the CPU route is not installed and the weights are not rounded in place.
    layer = next(m for m in ref.model.modules() if isinstance(m, torch.nn.Linear))
    assert not getattr(layer, bf16_matmul._INSTALLED, False)
    assert getattr(layer.weight, bf16_matmul._EXACT_VERSION, None) is None
    assert not torch.equal(gpu, cpu)  # bf16 is not fp32
    assert (gpu.sum(-1) - cpu.sum(-1)).abs().max() < 0.05 * cpu.sum(-1).abs().max()


def test_bf16_training_on_cuda_starts_at_the_cached_reference(tmp_path, base_model, train_jsonl):  # noqa: F811
    out = tmp_path / "run"
    run_training(*flags(base_model, train_jsonl, out, tmp_path / "cache", "--device", "cuda", "--dtype", "bfloat16",
                        "--max-steps", "2"))
    first = train_records(out)[0]
    assert run_json(out)["reference"]["dtype"] == "bfloat16"
    assert math.isfinite(first["loss"]) and abs(first["rewards/margins"]) < 0.5
    assert 0 < first["mfu"] < 1



def test_float16_training_on_cuda_keeps_tiny_gradients(tmp_path, base_model, train_jsonl):  # noqa: F811
    """On the GPUs float16 is for (no bf16): the loss scaler keeps the gradients of a tiny beta,
    which unscaled float16 rounds to 0 (tests/test_float16.py has the CPU side)."""
    norms = {}
    for dtype in ("float32", "float16"):
        out = tmp_path / dtype
        run_training(*flags(base_model, train_jsonl, out, tmp_path / "cache", "--device", "cuda", "--dtype", dtype,
                            "--beta", "1e-7", "--max-steps", "2"))
        norms[dtype] = [r["grad_norm"] for r in train_records(out)]
    assert min(norms["float32"]) > 1e-7
    assert norms["float16"] == pytest.approx(norms["float32"], rel=1e-2)

def test_fast_path_head_on_cuda_matches_the_models_forward(base_model):  # noqa: F811
    from dpocache.models.loading import load_causal_lm

    model = load_causal_lm(base_model, "cuda")
    scorer = CompletionLogProbs(model)
    assert scorer.fast_path is True  # the probe ran on the GPU and agreed with the model's forward


def test_training_on_cuda_uses_the_fused_adamw():
    from dpocache.config import Config
    from dpocache.models.policy import build_optimizer

    model = torch.nn.Linear(8, 8).cuda()
    assert build_optimizer(Config(), model).defaults["fused"] is True
