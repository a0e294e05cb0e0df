"""``--stream-reference`` (``dpocache.models.streaming``): a reference whose decoder layers stay
in host memory computes the resident reference's values bit for bit, holds each layer on the
device only while it runs, fetches the next layer before the current one runs, recovers from a
forward that raised, and is refused with one line where it cannot run. The device is PyTorch's
``meta`` device where a test must tell it from the host (the stand-ins of
``test_reference_device.py``); a GPU test checks values and peak memory on CUDA."""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

from dpocache.data.pairs import TokenizedPair
from dpocache.models.reference import ReferenceModel
from dpocache.models.streaming import ALIGN, StreamedLayers, move_all_but_layers_, outside_parameters
from dpocache.models.tiny import save_tiny_model
from dpocache.scoring.logprobs import decoder_layers

META = torch.device("meta")


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("streamed-reference"), "llama")


def _pairs(n: int = 6) -> list[TokenizedPair]:
    g = torch.Generator().manual_seed(0)
    ids = lambda k: tuple(torch.randint(3, 300, (k,), generator=g).tolist())  # noqa: E731
    return [TokenizedPair(i, ids(6 + i), ids(3 + i % 4), ids(5 - i % 3), key=bytes([i]) * 16) for i in range(n)]


def _inside(tensor: torch.Tensor, buffers: list[torch.Tensor]) -> bool:
    start = tensor.untyped_storage().data_ptr()
    return any(b.data_ptr() <= start < b.data_ptr() + b.numel() for b in buffers)


@pytest.mark.parametrize("layout,attention", [("padded", None), ("shared", "sdpa"), ("packed", "sdpa"),
                                              ("packed", "causal")])
def test_streamed_reference_scores_as_the_resident_one(model_path, layout, attention):
    pairs = _pairs()
    resident = ReferenceModel.from_pretrained(model_path, "float32", "cpu", layout=layout, attention=attention,
                                              kernels="none")
    streamed = ReferenceModel.from_pretrained(model_path, "float32", "cpu", layout=layout, attention=attention,
                                              kernels="none", stream=True)
    layers = decoder_layers(streamed.model)
    assert streamed.streamed is not None and len(streamed.streamed.layers) == len(layers) == 2
    expected = resident.score(pairs, 0, 256)
    for _ in range(2):  # the second pass runs from the slots the first one left
        got = streamed.score(pairs, 0, 256)
        for name in ("chosen_logps", "rejected_logps"):
            assert torch.equal(getattr(got, name), getattr(expected, name)), (layout, name)
    # Every forward copied each layer once; between forwards the layers' values are in the host buffers.
    assert streamed.streamed.copies == streamed.forward_passes * len(layers) + 1  # + the next forward's first
    host = streamed.streamed._host
    assert all(_inside(p, host) for layer in layers for p in layer.parameters())
    assert not any(_inside(p, host) for p in streamed.model.lm_head.parameters())


def test_a_streamed_service_answers_as_the_resident_one(model_path):
    """``ReferenceService.from_pretrained(stream=True)`` (online RL: a reference beside the
    policy): the same per-token values as the resident service's."""
    from dpocache.service import ReferenceService

    g = torch.Generator().manual_seed(1)
    ids = lambda k: torch.randint(3, 300, (k,), generator=g).tolist()  # noqa: E731
    requests = [{"prompt_ids": ids(5 + i), "completion_ids": [ids(2 + j) for j in range(3)]} for i in range(3)]
    resident = ReferenceService.from_pretrained(model_path, "float32", "cpu").score(requests)
    service = ReferenceService.from_pretrained(model_path, "float32", "cpu", stream=True)
    assert service.reference.streamed is not None
    for _ in range(2):
        answer = service.score(requests)
        assert all(torch.equal(a, b) for got, want in zip(answer, resident) for a, b in zip(got, want))


def _stack(widths=(8, 16, 8, 24, 8), seed=0) -> nn.Sequential:
    """Layers of different shapes (the slots are sized for the largest)."""
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Sequential(nn.Linear(a, b), nn.Tanh()) for a, b in zip(widths, widths[1:])])


def test_each_layer_runs_from_a_slot_with_the_next_one_fetched_before_it_runs():
    model = _stack()
    x = torch.randn(3, 8)
    with torch.no_grad():
        expected = model(x)
    streamer = StreamedLayers(list(model), "cpu")
    seen = []

    def look(index):
        def hook(module, args):  # registered after the streamer's: sees what the layer runs with
            slots = streamer._slots
            seen.append((index, all(_inside(p, slots) for p in module.parameters()), dict(streamer._fetched)))
        return hook

    for i, layer in enumerate(model):
        layer.register_forward_pre_hook(look(i))
    with torch.inference_mode():
        first, second = model(x), model(x)
    assert torch.equal(first, expected) and torch.equal(second, expected)
    n = len(model)
    assert [i for i, _, _ in seen] == list(range(n)) * 2
    assert all(on_slot for _, on_slot, _ in seen)
    # While layer i runs, layer i + 1 (the next forward's first, after the last) is already on its way.
    assert all(list(fetched) == [(i + 1) % n] for i, _, fetched in seen)
    assert streamer.copies == 2 * n + 1  # the first layer of a third forward is fetched too
    used = {s.data_ptr() for s in streamer._slots}
    assert len(used) == 2 and streamer._slots[0].numel() == max(b.numel() for b in streamer._host)
    for packed in streamer._packed:
        assert all(p.offset % ALIGN == 0 for p in packed)


