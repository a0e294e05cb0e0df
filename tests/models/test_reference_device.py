"""The reference pass and the reference service return their values on the host, every tensor
combined where it lives, whichever device the model runs on. A GPU refuses a host tensor mixed
with device ones (an index, a count), which a CPU run never sees; PyTorch's ``meta`` device is
not the host either, so the model runs on it here. What meta cannot do is stood in for: its
values' host copy is zeros, page-locking checks that it is given a host tensor, the output
head's equality probe (a comparison of values) is taken as passed, and transformers builds the
causal mask instead of reading whether a padding mask pads anything."""

from __future__ import annotations

import pytest
import torch

from dpocache.data.pairs import TokenizedPair
from dpocache.models.reference import ReferenceModel
from dpocache.models.tiny import save_tiny_model
from dpocache.scoring import logprobs as logprobs_mod

META = torch.device("meta")


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("reference-device"), "llama")


@pytest.fixture
def meta_stand_ins(monkeypatch):
    import transformers.masking_utils as masking

    host_copy = torch.Tensor.cpu

    def cpu(tensor, *args, **kwargs):
        return torch.zeros(tensor.shape, dtype=tensor.dtype) if tensor.is_meta else host_copy(tensor, *args, **kwargs)

    def pin_memory(tensor):
        assert tensor.device.type == "cpu", f"page-locking a {tensor.device} tensor"
        return tensor.clone()

    monkeypatch.setattr(torch.Tensor, "cpu", cpu)
    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    monkeypatch.setattr(logprobs_mod.CompletionLogProbs, "probe_fast_path", lambda self: True)
    monkeypatch.setattr(masking, "_ignore_causal_mask_sdpa", lambda *args, **kwargs: False)


def _pairs() -> list[TokenizedPair]:
    g = torch.Generator().manual_seed(0)
    ids = lambda n: tuple(torch.randint(3, 300, (n,), generator=g).tolist())  # noqa: E731
    return [TokenizedPair(i, ids(6 + i), ids(3 + i % 4), ids(5 - i % 3), key=bytes([i]) * 16) for i in range(6)]


@pytest.mark.parametrize("layout,attention", [("padded", None), ("shared", "sdpa"), ("packed", "sdpa"),
                                              ("shared", "causal"), ("packed", "causal")])
def test_reference_values_come_back_to_the_host(model_path, meta_stand_ins, layout, attention):
    reference = ReferenceModel.from_pretrained(model_path, "float32", "meta", layout=layout, attention=attention,
                                               kernels="none")
    assert reference.device == META and reference.layout == layout
    pairs = _pairs()
    for laid in (None, reference.lay_out(pairs, 0, 256).pin_memory()):  # as the build lays out ahead on a GPU
        values = reference.score(pairs, 0, 256, laid=laid)
        tensors = [values.chosen_logps, values.rejected_logps, values.chosen_tokens, values.rejected_tokens,
                   *values.chosen_token_logps, *values.rejected_token_logps]
        assert {t.device.type for t in tensors} == {"cpu"}
        assert values.chosen_tokens.tolist() == [len(p.chosen_ids) for p in pairs]


@pytest.mark.parametrize("layout", ["shared", "padded"])
def test_service_values_come_back_to_the_host(model_path, meta_stand_ins, layout):
    """The padded fallback's scored positions come from the host: found on the device, they
    would fail on meta (no ``nonzero``) and make the host wait on a GPU."""
    from dpocache.service.reference_service import ReferenceService

    service = ReferenceService(ReferenceModel.from_pretrained(model_path, "float32", "meta", layout=layout,
                                                              attention="sdpa", kernels="none"))
    out = service.score([{"prompt_ids": [5, 6, 7], "completion_ids": [[8, 9], [10]]},
                         {"prompt_ids": [4, 5], "completion_ids": [[3]]}])
    assert [[(t.device.type, t.numel()) for t in row] for row in out] == [[("cpu", 2), ("cpu", 1)], [("cpu", 1)]]
