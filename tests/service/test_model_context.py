"""The positions a model takes (``dpocache.runtime.preflight.context_length``), which every
refusal of a sequence past the context reads: ``max_position_embeddings``, or a RoPE scaling's
``original_max_position_embeddings x factor`` where that is more (a YaRN-scaled Qwen2.5 keeps its
trained 32,768 in ``max_position_embeddings``). A scaled model is scored past its trained
positions exactly as its own forward scores them."""

from __future__ import annotations

import json

import pytest
import torch

from dpocache.models.tiny import build_model
from dpocache.runtime.preflight import context_length, model_context
from dpocache.service.reference_service import ReferenceService, RequestError

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}


@pytest.mark.parametrize("config, expected", [
    ({"max_position_embeddings": 2048}, 2048),
    ({"max_position_embeddings": 32768, "rope_scaling": {**YARN, "type": "yarn"}}, 131072),  # a config saved before
    ({"max_position_embeddings": 32768, "rope_parameters": {**YARN, "rope_theta": 1e6}}, 131072),  # transformers 5
    # Llama 3.1 says its scaled context itself: 8,192 x 8 is less
    ({"max_position_embeddings": 131072, "rope_parameters": {"rope_type": "llama3", "factor": 8.0,
                                                             "original_max_position_embeddings": 8192}}, 131072),
    # a factor without the positions it scales: max_position_embeddings as it is
    ({"max_position_embeddings": 4096, "rope_parameters": {"rope_type": "linear", "factor": 2.0}}, 4096),
    ({"max_position_embeddings": 4096, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}, 4096),
    ({"max_position_embeddings": 4096, "rope_scaling": None}, 4096),
    ({"n_positions": 1024}, 1024),  # GPT-2's name for it
    ({"model_type": "bloom"}, None),  # ALiBi: says no context, nothing is refused for it
])
def test_context_length_of_a_config(config, expected):
    assert context_length(config) == expected


def test_model_context_reads_a_multimodal_models_text_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "some_vlm", "text_config": {"max_position_embeddings": 32768, "rope_parameters": YARN}}))
    assert model_context(tmp_path) == 131072
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2", "max_position_embeddings": 32768}))
    assert model_context(tmp_path) == 32768


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_the_service_reads_the_models_context(tokenizer, arch):
    """From the config object (GPT-2's ``n_positions`` behind its ``max_position_embeddings``):
    a sequence past it is refused, where GPT-2's position table would fail with an IndexError."""
    service = ReferenceService(build_model(arch, tokenizer).eval())
    assert service.context == 512
    with pytest.raises(RequestError, match=r"prompt \+ completion is 513 tokens, longer than the model's context"):
        service.score([{"prompt_ids": [5] * 500, "completion_ids": [[6] * 13]}])


def test_a_yarn_scaled_model_is_scored_past_its_trained_positions(tokenizer):
    """A tiny Qwen2 trained (say) at 64 positions, YaRN-scaled 2x: a prompt + completion of 100
    tokens is scored, equal to the model's own forward's log-softmax; 129 tokens are refused."""
    rope = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64, "rope_theta": 10000.0}
    model = build_model("qwen2", tokenizer, max_position_embeddings=64, rope_parameters=rope).eval()
    service = ReferenceService(model)
    assert service.context == 128
    g = torch.Generator().manual_seed(0)
    prompt, completion = (torch.randint(10, len(tokenizer), (n,), generator=g).tolist() for n in (70, 30))
    got = service.score([{"prompt_ids": prompt, "completion_ids": [completion]}])[0][0]
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1:-1].double()
    want = logits.log_softmax(-1).gather(-1, torch.tensor(completion)[:, None])[:, 0].float()
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    with pytest.raises(RequestError, match=r"prompt \+ completion is 129 tokens, longer than the model's context "
                                           r"\(128\)"):
        service.score([{"prompt_ids": prompt, "completion_ids": [completion + completion[:29]]}])
