"""``--stream-reference`` and ``--stream-base`` (``dpocache.models.streaming``): a reference whose
decoder layers stay in host memory computes the resident reference's values bit for bit, holds
each layer on the device only while it runs, fetches the next layer before the current one
runs, recovers from a forward that raised; a checkpointed LoRA run with its base streamed
trains as the resident one, each layer fetched ahead in the forward and, in reverse, in the
backward's recompute; both are refused with one line where they cannot run. The device is
PyTorch's ``meta`` device where a test must tell it from the host (the stand-ins of
``test_reference_device.py``); GPU tests check values and peak memory on CUDA."""

from __future__ import annotations

import functools
import json
import gc
import importlib

import pytest
import torch
from torch import nn
from train_fixtures import (  # noqa: F401 (fixtures)
    flags,
    load_tensors,
    max_abs_diff,
    run_json,
    run_training,
    train_jsonl,
    train_records,
)

from dpocache.cli.cache import describe_pace
from dpocache.data.pairs import TokenizedPair
from dpocache.models.reference import ReferenceModel
from dpocache.models.streaming import (
    ALIGN,
    StreamedLayers,
    move_resident_,
    page_locked_bytes,
    page_locked_chunks,
    spread_resident,
    streamed_parameters,
)
from dpocache.models.tiny import save_tiny_model
from dpocache.scoring.logprobs import decoder_layers

META = torch.device("meta")


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    """A tiny Llama of 4 layers: more layers than slots, so slots are reused."""
    return save_tiny_model(tmp_path_factory.mktemp("streamed-reference"), "llama", num_hidden_layers=4)


@pytest.fixture(scope="module")
def deep_model_path(tmp_path_factory):
    """A tiny Llama of 6 layers: enough streamed layers to keep one through each bottom turn
    (``--turn-layers``: at most (streamed - 3) // 2)."""
    return save_tiny_model(tmp_path_factory.mktemp("streamed-deep"), "llama", num_hidden_layers=6)


def _pairs(n: int = 6) -> list[TokenizedPair]:
    g = torch.Generator().manual_seed(0)
    ids = lambda k: tuple(torch.randint(3, 300, (k,), generator=g).tolist())  # noqa: E731
    return [TokenizedPair(i, ids(6 + i), ids(3 + i % 4), ids(5 - i % 3), key=bytes([i]) * 16) for i in range(n)]


def _inside(tensor: torch.Tensor, buffers: list[torch.Tensor]) -> bool:
    start = tensor.data_ptr()
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
    assert streamed.streamed is not None and len(streamed.streamed.layers) == len(layers) == 4
    expected = resident.score(pairs, 0, 256)
    for _ in range(2):  # the second pass runs from the slots the first one left
        got = streamed.score(pairs, 0, 256)
        for name in ("chosen_logps", "rejected_logps"):
            assert torch.equal(getattr(got, name), getattr(expected, name)), (layout, name)
    # Every forward copied each layer once (the head's probe at construction is one, streamed too),
    # and the next forward's first is on its way; between forwards the values are in the host buffers.
    assert streamed.streamed.copies == (streamed.forward_passes + 1) * len(layers) + 1
    assert streamed.streamed.to_json()["transfers"]["entries"] == (streamed.forward_passes + 1) * len(layers)
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
    """Frozen layers of different shapes (the slots are sized for the largest)."""
    torch.manual_seed(seed)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(a, b), nn.Tanh()) for a, b in zip(widths, widths[1:])])
    return model.requires_grad_(False)


def _streamed(model: nn.Module) -> tuple[torch.Tensor, torch.Tensor, StreamedLayers]:
    """An input ``(3, 8)``, ``model``'s output on it before streaming, and the streamer of its layers."""
    x = torch.randn(3, 8)
    with torch.no_grad():
        expected = model(x)
    return x, expected, StreamedLayers(model, list(model), "cpu")


def test_each_layer_runs_from_a_slot_with_the_next_one_fetched_before_it_runs():
    model = _stack()
    x, expected, streamer = _streamed(model)
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
    sizes = [b.numel() for b in streamer._host]
    transfers = streamer.to_json()["transfers"]
    assert transfers["copies"] == 2 * n + 1 and transfers["waits"] == streamer.waits == 1
    assert transfers["copied_gib"] == round((2 * sum(sizes) + sizes[0]) / 2**30, 3)
    assert transfers["copy_s"] > 0 and transfers["stall_s"] is None  # the host's clock; no streams on a CPU
    assert transfers["entries"] == 2 * n and transfers["idle_entries"] is None  # each layer's start; no device
    used = {s.data_ptr() for s in streamer._slots}
    assert len(used) == 2 and streamer._slots[0].numel() == max(b.numel() for b in streamer._host)
    for packed in streamer._packed:
        assert all(p.offset % ALIGN == 0 for p in packed)


def test_a_module_shared_by_the_layers_enters_none_of_them():
    """A module in several layers says nothing of which layer runs: calling it leaves the
    running layer in its slot; its weight stays resident."""
    torch.manual_seed(0)
    act, shared = nn.Tanh(), nn.Linear(8, 8)  # a module, and one with a weight, in every layer
    model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), act, shared) for _ in range(4)]).requires_grad_(False)
    x, expected, streamer = _streamed(model)
    assert id(shared.weight) not in streamed_parameters(model, list(model))  # resident: it is every layer's
    with torch.inference_mode():
        assert torch.equal(model(x), expected) and torch.equal(model(x), expected)
    assert streamer.waits == 1 and streamer.copies == 2 * 4 + 1


def test_a_forward_that_raised_leaves_the_next_one_right():
    model = _stack()
    x, expected, streamer = _streamed(model)
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