def test_a_forward_that_raised_leaves_the_next_one_right():
    model = _stack()
    x = torch.randn(3, 8)
    with torch.no_grad():
        expected = model(x)
    streamer = StreamedLayers(list(model), "cpu")
    fail = {"on": True}

    def boom(module, args):
        if fail["on"]:
            raise RuntimeError("out of memory, say")

    handle = model[2].register_forward_pre_hook(boom)
    with torch.inference_mode(), pytest.raises(RuntimeError, match="out of memory"):
        model(x)
    fail["on"] = False
    handle.remove()
    with torch.inference_mode():
        assert torch.equal(model(x), expected)
    assert not streamer._running
    assert all(_inside(p, streamer._host) for layer in model for p in layer.parameters())


def test_a_weight_shared_with_a_module_outside_the_layers_stays_resident():
    model = _stack((8, 8, 8))
    head = nn.Linear(8, 8)
    head.weight = model[1][0].weight  # tied, as a head to an embedding
    whole = nn.ModuleDict({"body": model, "head": head})
    resident = outside_parameters(whole, list(model))
    assert id(head.weight) in resident
    streamer = StreamedLayers(list(model), "cpu", resident=resident)
    assert not _inside(head.weight, streamer._host)
    assert _inside(model[1][0].bias, streamer._host) and _inside(model[0][0].weight, streamer._host)


def test_only_what_the_layers_alone_hold_stays_off_the_device():
    model = _stack((8, 8, 8))
    head = nn.Linear(8, 8)
    head.weight = model[1][0].weight
    head.register_buffer("scale", torch.ones(8))
    whole = nn.ModuleDict({"body": model, "head": head})
    move_all_but_layers_(whole, list(model), META)
    assert head.weight.is_meta and head.bias.is_meta and head.scale.is_meta
    assert not model[0][0].weight.is_meta and not model[1][0].bias.is_meta


@pytest.fixture
def meta_stand_ins(monkeypatch):
    """What the meta device cannot do, stood in for (as in ``test_reference_device.py``)."""
    import transformers.masking_utils as masking

    from dpocache.scoring import logprobs as logprobs_mod

    host_copy = torch.Tensor.cpu

    def cpu(tensor, *args, **kwargs):
        return torch.zeros(tensor.shape, dtype=tensor.dtype) if tensor.is_meta else host_copy(tensor, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "cpu", cpu)
    monkeypatch.setattr(logprobs_mod.CompletionLogProbs, "probe_fast_path", lambda self: True)
    monkeypatch.setattr(masking, "_ignore_causal_mask_sdpa", lambda *args, **kwargs: False)


def test_a_streamed_layer_runs_on_the_device_and_rests_on_the_host(model_path, meta_stand_ins):
    """fp32 (meta has no autocast): read to the host, all but the layers moved to the device."""
    reference = ReferenceModel.from_pretrained(model_path, "float32", "meta", layout="shared", attention="sdpa",
                                               kernels="none", stream=True)
    assert reference.device == META
    layers = decoder_layers(reference.model)
    devices = []
    for layer in layers:
        layer.register_forward_pre_hook(lambda m, a: devices.append({p.device.type for p in m.parameters()}))
    reference.score(_pairs(), 0, 256)
    assert devices == [{"meta"}] * len(layers)
    assert {p.device.type for layer in layers for p in layer.parameters()} == {"cpu"}
    outside = {p.device.type for n, p in reference.model.named_parameters() if ".layers." not in n}
    assert outside == {"meta"}


@pytest.mark.parametrize("extra,message", [
    (("--compile", "on"), "--compile"),
    (("--fsdp", "true"), "--fsdp"),
    (("--device", "cpu"), "device is cpu"),
])
def test_stream_reference_is_refused_with_one_line_where_it_cannot_run(cli, model_path, pref_jsonl, tmp_path,
                                                                        extra, message):
    rc, out, err = cli("cache", "build", "--model", model_path, "--data", pref_jsonl, "--cache-dir", tmp_path,
                       "--stream-reference", "true", *extra)
    assert rc == 2
    line = err.strip().splitlines()[-1]
    assert "--stream-reference" in line and message in line and "Traceback" not in err


def test_stream_reference_is_refused_by_train_before_any_model_loads(cli, model_path, pref_jsonl, tmp_path):
    rc, out, err = cli("train", "--model", model_path, "--data", pref_jsonl, "--output-dir", tmp_path / "run",
                       "--device", "cpu", "--stream-reference", "true")
    assert rc == 2 and "--stream-reference" in err and "device is cpu" in err
    assert not (tmp_path / "run").exists()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_streamed_reference_on_a_gpu_matches_and_holds_two_layers(tmp_path):
    """Values bit for bit against the resident reference in bf16, and a peak memory that no
    longer holds every layer: the layers' bytes less two slots below the resident pass's."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=512, hidden_size=512, intermediate_size=1536, num_hidden_layers=12,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "m")
    pairs = _pairs(16)
    values, peaks, layer_bytes = {}, {}, 0
    for stream in (False, True):
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        reference = ReferenceModel.from_pretrained(tmp_path / "m", "bfloat16", "cuda", layout="packed",
                                                   kernels="none", stream=stream)
        values[stream] = reference.score(pairs, 0, 1024)
        peaks[stream] = torch.cuda.max_memory_allocated()
        if stream:
            layer_bytes = reference.streamed.host_bytes
            assert reference.streamed.copies >= reference.forward_passes * 12  # each forward copied every layer
        del reference
    for name in ("chosen_logps", "rejected_logps"):
        assert torch.equal(getattr(values[True], name), getattr(values[False], name))
    assert peaks[True] <= peaks[False] - layer_bytes * (10 / 12) * 0.9
