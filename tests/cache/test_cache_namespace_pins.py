"""A cache built before a change of the package's code is reused after it: the namespaces and
keys of a fixed model directory and fixed token ids are the ones the code gave when they were
recorded (``PINNED``, computed by the code as it stood before the package was reorganised into
subpackages), so every lookup finds the files an earlier build wrote. A change that fails here
invalidates every user's cache and needs a reason docs/cache.md gives."""

from __future__ import annotations

import json
import math

import torch
from safetensors.torch import save_file

from dpocache.cache.build import namespace_for_dir
from dpocache.cache.sequences import sequence_key
from dpocache.cache.store import CacheStore, Namespace
from dpocache.data.pairs import example_key

CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8, "intermediate_size": 16,
    "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 32,
    "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "torch_dtype": "float32",
    "transformers_version": "4.56.0", "use_cache": True,
}
MISTRAL = dict(CONFIG, model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=16)

PINNED = {
    "llama float32": "9d97b543dc4afe2204bd",
    "llama bfloat16": "c23b00b5effd94f153c7",
    "mistral float32": "86ada0d57cacfd19f911",
    "llama + adapter float32": "0b4253afb4d9c777ea25",
    "llama base float32": "9d97b543dc4afe2204bd",
    "temperature 0.7": "627038ad617905069246",
    "pair key": "fa9cd93defe3d40b1da7c7f4386469db",
    "sequence key": "a464d32f5d3cc543b7f130abc10fd772",
}


def _weights(n: int) -> dict[str, torch.Tensor]:
    """Tensors fixed by formula (no random generator: the same bytes on every machine)."""
    out = {}
    for i, shape in enumerate([(32, 8), (8, 8), (16, 8), (8,)][:n]):
        k = math.prod(shape)
        out[f"model.w{i}"] = (torch.sin(torch.arange(k, dtype=torch.float64) * 0.37 + i) * 0.02).float().reshape(shape)
    return out


def _model_dir(path, config: dict):
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file(_weights(4), str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def _adapter_dir(path, base):
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text(json.dumps({
        "base_model_name_or_path": str(base), "peft_type": "LORA", "r": 2, "lora_alpha": 4,
        "target_modules": ["q_proj"], "task_type": "CAUSAL_LM"}))
    save_file(_weights(2), str(path / "adapter_model.safetensors"), metadata={"format": "pt"})
    return path


def computed(tmp_path) -> dict[str, str]:
    cache = tmp_path / "cache"
    llama = _model_dir(tmp_path / "llama", CONFIG)
    mistral = _model_dir(tmp_path / "mistral", MISTRAL)
    adapter = _adapter_dir(tmp_path / "adapter", llama)
    plain = namespace_for_dir(llama, torch.float32, cache)
    warm = Namespace(plain.weights_sha256, plain.config_sha256, plain.dtype, temperature=0.7)
    assert CacheStore(cache, plain).dir == cache / plain.id  # a namespace's values live under its id
    return {
        "llama float32": plain.id,
        "llama bfloat16": namespace_for_dir(llama, torch.bfloat16, cache).id,
        "mistral float32": namespace_for_dir(mistral, torch.float32, cache).id,
        "llama + adapter float32": namespace_for_dir(adapter, torch.float32, cache).id,
        "llama base float32": namespace_for_dir(adapter, torch.float32, cache, reference="base").id,
        "temperature 0.7": warm.id,
        "pair key": example_key((1, 2, 3), (4, 5), (6,)).hex(),
        "sequence key": sequence_key((1, 2, 3), (4, 5)).hex(),
    }


def test_namespaces_and_keys_are_the_ones_recorded(tmp_path):
    assert computed(tmp_path) == PINNED


def test_namespace_ids_move_with_what_changes_values(tmp_path):
    """The pins are not one value: dtype, config, adapter and temperature each move the id; the
    bare base of an adapter directory (``--reference base``) is the base model's namespace."""
    ids = computed(tmp_path)
    assert ids.pop("llama base float32") == ids["llama float32"]
    assert len(set(ids.values())) == len(ids)