def test_a_weight_shared_outside_the_layers_and_a_trainable_one_stay_resident():
    model = _stack((8, 8, 8))
    head = nn.Linear(8, 8).requires_grad_(False)
    head.weight = model[1][0].weight  # tied, as a head to an embedding
    model[0][0].bias.requires_grad_(True)  # trained, as a LoRA adapter
    whole = nn.ModuleDict({"body": model, "head": head})
    streamed = streamed_parameters(whole, list(model))
    assert id(head.weight) not in streamed and id(model[0][0].bias) not in streamed
    assert id(model[0][0].weight) in streamed and id(model[1][0].bias) in streamed
    streamer = StreamedLayers(whole, list(model), "cpu")
    assert not _inside(head.weight, streamer._host) and not _inside(model[0][0].bias, streamer._host)
    assert _inside(model[1][0].bias, streamer._host) and _inside(model[0][0].weight, streamer._host)
    move_resident_(whole, list(model), META)
    assert head.weight.is_meta and head.bias.is_meta and model[0][0].bias.is_meta
    assert not model[0][0].weight.is_meta and not model[1][0].bias.is_meta


def test_only_what_streams_stays_off_the_device():
    model = _stack((8, 8, 8))
    head = nn.Linear(8, 8)
    head.weight = model[1][0].weight
    head.register_buffer("scale", torch.ones(8))
    model[0].register_buffer("count", torch.zeros(1))  # a layer's buffer moves: only parameters stream
    whole = nn.ModuleDict({"body": model, "head": head})
    move_resident_(whole, list(model), META)
    assert head.weight.is_meta and head.bias.is_meta and head.scale.is_meta and model[0].count.is_meta
    assert head.weight is model[1][0].weight  # still one parameter
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


def test_a_streamed_layer_runs_on_the_device_and_rests_on_the_host(model_path, meta_stand_ins, monkeypatch):
    """fp32 (meta has no autocast): read to the host, all but the layers moved to the device;
    the head's probe, a forward at the scorer's construction, already runs streamed (its value
    comparison is what meta cannot do)."""
    from dpocache.scoring import logprobs as logprobs_mod

    def probe(scorer):
        ids = torch.ones(1, 4, dtype=torch.long, device=META)
        scorer.causal_lm(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
        return True

    monkeypatch.setattr(logprobs_mod.CompletionLogProbs, "probe_fast_path", probe)
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


def test_a_streamed_cache_build_says_what_it_copied(cli, model_path, pref_jsonl, tmp_path, monkeypatch):
    """``cache build --stream-reference true`` (on the CPU past the device check, standing in for
    a GPU) prints its layers' copies and records them in its JSON summary: every layer at least
    once a forward pass, and their time (their bytes, exactly, in the streamer's own test); the
    compute's waits for them exist on a GPU only."""
    import dpocache.config as config_mod

    monkeypatch.setattr(config_mod, "_validate_streamed", lambda cfg, flag: None)
    rc, out, err = cli("cache", "build", "--model", model_path, "--data", pref_jsonl, "--cache-dir", tmp_path,
                       "--stream-reference", "true", "--json")
    assert rc == 0, err
    summary = json.loads(out)  # stdout holds the JSON alone, the summary's lines go to stderr
    streamed, transfers = summary["streamed"], summary["streamed"]["transfers"]
    assert transfers["copies"] >= summary["forward_passes"] * streamed["layers"]
    assert transfers["copy_s"] > 0 and transfers["stall_s"] is None
    line = next(x for x in err.splitlines() if x.startswith("copied "))
    assert line.startswith(f"copied {transfers['copies']} layers, ") and "GiB/s" in line
    assert "waited" not in line and "run dry" not in line  # on a GPU only


def test_score_stream_reference_is_refused_on_a_cpu_before_the_rows_are_read(cli, model_path, tmp_path):
    rc, out, err = cli("score", "--model", model_path, "--data", tmp_path / "absent.jsonl", "--out",
                       tmp_path / "o.jsonl", "--device", "cpu", "--stream-reference")
    assert rc == 2 and "--stream-reference" in err and "device is cpu" in err and "Traceback" not in err


@pytest.mark.parametrize("extra,message", [
    (("--resident-layers", "2"), "pass --stream-base (model.stream_base) true"),
    (("--stream-base", "true", "--resident-layers", "-1"), "0 or more"),
    (("--stream-base", "true", "--resident-layers", "4"), "the model has 4 decoder layers"),
    (("--turn-layers", "1"), "pass --stream-base (model.stream_base) true"),
    (("--stream-base", "true", "--turn-layers", "-1"), "0 or more"),
    # 3 of the 4 layers stream: too few for the forward to give a kept layer's slot back before its top
    (("--stream-base", "true", "--resident-layers", "1", "--turn-layers", "1"), "at most 0 for 3 streamed layers"),
])
def test_resident_and_turn_layers_are_refused_with_one_line_before_any_model_loads(cli, model_path, pref_jsonl,
                                                                                   tmp_path, extra, message,
                                                                                   monkeypatch):
    import dpocache.config as config_mod

    monkeypatch.setattr(config_mod, "_validate_streamed", lambda cfg, flag: None)  # past the device check
    rc, out, err = cli("train", "--model", model_path, "--data", pref_jsonl, "--output-dir", tmp_path / "run",
                       "--lora-r", "4", "--gradient-checkpointing", "true", *extra)
    flag = "--turn-layers" if "--turn-layers" in extra else "--resident-layers"
    assert rc == 2 and err.count(flag) >= 1 and message in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "run" / "run.json").exists()


def test_a_streamed_base_run_says_what_it_copied(cli, deep_model_path, pref_jsonl, tmp_path, monkeypatch):
    """``train --stream-base true`` ends with a line on its base's copies (on the CPU past the
    device check, standing in for a GPU): its streamed and resident layers and the one more kept
    through each bottom turn (``--turn-layers 1``), the copies as run.json records them at the
    run's end: the second step started with that layer, uncopied."""
    import dpocache.config as config_mod

    monkeypatch.setattr(config_mod, "_validate_streamed", lambda cfg, flag: None)
    rc, out, err = cli("train", "--model", deep_model_path, "--data", pref_jsonl, "--output-dir", tmp_path / "run",
                       "--lora-r", "4", "--gradient-checkpointing", "true", "--stream-base", "true",
                       "--resident-layers", "1", "--turn-layers", "1", "--max-steps", "2", "--device", "cpu")
    assert rc == 0, err
    record = json.loads((tmp_path / "run" / "run.json").read_text())
    streamed = record["policy"]["streamed"]
    assert 0 < record["final"]["loop_s"]
    transfers = streamed["transfers"]
    assert transfers["copies"] >= 2 * 5 - 1  # each of the five streamed layers a step, but the one kept
    assert streamed["turn_layers"] == 1 and transfers["turn_kept"] == 1
    line = next(x for x in out.splitlines() if x.startswith("streamed base:"))
    assert line.startswith(f"streamed base: 5 layers from host memory, 1 on the device, 1 more from each backward "
                           f"to the next forward; copied "
                           f"{transfers['copies']} layers, ") and "waited" not in line and "run dry" not in line


def _transfers(stall_s=None, idle_entries=None, entries=64) -> dict:
    return {"copies": 52, "waits": 1, "copied_gib": 22.9, "copy_s": 0.4, "copy_gib_per_s": 57.2,
            "stall_s": stall_s, "entries": entries, "idle_entries": idle_entries, "turn_kept": 0}


@pytest.mark.parametrize("training", [True, False])
def test_the_summary_says_when_the_copies_or_the_host_set_a_streamed_runs_pace(training):
    """A stall of a fifth of the run or more names the copies and what hides them (train's
    options or cache build's); the device run dry at half the layer starts or more names the
    host; below both, or on a CPU (neither measured), nothing."""
    copies = describe_pace(_transfers(stall_s=2.5, idle_entries=3), 10.0, training)
    assert copies.startswith("the copies set the pace: the compute waited 2.5 s of 10.0 s")
    assert ("--resident-layers" in copies and "--batch-size" in copies) if training else "--max-tokens" in copies
    host = describe_pace(_transfers(stall_s=0.1, idle_entries=40), 10.0, training)
    assert host.startswith("the host set the pace: the device had run dry at 40 of 64 layer starts")
    assert ("--compile on" in host) == training
    assert describe_pace(_transfers(stall_s=1.9, idle_entries=31), 10.0, training) is None
    assert describe_pace(_transfers(), 10.0, training) is None  # a CPU's record


def test_stream_reference_is_refused_by_train_before_any_model_loads(cli, model_path, pref_jsonl, tmp_path):
    rc, out, err = cli("train", "--model", model_path, "--data", pref_jsonl, "--output-dir", tmp_path / "run",
                       "--device", "cpu", "--stream-reference", "true")
    assert rc == 2 and "--stream-reference" in err and "device is cpu" in err
    assert not (tmp_path / "run").exists()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_streamed_reference_on_a_gpu_matches_and_holds_two_layers(tmp_path):
    """Values bit for bit against the resident reference in bf16, and a peak memory that no
    longer holds every layer: the layers' bytes less two slots below the resident pass's; the
    layers' host buffers page-locked, several to an allocation."""
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
            # page-locked, several layers to an allocation (a copy from pageable memory would not overlap)
            host = reference.streamed._host
            assert all(b.is_pinned() for b in host) and len({b.untyped_storage().data_ptr() for b in host}) < 12
            sizes = [-(-b.numel() // ALIGN) * ALIGN for b in host]
            assert reference.streamed.to_json()["page_locked_gib"] == round(page_locked_bytes(sizes) / 2**30, 3)
            # timed on the device: a page-locked copy runs at gigabytes a second; the compute's waits measured
            transfers = reference.streamed.to_json()["transfers"]
            assert transfers["copy_gib_per_s"] > 1 and transfers["stall_s"] is not None and transfers["stall_s"] >= 0
            # each forward started every layer, the head's probe at construction one of them
            assert 0 <= transfers["idle_entries"] <= transfers["entries"] == (reference.forward_passes + 1) * 12
        del reference
    for name in ("chosen_logps", "rejected_logps"):
        assert torch.equal(getattr(values[True], name), getattr(values[False], name))
    assert peaks[True] <= peaks[False] - layer_bytes * (10 / 12) * 0.9


class _Block(nn.Module):
    """A frozen matrix with a trainable low-rank adapter beside it, as a LoRA layer; under
    autograd its forward is checkpointed as transformers does it: the layer's own hooks run
    outside the checkpoint, so the backward's recompute calls only its modules."""

    def __init__(self, width: int):
        super().__init__()
        self.base = nn.Linear(width, width).requires_grad_(False)
        self.down, self.up = nn.Linear(width, 2, bias=False), nn.Linear(2, width, bias=False)
        self.checkpointed = True

    def forward(self, x):
        if self.checkpointed and torch.is_grad_enabled():
            return torch.utils.checkpoint.checkpoint(self._forward, x, use_reentrant=False)
        return self._forward(x)

    def _forward(self, x):
        return x + torch.tanh(self.base(x) + self.up(self.down(x)))


class _Checkpointed(nn.Module):
    def __init__(self, layers: int = 5, width: int = 8):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(_Block(width) for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _train(model: nn.Module, steps: int = 3, evaluate: bool = True) -> tuple[list[float], list[torch.Tensor]]:
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(steps):
        loss = model(x).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        if evaluate:
            with torch.no_grad():  # an evaluation between steps
                model(x)
    return losses, [p.detach().clone() for p in model.parameters() if p.requires_grad]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_layer_start_counts_as_idle_exactly_where_the_device_had_run_dry():
    """``Transfers.idle_entries`` on a GPU: a host that waits for the device before each layer
    (a synchronize in a hook ahead of the streamer's) finds it idle at every start; a device
    given a long kernel before each layer (``torch.cuda._sleep``) is busy at every start."""
    for host_waits in (True, False):
        model = _stack(widths=(256,) * 5).cuda()
        for layer in model:
            layer.register_forward_pre_hook(
                (lambda m, a: torch.cuda.synchronize()) if host_waits else (lambda m, a: torch.cuda._sleep(10**7)))
        streamer = StreamedLayers(model, list(model), "cuda")  # its hooks run after the ones above
        with torch.inference_mode():
            model(torch.randn(3, 256, device="cuda"))
        transfers = streamer.to_json()["transfers"]
        assert transfers["entries"] == 4
        assert transfers["idle_entries"] == (4 if host_waits else 0), host_waits


def test_checkpointed_training_through_streamed_layers_equals_the_resident_run():
    """A trainable adapter over frozen streamed layers, checkpointed: the same losses and
    adapters bit for bit; each layer fetched ahead in the forward and, in reverse, in the
    backward's recompute, so after the first layer of the first step no layer waits for its
    copy, whatever evaluations run between the steps."""
    import copy

    resident = _Checkpointed()
    streamed_model = copy.deepcopy(resident)
    streamer = StreamedLayers(streamed_model, list(streamed_model.layers), "cpu")
    assert all(_inside(layer.base.weight, streamer._host) for layer in streamed_model.layers)
    assert not any(_inside(layer.up.weight, streamer._host) for layer in streamed_model.layers)
    order = []
    for i, layer in enumerate(streamed_model.layers):  # the recompute calls the base matrix, not the layer
        layer.base.register_forward_pre_hook(lambda m, a, i=i: order.append(
            (i, torch.is_grad_enabled(), sorted(streamer._fetched), _inside(m.weight, streamer._slots))))
    expected = _train(resident)
    got = _train(streamed_model)
    assert got[0] == expected[0]
    assert all(torch.equal(a, b) for a, b in zip(got[1], expected[1]))
    assert streamer.waits == 1
    assert all(in_slot for *_, in_slot in order)
    n = len(streamed_model.layers)
    step = order[:3 * n]  # forward, the backward's recompute, then an evaluation
    assert [i for i, *_ in step] == [*range(n), *reversed(range(n)), *range(n)]
    forward, backward = step[:n], step[n:2 * n]
    # ahead of each layer the next; at the turn the one before, which the recompute needs next
    assert [fetched for _, _, fetched, _ in forward] == [[i + 1] for i in range(n - 1)] + [[n - 2]]
    assert [fetched for _, _, fetched, _ in backward] == [[n - 2]] + [[i - 1] for i in range(n - 2, 0, -1)] + [[1]]


def test_layers_kept_through_the_bottom_turn_start_the_next_forward_without_a_copy():
    """``turn_layers`` N: the streamed layers 2 to N+1 keep their slots from the backward to the
    next forward, which copies N fewer layers a step (``turn_kept``), fetching ahead past them
    into the slots they give up as they run and giving slots back down to two before the top
    turn; the same losses and adapters bit for bit as the resident run and as two slots alone;
    no wait after the first layer of the first step."""
    import copy

    resident = _Checkpointed(layers=10)
    plain, turned = copy.deepcopy(resident), copy.deepcopy(resident)
    two = StreamedLayers(plain, list(plain.layers), "cpu")
    streamer = StreamedLayers(turned, list(turned.layers), "cpu", turn_layers=3)
    seen = []
    for i, layer in enumerate(turned.layers):
        layer.base.register_forward_pre_hook(lambda m, a, i=i: seen.append(
            (i, sorted(streamer._fetched), len(streamer._slots), _inside(m.weight, streamer._slots))))
    expected = _train(resident, evaluate=False)
    for model in (plain, turned):
        got = _train(model, evaluate=False)
        assert got[0] == expected[0]
        assert all(torch.equal(a, b) for a, b in zip(got[1], expected[1]))
    assert streamer.waits == two.waits == 1 and all(on_slot for *_, on_slot in seen)
    assert two.copies - streamer.copies == 3 * 2 == streamer.transfers.turn_kept  # steps 2 and 3
    forward, backward = seen[20:30], seen[30:40]  # the second step's
    assert [i for i, *_ in forward] == list(range(10)) and [i for i, *_ in backward] == list(range(9, -1, -1))
    # layer 0 still runs from the backward, 1 is in the other slot, 2-4 were kept: the copies
    # ahead start at once, into the slots they give up, then back to the next one ahead
    assert [f for _, f, _, _ in forward] == [[1], [5], [5, 6], [5, 6, 7], [5, 6, 7, 8], [6, 7, 8], [7, 8], [8], [9],
                                             [8]]
    assert [live for _, _, live, _ in forward] == [5, 5, 5, 5, 5, 4, 3, 2, 2, 2]
    # the top turn holds the two slots alone; the kept layers take theirs from the backward's end
    assert [live for _, _, live, _ in backward] == [2, 2, 2, 2, 2, 2, 3, 4, 5, 5]
    assert streamer.to_json()["turn_layers"] == 3 and streamer.to_json()["slots"] == 2
    # an evaluation between steps runs the kept layers where they wait and leaves them for the next forward
    plain, turned = copy.deepcopy(resident), copy.deepcopy(resident)
    two = StreamedLayers(plain, list(plain.layers), "cpu")
    streamer = StreamedLayers(turned, list(turned.layers), "cpu", turn_layers=3)
    expected = _train(resident)
    for model in (plain, turned):
        got = _train(model)
        assert got[0] == expected[0] and all(torch.equal(a, b) for a, b in zip(got[1], expected[1]))
    assert streamer.transfers.turn_kept == 3 * 2  # the training forwards of steps 2 and 3
    assert two.copies - streamer.copies == 3 * 2 + 3 * 3  # and each evaluation, after each step's backward
    assert streamer.waits == two.waits == 1
    with pytest.raises(ValueError, match="turn layers must be from 0 to 3 for 10 streamed layers"):
        StreamedLayers(copy.deepcopy(resident), list(resident.layers), "cpu", turn_layers=4)


def test_the_layers_kept_through_a_turn_are_few_enough_to_give_back_before_the_top(model_path):
    """``most_turn_layers``: (streamed - 3) // 2, so the forward is back to two slots before its
    top turn; ``check_streamed_layers`` passes any model with no layer kept, one streamed layer
    included (the DDP test's two-layer model with one resident)."""
    from dpocache.config import ConfigError
    from dpocache.models.streaming import check_streamed_layers, most_turn_layers

    assert [most_turn_layers(n) for n in (1, 2, 3, 4, 5, 6, 26)] == [0, 0, 0, 0, 1, 1, 11]
    check_streamed_layers(model_path, 3, 0)
    check_streamed_layers(model_path, 0, 0)
    with pytest.raises(ConfigError, match="at most 0 for 4 streamed layers"):
        check_streamed_layers(model_path, 0, 1)


def test_resident_layers_are_spread_out_and_never_the_first():
    assert spread_resident(32, 8) == [3, 7, 10, 14, 17, 21, 24, 28]
    assert spread_resident(6, 2) == [2, 4] and spread_resident(4, 3) == [1, 2, 3] and spread_resident(5, 0) == []
    for bad in (-1, 6):
        with pytest.raises(ValueError, match="resident layers"):
            spread_resident(6, bad)


def test_streamed_layers_between_resident_ones_fetch_the_next_streamed_one_ahead():
    """``--resident-layers``: the layers ``spread_resident`` names stay where they are and only
    the others stream, checkpointed: the same losses and adapters bit for bit as the resident
    run; a streamed layer fetches the next streamed one (past a resident layer, whose compute the
    copy then hides behind too) and, in the recompute, the one before; no wait after the first."""
    import copy

    resident = _Checkpointed(layers=6)
    mixed = copy.deepcopy(resident)
    kept = spread_resident(6, 2)
    streamed = [layer for index, layer in enumerate(mixed.layers) if index not in kept]
    streamer = StreamedLayers(mixed, streamed, "cpu")
    assert kept == [2, 4] and len(streamer.layers) == 4
    assert not any(_inside(mixed.layers[i].base.weight, streamer._host) for i in kept)
    fetched = []
    for index, layer in enumerate(mixed.layers):
        layer.base.register_forward_pre_hook(lambda m, a, i=index: fetched.append((i, sorted(streamer._fetched))))
    expected = _train(resident, evaluate=False)
    got = _train(mixed, evaluate=False)
    assert got[0] == expected[0]
    assert all(torch.equal(a, b) for a, b in zip(got[1], expected[1]))
    assert streamer.waits == 1
    # indices among the streamed layers (0, 1, 3, 5 of the model): the forward, then the recompute
    step = fetched[:12]
    assert [i for i, _ in step] == [*range(6), *reversed(range(6))]
    assert [f for i, f in step[:6] if i not in kept] == [[1], [2], [3], [2]]
    assert [f for i, f in step[6:] if i not in kept] == [[2], [1], [0], [1]]


def test_training_without_checkpointing_cannot_use_a_reused_slot_silently():
    """Without checkpointing autograd keeps each layer's weights for the backward, which their
    slot no longer holds: autograd's version check stops the backward instead of a silent
    wrong gradient (training refuses the combination before this: config)."""
    model = _Checkpointed()
    for layer in model.layers:
        layer.checkpointed = False
    StreamedLayers(model, list(model.layers), "cpu")
    loss = model(torch.randn(4, 8)).pow(2).mean()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def _lora_llama(model_path, streamed: bool, compiled: bool, keep: tuple[str, ...] = ()):
    """The tiny Llama in fp32 with a LoRA adapter on every linear layer (both matrices drawn at
    random, so every adapter weight has a gradient), checkpointed by ``enable_checkpointing``
    (keeping the products of ``keep``)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from dpocache.models.checkpointing import enable_checkpointing

    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_path),
                           LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False))
    model.train()  # transformers checkpoints a layer in training mode only
    enable_checkpointing(model, keep, compiled=compiled)
    model.enable_input_require_grads()
    streamer = StreamedLayers(model, decoder_layers(model), "cpu") if streamed else None
    return model, streamer


def test_ddp_leaves_a_streamed_bases_weights_to_the_streaming(model_path, world_of_one):
    """Under torchrun a streamed base's policy is wrapped in DDP without its streamed weights:
    they rest in host memory between their layers' calls while the rest of the policy is on the
    GPU, and DDP refuses a module whose parameters are on two device types (and would broadcast
    8B of frozen weights every rank reads from the checkpoint anyway). DDP keeps every trainable
    parameter and every other one, and a step through it gives the adapters the resident
    model's gradients. A gloo world of one stands in for the ranks (the wrapper wraps from two
    on; on the CPU the device types agree, so the refusal itself needs GPUs)."""
    from dataclasses import replace

    from torch.nn.parallel import DistributedDataParallel as DDP

    from dpocache.config import Config
    from dpocache.models.policy import wrap_for_distributed
    from dpocache.scoring.logprobs import CompletionLogProbs

    model, streamer = _lora_llama(model_path, streamed=True, compiled=False)
    model.dpocache_streamed = streamer
    scorer = CompletionLogProbs(model, probe=False)
    wrapped = wrap_for_distributed(scorer, model, Config(), replace(world_of_one, world_size=2))
    assert isinstance(wrapped, DDP)
    streamed = {id(p) for p in streamer.parameters()}
    names = {n for n, p in scorer.named_parameters() if id(p) in streamed}
    assert len(names) == len(streamed) > 0 and wrapped.parameters_to_ignore == names
    kept = {id(p) for p in wrapped._module_parameters}
    assert not kept & streamed
    assert kept == {id(p) for p in scorer.parameters()} - streamed  # adapters, embeddings, head, final norm
    assert {id(p) for p in scorer.parameters() if p.requires_grad} <= kept
    # a step through DDP and the streamed layers gives the adapters the resident model's gradients
    resident, _ = _lora_llama(model_path, streamed=False, compiled=False)
    torch.manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (2, 12))
    mask, completion = torch.ones_like(ids), torch.zeros_like(ids)
    completion[:, 6:] = 1
    wrapped(ids, mask, completion).sum().backward()
    CompletionLogProbs(resident, probe=False)(ids, mask, completion).sum().backward()
    got = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    want = {n: p.grad for n, p in resident.named_parameters() if p.requires_grad}
    assert got.keys() == want.keys() and all(g is not None for g in got.values())
    assert all(torch.allclose(got[n], want[n], atol=1e-6) for n in got)


def _checkpoint_the_call(monkeypatch, layer_class) -> None:
    """``layer_class`` checkpointed as earlier transformers (5.17, for one) do it: its checkpoint is handed
    ``partial(nn.Module.__call__ bound to the layer, **kwargs)``, the layer's hooks inside it (5.24
    hands over ``partial(forward, layer, **kwargs)``, its hooks outside)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    def __call__(self, *args, **kwargs):
        if self.gradient_checkpointing and self.training:
            return self._gradient_checkpointing_func(
                functools.partial(super(GradientCheckpointingLayer, self).__call__, **kwargs), *args)
        return super(GradientCheckpointingLayer, self).__call__(*args, **kwargs)

    # the layer's own forward, under the wrapper transformers 5.24 puts around it
    monkeypatch.setattr(layer_class, "forward", getattr(layer_class.forward, "__wrapped__", layer_class.forward))
    monkeypatch.setattr(layer_class, "__call__", __call__)


@pytest.mark.parametrize("keep,handed_over", [((), "forward"), (("down_proj",), "forward"),
                                              (("down_proj",), "__call__")])
def test_a_streamed_base_compiled_inside_its_checkpoints_trains_as_the_eager_resident_one(model_path, keep,
                                                                                          handed_over, monkeypatch):
    """``--stream-base`` with ``--compile on``: each layer's forward compiled inside its
    checkpoint (``LayerCheckpoint``), which fetches the layer's weights before it, in the forward
    and in the backward's recompute. Over batches of three shapes: the eager resident model's
    loss and adapter gradients (fp32, within the compiler's rounding); every recompute runs
    from the layer's slot, the layers last to first, none waiting for its copy after the first;
    two graphs for all four layers and all three shapes (the forward without autograd, the
    recompute with it), not one per layer or per shape, and no graph break. With
    ``--checkpoint-keep down_proj`` each recompute takes the product its forward kept (one
    opaque operation in the graph, ``dpocache::kept_linear``) instead of running that matrix.
    ``__call__``: the same where transformers (5.17, for one) checkpoints the layer's call, hooks
    and all (there, before dpocache ran the hooks outside, dynamo compiled the streaming hooks
    again and again and each backward's turn waited for a copy)."""
    from torch._dynamo.utils import counters
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from dpocache.models import checkpointing
    from dpocache.models.checkpointing import LayerCheckpoint

    if handed_over == "__call__":
        _checkpoint_the_call(monkeypatch, LlamaDecoderLayer)
    torch._dynamo.reset()  # the graphs this test counts, whichever test compiled the layer's forward before
    taken = []
    real_take = checkpointing.Phase.take
    monkeypatch.setattr(checkpointing.Phase, "take", lambda phase, key: taken.append(key) or real_take(phase, key))
    eager, _ = _lora_llama(model_path, streamed=False, compiled=False)
    compiled, streamer = _lora_llama(model_path, streamed=True, compiled=True, keep=keep)
    layers = decoder_layers(compiled)
    entered = []  # (layer, grad enabled, its streamed matrices in a slot) after each checkpoint's entry
    for index, layer in enumerate(layers):
        checkpoint = layer._gradient_checkpointing_func
        assert isinstance(checkpoint, LayerCheckpoint) and checkpoint.compiled and checkpoint.before is not None

        def before(enter=checkpoint.before, index=index, layer=layer):
            enter()
            frozen = [p for p in layer.parameters() if not p.requires_grad and p.dim() == 2]
            entered.append((index, torch.is_grad_enabled(), all(_inside(p, streamer._slots) for p in frozen)))
        checkpoint.before = before
    graphs, breaks = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
    for batch, length in ((2, 21), (3, 27), (2, 35)):
        ids = torch.randint(3, 300, (batch, length), generator=torch.Generator().manual_seed(length))
        results = []
        for model in (eager, compiled):
            model.zero_grad()
            loss = model(input_ids=ids).logits.log_softmax(-1)[..., 5].mean()
            loss.backward()
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
            results.append((loss.detach(), grads))
        (want, want_grads), (got, got_grads) = results
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), (length, got, want)
        assert got_grads.keys() == want_grads.keys() and len(got_grads) == 4 * 7 * 2
        for name, grad in want_grads.items():
            assert grad.abs().max() > 0, name
            assert torch.allclose(got_grads[name], grad, rtol=1e-4, atol=1e-5 * grad.abs().max()), name
    n = len(layers)
    # the forward enters each layer by its own hook first (its checkpoint finds it running); the
    # recompute by its checkpoint, last to first, each from its slot
    recomputes = [(index, in_slot) for index, grad, in_slot in entered if grad]
    assert [index for index, _ in recomputes] == 3 * [*reversed(range(n))]
    assert all(in_slot for _, in_slot in recomputes)
    assert streamer.waits == 1
    assert counters["stats"]["unique_graphs"] - graphs == 2 and sum(counters["graph_break"].values()) == breaks
    assert len(taken) == (3 * n if keep else 0)  # one down projection a layer, in each of three backwards


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")])])
def test_a_lora_run_with_its_base_and_reference_streamed_trains_as_the_resident_one(tmp_path, deep_model_path,
                                                                                   train_jsonl,  # noqa: F811
                                                                                   monkeypatch, device):
    """``train --stream-base --stream-reference`` through the whole loop, the CPU standing in for
    the GPU (the check that refuses a CPU is what is stood in for): a bf16 LoRA run with its
    base stored in bf16 and checkpointed by transformers, as on a GPU, logs the same values and
    saves the same adapter as the resident run, bit for bit (on a GPU in bf16: the same losses
    and gradient norms within its rounding); every frozen matrix runs from a
    slot, in the forward and in the backward's recompute (which transformers runs without the
    layer's own hooks), the third layer kept on the device from each backward to the next
    forward (``--turn-layers 1``); run.json says what streamed; no layer of the policy waited for
    its copy after the first."""
    import dpocache.config as config_mod

    setup_mod = importlib.import_module("dpocache.training.setup")
    if device == "cpu":
        monkeypatch.setenv("DPOCACHE_BF16_MATMUL", "native")  # the native bf16 kernels, as on a GPU
        monkeypatch.setattr(config_mod, "_validate_streamed", lambda cfg, flag: None)
    loaded, calls = [], []
    real = setup_mod.load_policy

    def load(*args, **kwargs):
        policy = real(*args, **kwargs)
        streamer = getattr(policy, "dpocache_streamed", None)
        for layer in decoder_layers(policy) if streamer is not None else []:
            for module in layer.modules():
                frozen = [p for p in module.parameters(recurse=False) if not p.requires_grad]
                if frozen:  # the base's matrices and the norms
                    module.register_forward_pre_hook(lambda m, a: calls.append(
                        (torch.is_grad_enabled(), type(m).__name__, all(_inside(p, streamer._slots) for p in
                                                                       m.parameters(recurse=False)
                                                                       if not p.requires_grad))))
        loaded.append(policy)
        return policy

    monkeypatch.setattr(setup_mod, "load_policy", load)
    runs = {}
    for streamed in (False, True):
        out = tmp_path / f"run-{streamed}"
        run_training(*flags(deep_model_path, train_jsonl, out, tmp_path / f"cache-{streamed}", "--lora-r", "4",
                            "--dtype", "bfloat16", "--gradient-checkpointing", "true", "--max-steps", "3",
                            "--lr", "1e-2", "--stream-base", str(streamed), "--stream-reference", str(streamed),
                            *(("--turn-layers", "1") if streamed else ()),
                            # a GPU runs Liger's kernels where installed, as the GPU suite does
                            "--device", device, "--kernels", "none" if device == "cpu" else "auto"))
        values = [{k: v for k, v in r.items() if k not in {"seconds", "tokens_per_s", "mfu"}}
                  for r in train_records(out)]
        runs[streamed] = (values, load_tensors(out / "final" / "adapter_model.safetensors"), run_json(out))
    assert len(runs[True][0]) == 3 and runs[True][1].keys() == runs[False][1].keys()
    if device == "cpu":
        assert runs[True][0] == runs[False][0]
        assert all(torch.equal(runs[True][1][k], runs[False][1][k]) for k in runs[True][1])
    else:  # a GPU's attention backward sums in no fixed order: two resident runs differ in the last bits too,
        # and Adam's first steps move a weight by about lr whatever its gradient's size, so the adapters
        # differ by up to a step where a gradient near zero changed sign (0.024 at lr 1e-2 on an H200)
        for got, want in zip(runs[True][0], runs[False][0]):
            assert got["loss"] == pytest.approx(want["loss"], rel=1e-3), (got, want)
            assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=5e-2), (got, want)
    info = runs[True][2]
    assert info["policy"]["streamed"]["layers"] == 6 and info["reference"]["streamed"]["layers"] == 6
    assert runs[False][2]["policy"]["streamed"] is None and runs[False][2]["reference"]["streamed"] is None
    # the run's copies, recorded at its end: at least every layer once a step, a GPU's waits for them timed
    transfers = info["policy"]["streamed"]["transfers"]
    assert transfers["copies"] >= 3 * 5 and transfers["copy_s"] > 0 and transfers["copy_gib_per_s"] > 0
    assert info["policy"]["streamed"]["turn_layers"] == 1 and transfers["turn_kept"] == 2  # steps 2 and 3
    assert (transfers["stall_s"] is None) == (device == "cpu") and (transfers["stall_s"] or 0) >= 0
    assert info["reference"]["streamed"]["transfers"]["copies"] >= 6
    # 7 matrices a layer; under autograd each runs in the forward and again in the recompute
    assert sum(grad and kind == "Linear" for grad, kind, _ in calls) == 3 * 2 * 6 * 7
    assert {kind for *_, kind, _ in calls} == {"Linear", "LlamaRMSNorm"} and all(ok for *_, ok in calls)
    streamer = loaded[1].dpocache_streamed
    assert streamer.waits == 1 and streamer.copies >= 3 * 2 * (6 - 2 - 1)


@pytest.mark.parametrize("device,dtype", [("cpu", "float32"), ("cpu", "bfloat16"), pytest.param(
    "cuda", "bfloat16", marks=[pytest.mark.gpu,
                               pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")])])
def test_train_stream_base_with_compile_on_trains_as_the_eager_resident_run(tmp_path, deep_model_path,
                                                                            train_jsonl,  # noqa: F811
                                                                            monkeypatch, device, dtype):
    """``train --stream-base true --compile on --resident-layers 1 --turn-layers 1
    --checkpoint-keep down_proj,o_proj`` through the whole loop, its layers' forwards compiled
    inside their checkpoints (five streamed, one of them kept through each bottom turn in a slot
    of its own, one on the device) with the output projections' products kept and the down
    projections' skipped in the recompute (the backward never reads them), against the eager
    resident run that recomputes every product (``--skip-unread-products false``): on the CPU
    (standing in for the GPU) in fp32, the same logged values and adapter within the compiler's
    rounding; on a GPU in bf16 with Liger's kernels off, as the GPU suite's LoRA row runs it,
    the same losses and gradient norms within bf16 rounding
    (Adam's first steps on bf16 rounding noise leave the adapters themselves apart by more); on
    the CPU in bf16 with its native kernels, likewise, where each adapted layer's product and
    update run as one operation (``dpocache::lora_linear``), the down projections' giving zeros in
    the recompute. Two graphs for all the layers, resident and streamed, and no graph break,
    which run.json records with the compiled, streamed and resident layers."""
    import dpocache.config as config_mod

    from torch._dynamo.utils import counters

    from dpocache.models import lora_fused
    from dpocache.models.checkpoint_phases import current_phase

    if device == "cpu":
        monkeypatch.setattr(config_mod, "_validate_streamed", lambda cfg, flag: None)
        monkeypatch.setenv("DPOCACHE_BF16_MATMUL", "native")  # as on a GPU (bf16 only)
    unread_calls = []  # dpocache::lora_linear asks the phase for an unread product only
    monkeypatch.setattr(lora_fused, "current_phase", lambda: unread_calls.append(1) or current_phase())
    runs = {}
    torch._dynamo.reset()  # the graphs this test counts, whichever test compiled the layer's forward before
    for streamed in (False, True):
        graphs = counters["stats"]["unique_graphs"]
        out = tmp_path / f"run-{streamed}"
        # one cache: the second run's reference values are a hit (its reference pass is not compiled)
        run_training(*flags(deep_model_path, train_jsonl, out, tmp_path / "cache", "--lora-r", "4", "--dtype", dtype,
                            "--gradient-checkpointing", "true", "--max-steps", "3", "--lr", "1e-2",
                            "--stream-base", str(streamed), "--compile", "on" if streamed else "off",
                            "--resident-layers", "1" if streamed else "0",
                            *(("--turn-layers", "1") if streamed else ()),
                            "--checkpoint-keep", "down_proj,o_proj" if streamed else "none",
                            "--skip-unread-products", str(streamed).lower(), "--device", device, "--kernels", "none"))
        runs[streamed] = (train_records(out), load_tensors(out / "final" / "adapter_model.safetensors"), run_json(out))
    (want, want_adapter, _), (got, got_adapter, info) = runs[False], runs[True]
    assert len(got) == len(want) == 3 and got_adapter.keys() == want_adapter.keys()
    moved = max(float(t.abs().max()) for name, t in want_adapter.items() if "lora_B" in name)
    assert moved > 0.01  # the adapters trained: the comparisons below say something
    assert bool(unread_calls) == (dtype == "bfloat16")  # the fused LoRA forward runs under bf16 autocast only
    if dtype == "float32":
        for step_got, step_want in zip(got, want):
            for key in ("loss", "grad_norm", "logps/chosen", "logps/rejected", "rewards/margins"):
                assert step_got[key] == pytest.approx(step_want[key], rel=1e-4, abs=1e-5), (key, step_got, step_want)
        assert max_abs_diff(got_adapter, want_adapter) < 0.02 * moved  # Adam: a step of lr on near-zero gradients
    else:
        for step_got, step_want in zip(got, want):
            assert step_got["loss"] == pytest.approx(step_want["loss"], rel=1e-2), (step_got, step_want)
            assert step_got["grad_norm"] == pytest.approx(step_want["grad_norm"], rel=5e-2), (step_got, step_want)
    assert info["policy"]["compiled_layers"] == 6
    assert "compiler" not in runs[False][2]["policy"]
    assert info["policy"]["streamed"]["layers"] == 5 and info["policy"]["streamed"]["resident_layers"] == 1
    assert info["policy"]["streamed"]["transfers"]["turn_kept"] == 2  # steps 2 and 3 started with it
    assert info["policy"]["kept_products"] == {"names": ["o_proj"], "linear_layers": 6}
    assert info["policy"]["skipped_products"] == {"names": ["down_proj"], "linear_layers": 6}
    assert runs[False][2]["policy"]["skipped_products"] is None
    assert runs[False][2]["policy"]["compiled_layers"] == 0
    # the forward without autograd and the recompute with it, for the resident and the streamed
    # layers alike; run.json's record says why where it compiled more (the guards that failed).
    # Last, so that a GPU that compiles more still checks the values above.
    compiler = info["policy"]["compiler"]
    assert counters["stats"]["unique_graphs"] - graphs == 2, compiler
    assert compiler["graphs"] == 2 and compiler["graph_breaks"] == 0, compiler
    assert len(compiler["recompile_reasons"]) == 1 and "grad_mode" in compiler["recompile_reasons"][0], compiler
    assert compiler["graph_break_reasons"] == []


@pytest.mark.parametrize("extra,message", [
    ((), "--lora-r"),
    (("--lora-r", "4"), "--gradient-checkpointing"),
])
def test_stream_base_is_refused_without_lora_or_checkpointing(cli, model_path, pref_jsonl, tmp_path, extra, message,
                                                             monkeypatch):
    import dpocache.config as config_mod

    monkeypatch.setattr(config_mod, "_validate_streamed", lambda cfg, flag: None)  # past the device check
    rc, out, err = cli("train", "--model", model_path, "--data", pref_jsonl, "--output-dir", tmp_path / "run",
                       "--stream-base", "true", *extra)
    assert rc == 2 and "--stream-base" in err and message in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()


def test_page_locked_allocations_hold_several_layers_and_take_the_least_memory(monkeypatch):
    """torch's page-locked allocator rounds every allocation up to a power of two: one per layer,
    an 8B model's 32 layers of 0.41 GiB would take 16 GiB. Packed several to an allocation (at
    most ``CHUNK_LAYERS``), they take 14.5 GiB, a 70B model's 80 layers of 1.59 GiB 128 GiB
    instead of 160; against every split of a few layers tried one by one, none takes less."""
    import itertools

    from dpocache.models import streaming

    gib = 1 << 30
    layer_8b, layer_70b = 436224000, 1711308800  # 2 bytes x one decoder layer's parameters, norms included
    assert page_locked_bytes([layer_8b] * 32) == 14.5 * gib and 32 * (1 << (layer_8b - 1).bit_length()) == 16 * gib
    assert page_locked_bytes([layer_70b] * 80) == 128 * gib
    assert all(count <= streaming.CHUNK_LAYERS for count in page_locked_chunks([layer_8b] * 32))
    monkeypatch.setattr(streaming, "CHUNK_LAYERS", 3)
    for sizes in ([5 * ALIGN, 3 * ALIGN, 3 * ALIGN, 6 * ALIGN, ALIGN, 2 * ALIGN, 7 * ALIGN], [3 * ALIGN] * 7):
        counts = page_locked_chunks(sizes)
        assert sum(counts) == len(sizes) and max(counts) <= 3
        cheapest = min(_allocated(sizes, split) for split in _splits(len(sizes), 3, itertools))
        assert page_locked_bytes(sizes) == cheapest == _allocated(sizes, counts)


def _splits(n: int, longest: int, itertools):
    """Every way to cut ``n`` buffers into consecutive runs of at most ``longest``."""
    for cuts in itertools.product((False, True), repeat=n - 1):
        counts, run = [], 1
        for cut in cuts:
            if cut:
                counts.append(run)
                run = 1
            else:
                run += 1
        counts.append(run)
        if max(counts) <= longest:
            yield counts


def _allocated(sizes: list[int], counts: list[int]) -> int:
    total, first = 0, 0
    for count in counts:
        run = sum(sizes[first:first + count])
        total += 1 << (run - 1).bit_length()
        first += count
    return total


def test_a_streamed_models_layers_share_few_host_allocations_each_at_an_aligned_offset(model_path):
    """The layers' host buffers are views of as many allocations as ``page_locked_chunks``
    splits them into, each buffer starting at a multiple of ``ALIGN`` of its allocation."""
    streamed = ReferenceModel.from_pretrained(model_path, "float32", "cpu", kernels="none", stream=True)
    host = streamed.streamed._host
    allocations = {b.untyped_storage().data_ptr() for b in host}
    sizes = [-(-b.numel() // ALIGN) * ALIGN for b in host]
    assert len(allocations) == len(page_locked_chunks(sizes)) < len(host)
    assert all((b.data_ptr() - b.untyped_storage().data_ptr()) % ALIGN == 0 for b in host)
    info = streamed.streamed.to_json()
    assert info["host_allocations"] == len(allocations) and info["page_locked_gib"] is None  # not page-locked here
