"""Tests for the reference service and dpocache.scoring.groups: the reference service's per-token values equal
a naive full forward of ``prompt + completion`` (the model's own logits, log-softmax, gather),
for groups of 1, 2 and 8 completions of mixed lengths; ``forward`` equals ``score``; the
look-aside cache answers a repeated sequence with no forward pass, and never across dtypes or
weights, also when the weights change in place under a running service; returned tensors are
the caller's own; calls from threads lose nothing; bad requests get one line naming the request
and the completion, and a pad id that is also the EOS or BOS is refused without a mask."""

from __future__ import annotations

import json
import os
import random

import pytest
import torch

from dpocache.cache import namespace_for_module
from dpocache.models.reference import ReferenceModel
from dpocache.models.tiny import build_model
from dpocache.scoring.groups import Group, collate_groups
from dpocache.scoring.shared import attention_mask
from dpocache.service.reference_service import ReferenceService, base_namespace

TOL = 1e-5


def make_requests(n: int, g: int, seed: int = 0, vocab: int = 500, prompt=(3, 24), completion=(1, 18)) -> list[dict]:
    """``n`` requests of ``g`` completions each, every length drawn at random."""
    rng = random.Random(seed)
    ids = lambda k: [rng.randrange(10, vocab) for _ in range(k)]  # noqa: E731
    return [{"prompt_ids": ids(rng.randint(*prompt)),
             "completion_ids": [ids(rng.randint(*completion)) for _ in range(g)]} for _ in range(n)]


@torch.no_grad()
def naive(model, prompt: list[int], completion: list[int], temperature: float = 1.0) -> torch.Tensor:
    """``(c,)`` log-probs of ``completion`` after ``prompt`` from the model's own full forward,
    its logits divided by ``temperature`` (as TRL's GRPO does)."""
    ids = torch.tensor([prompt + completion])
    logits = model(input_ids=ids, use_cache=False).logits[0].float() / temperature  # (p + c, V)
    logps = logits[len(prompt) - 1:-1].log_softmax(-1)  # (c, V): position t predicts token t + 1
    return logps.gather(-1, torch.tensor(completion)[:, None]).squeeze(-1)


def assert_matches_naive(model, requests, values, temperature: float = 1.0) -> None:
    assert len(values) == len(requests)
    for req, per_completion in zip(requests, values):
        assert len(per_completion) == len(req["completion_ids"])
        for comp, got in zip(req["completion_ids"], per_completion):
            assert got.dtype == torch.float32 and got.device.type == "cpu" and got.shape == (len(comp),)
            want = naive(model, req["prompt_ids"], comp, temperature)
            assert (got - want).abs().max().item() < TOL


@pytest.mark.parametrize("g", [1, 2, 8])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma2"])
def test_score_matches_naive_forward(tiny_models, arch, g):
    model = tiny_models[arch]
    requests = make_requests(5, g, seed=g)
    # A small budget: several batches, rows of different widths (padding), groups split in two.
    service = ReferenceService(model, max_tokens=96)
    assert service.reference.layout == "shared"
    values = service.score(requests)
    assert_matches_naive(model, requests, values)
    stats = service.stats()
    assert stats["forward_passes"] > 1
    assert stats["sequences"] == stats["forward_sequences"] == 5 * g


def test_gemma2_sliding_window_on_positions(tokenizer):
    """A window shorter than the sequences: within a group row the 8th completion sits far
    from the prompt, but its window must be counted on its own sequence's positions."""
    model = build_model("gemma2", tokenizer, sliding_window=6).eval()
    requests = make_requests(3, 8, seed=5, prompt=(8, 16), completion=(5, 12))
    assert_matches_naive(model, requests, ReferenceService(model).score(requests))


def test_group_mask_keeps_completions_apart():
    """Completion k sees the prompt and itself (causally), never another completion; padding
    is seen by nothing."""
    batch = collate_groups([Group(0, (5, 6, 7), ((1, 2), (3,), (4, 4, 4)), (0, 1, 2))])
    assert batch.segments.tolist() == [[0, 0, 0, 1, 1, 2, 3, 3, 3]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 4, 3, 3, 4, 5]]
    config = type("C", (), {"_attn_implementation": "sdpa"})()
    mask = attention_mask(batch, config)[0, 0]  # (T, T)
    assert mask[6].tolist() == [True, True, True, False, False, False, True, False, False]  # 3rd completion, 1st token
    assert mask[5].tolist() == [True, True, True, False, False, True, False, False, False]  # 2nd completion
    # Token j of a completion is predicted from the one before it in its own sequence.
    assert batch.source.tolist() == [2, 3, 2, 2, 6, 7]
    assert batch.labels.tolist() == [1, 2, 3, 4, 4, 4]


def test_padded_fallback_matches_naive(tiny_models):
    model = tiny_models["llama"]
    requests = make_requests(4, 3, seed=11)
    service = ReferenceService(model, layout="padded", max_tokens=80)
    assert service.reference.layout == "padded"
    assert_matches_naive(model, requests, service.score(requests))
    assert service.stats()["prompt_tokens_saved"] == 0


def test_packed_reference_runs_the_group_layout(tiny_models):
    model = tiny_models["llama"]
    requests = make_requests(4, 3, seed=11)
    service = ReferenceService(model, layout="packed", max_tokens=80)
    assert_matches_naive(model, requests, service.score(requests))
    assert service.stats()["prompt_tokens_saved"] > 0  # not the per-sequence fallback


def test_prompt_runs_once_per_group(tiny_models):
    model = tiny_models["qwen2"]
    requests = make_requests(2, 8, seed=3)
    service = ReferenceService(model)
    service.score(requests)
    s = service.stats()
    prompts = sum(len(r["prompt_ids"]) for r in requests)
    completions = sum(len(c) for r in requests for c in r["completion_ids"])
    assert s["forward_passes"] == 1  # both groups in one batch under the default budget
    assert s["tokens"] == prompts + completions
    assert s["prompt_tokens_saved"] == 7 * prompts
    assert s["sequence_tokens"] == 8 * prompts + completions
    assert s["avg_sequence_length"] == pytest.approx(s["sequence_tokens"] / 16)


def test_duplicates_run_once(tiny_models):
    """A completion asked twice (same prompt) in one call runs once and answers both."""
    model = tiny_models["llama"]
    req = make_requests(1, 3, seed=4)[0]
    req["completion_ids"].append(list(req["completion_ids"][0]))
    service = ReferenceService(model)
    values = service.score([req, {"prompt_ids": req["prompt_ids"], "completion_ids": [req["completion_ids"][1]]}])
    assert service.stats()["forward_sequences"] == 3
    assert service.stats()["duplicates"] == 2
    assert torch.equal(values[0][0], values[0][3]) and torch.equal(values[0][1], values[1][0])
    assert_matches_naive(model, [req], values[:1])


def test_forward_equals_score(tiny_models):
    """torchforge's entry: left-padded prompts, right-padded responses, 0 at padding."""
    model = tiny_models["gemma2"]
    pad, max_req, max_res = 0, 12, 10
    requests = make_requests(2, 3, seed=8, prompt=(3, max_req), completion=(1, max_res))
    rows = []
    for r in requests:
        for c in r["completion_ids"]:
            p = r["prompt_ids"]
            rows.append([pad] * (max_req - len(p)) + p + c + [pad] * (max_res - len(c)))
    input_ids = torch.tensor(rows)  # (6, 22)
    service = ReferenceService(model)
    out = service.forward(input_ids, max_req, pad)
    assert out.shape == (6, max_res) and out.dtype == torch.float32
    values = service.score(requests)
    expected = [v for per_request in values for v in per_request]
    for row, v in zip(out, expected):
        assert torch.allclose(row[:v.numel()], v, atol=TOL, rtol=0)
        assert (row[v.numel():] == 0).all()
    input_ids[4, max_req + 1] = 100_000  # a bad id is named by its row of the batch
    with pytest.raises(ValueError, match=r"^input_ids row 4: token id 100000 is outside"):
        service.forward(input_ids, max_req, pad)


def test_forward_with_pad_id_equal_to_eos_needs_the_mask(tiny_models):
    """A pad id that is also the EOS (GPT-2, Llama 3, Qwen) or the BOS cannot be told from a
    response's own EOS or a prompt's BOS: ``forward`` refuses it without an ``attention_mask``,
    and with one scores the EOS that ends a response and the BOS that starts a prompt."""
    model = tiny_models["llama"]
    bos, eos = model.config.bos_token_id, model.config.eos_token_id
    max_req, max_res = 8, 6
    prompts, responses = [[bos, 40, 41, 42], [bos, 60]], [[50, 51, eos], [70, eos], [71, 72, 73]]
    rows, mask, expected = [], [], []
    for p, c in [(prompts[0], responses[0]), (prompts[0], responses[1]), (prompts[1], responses[2])]:
        left, right = max_req - len(p), max_res - len(c)
        rows.append([eos] * left + p + c + [eos] * right)
        mask.append([0] * left + [1] * (len(p) + len(c)) + [0] * right)
        expected.append(naive(model, p, c))
    service = ReferenceService(model)
    for pad in (eos, bos):
        with pytest.raises(ValueError, match=rf"^pad_id {pad} is also the model's BOS or EOS id.*attention_mask"):
            service.forward(torch.tensor(rows), max_req, pad)
    out = service.forward(torch.tensor(rows), max_req, eos, attention_mask=torch.tensor(mask))
    for row, want in zip(out, expected):
        assert torch.allclose(row[:want.numel()], want, atol=TOL, rtol=0) and (row[want.numel():] == 0).all()
    holes = torch.tensor(mask)
    holes[0, max_req + 1] = 0  # a hole inside the response
    with pytest.raises(ValueError, match=r"^attention_mask row 0: the prompt must be left-padded"):
        service.forward(torch.tensor(rows), max_req, eos, attention_mask=holes)


def test_returned_values_are_the_callers_own(tiny_models, tmp_path):
    """Editing a returned tensor in place (masking an EOS) changes no later answer, whether the
    value was computed, a duplicate in the call, or read from the look-aside cache; and every
    returned tensor can enter a loss that is differentiated."""
    model = tiny_models["llama"]
    request = make_requests(1, 2, seed=30)
    request[0]["completion_ids"].append(list(request[0]["completion_ids"][0]))  # a duplicate
    service = ReferenceService(model, cache_dir=tmp_path)
    first = service.score(request)[0]
    want = naive(model, request[0]["prompt_ids"], request[0]["completion_ids"][0])
    first[0][-1] = 0.0  # the caller's edit
    assert torch.allclose(first[2], want, atol=TOL, rtol=0)  # the duplicate is its own tensor
    for _ in range(2):  # from memory, then from the disk in a new service
        again = service.score(request)[0]
        assert service.stats()["cache_hits"] > 0
        assert torch.allclose(again[0], want, atol=TOL, rtol=0)
        again[0].mul_(0)
        service = ReferenceService(model, cache_dir=tmp_path)
    weight = torch.ones(len(want), requires_grad=True)
    (first[1].sum() + (again[2] * weight).sum()).backward()  # neither is an inference tensor
    assert torch.equal(weight.grad, service.score(request)[0][2])


@pytest.mark.parametrize("how", ["load_state_dict", "data"])
def test_weights_changed_in_place_move_the_cache_namespace(tokenizer, tmp_path, how):
    """A service whose model is synced to other weights (``load_state_dict``, or a write through
    ``.data``, which bumps no version counter) answers with the new weights' values and files
    them under the new weights' namespace: the original model never reads them back."""
    model, other = (build_model("llama", tokenizer, seed=s).eval() for s in (0, 1))
    requests = make_requests(2, 2, seed=31)
    service = ReferenceService(model, cache_dir=tmp_path)
    service.score(requests)
    old_namespace = service.store.namespace.id
    if how == "load_state_dict":
        model.load_state_dict(other.state_dict())
    else:
        for mine, theirs in zip(model.parameters(), other.parameters()):
            mine.data.copy_(theirs.data)
    assert_matches_naive(other, requests, service.score(requests))
    assert service.stats()["cache_hits"] == 0
    assert service.store.namespace.id == namespace_for_module(other, torch.float32).id != old_namespace
    original = ReferenceService(build_model("llama", tokenizer, seed=0).eval(), cache_dir=tmp_path)
    assert_matches_naive(original.reference.model, requests, original.score(requests))
    assert original.stats()["cache_hits"] == 4  # its own values, from the first call


def test_an_edit_the_signature_misses_is_followed_once_told(tokenizer, tmp_path):
    """A write through ``.data`` to a few rows between the 16 sampled values per tensor is not
    seen by the per-call check (documented); ``weights_changed`` re-hashes the weights in full."""
    from dpocache.service.reference_service import weights_signature

    model = build_model("llama", tokenizer, seed=0).eval()
    requests = make_requests(2, 2, seed=32)
    service = ReferenceService(model, cache_dir=tmp_path)
    service.score(requests)
    head = model.lm_head.weight
    stride = max(1, head.numel() // 16)
    before = weights_signature(model)
    head.data.view(-1)[1:stride].add_(0.5)  # between the first two samples
    assert weights_signature(model) == before  # the limit the docstring states
    service.weights_changed()
    assert_matches_naive(model, requests, service.score(requests))
    assert service.stats()["cache_hits"] == 0


def test_calls_from_several_threads_lose_nothing(tiny_models, tmp_path):
    """Threads calling one service: every answer right, every computed value on disk."""
    from concurrent.futures import ThreadPoolExecutor

    model = tiny_models["llama"]
    batches = [make_requests(2, 3, seed=40 + i) for i in range(6)]
    service = ReferenceService(model, cache_dir=tmp_path, max_tokens=64)
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(service.score, batches))
    for requests, values in zip(batches, answers):
        assert_matches_naive(model, requests, values)
    again = ReferenceService(model, cache_dir=tmp_path)
    again.score([r for requests in batches for r in requests])
    assert again.stats()["forward_passes"] == 0 and again.stats()["cache_hits"] == 36


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_shard_name_on_a_non_file_is_skipped(tiny_models, tmp_path, kind):
    """A FIFO (which would block a read forever) or a directory under a shard's name is
    reported and left unread; the values are computed."""
    import os

    model = tiny_models["llama"]
    requests = make_requests(1, 2, seed=32)
    service = ReferenceService(model, cache_dir=tmp_path)
    service.store.dir.mkdir(parents=True)
    bad = service.store.dir / "seq-0123456789abcdef.safetensors"
    os.mkfifo(bad) if kind == "fifo" else bad.mkdir()
    assert_matches_naive(model, requests, service.score(requests))
    assert len(service.store.corrupt) == 1 and "not a regular file" in service.store.corrupt[0]


BAD_OPTIONS = [  # (field, value, the line's start): each refused in one line naming the field
    ("max_tokens", 0, "max_tokens must be a whole number of at least 1 (None: the device's budget); got 0"),
    ("max_tokens", -5, "max_tokens must be a whole number of at least 1"),
    ("max_tokens", "4096", "max_tokens must be a whole number of at least 1 (None: the device's budget); got '4096'"),
    ("max_tokens", 2.5, "max_tokens must be a whole number"),
    ("cache_memory_bytes", -1, "cache_memory_bytes must be a whole number of at least 0; got -1"),
    ("temperature", "0.7", "temperature must be a finite number above 0 (the rollouts' sampling temperature; None: "
                           "1); got '0.7'"),
    ("temperature", float("nan"), "temperature must be a finite number above 0"),
    ("temperature", True, "temperature must be a finite number above 0"),
    ("layout", "grouped", "layout must be one of auto, padded, shared, packed; got 'grouped'"),
    ("compile", "yes", "compile must be True or False; got 'yes'"),
    ("stream", 1, "stream must be True or False; got 1"),
]


@pytest.mark.parametrize("field,value,line", BAD_OPTIONS, ids=[f"{f}={v!r}" for f, v, _ in BAD_OPTIONS])
def test_each_bad_option_is_one_line_naming_it(tiny_models, model_dir, field, value, line):
    """As keyword arguments of the constructor and of ``from_pretrained``, and as a
    ``ServiceOptions``: refused before any model loads (``from_pretrained`` is not reached)."""
    from dpocache.service import ServiceOptions

    for make in (lambda: ReferenceService(tiny_models["llama"], **{field: value}),
                 lambda: ReferenceService.from_pretrained(model_dir / "missing", **{field: value}),
                 lambda: ServiceOptions(**{field: value})):
        with pytest.raises(ValueError) as raised:
            make()
        assert str(raised.value).startswith(line) and "\n" not in str(raised.value)


def test_loading_arguments_and_the_cache_dir_are_one_line_before_the_model_loads(model_dir, tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("")
    for kwargs, line in ((dict(dtype="fp32"), "dtype must be one of auto, float32, bfloat16, float16 (or a "
                                              "torch.dtype); got 'fp32'"),
                         (dict(reference="policy"), "reference must be one of initial, base; got 'policy'"),
                         (dict(cache_dir=afile / "sub"), f"cache_dir {afile / 'sub'}: cannot write there")):
        with pytest.raises(ValueError) as raised:
            ReferenceService.from_pretrained(model_dir, **kwargs)
        assert str(raised.value).startswith(line), raised.value


def test_cache_second_pass_runs_nothing(tiny_models, tmp_path):
    model = tiny_models["llama"]
    requests = make_requests(3, 4, seed=9)
    first = ReferenceService(model, cache_dir=tmp_path)
    v1 = first.score(requests)
    assert first.stats()["forward_passes"] >= 1 and first.stats()["cache_hits"] == 0
    v2 = first.score(requests)
    s = first.stats()
    assert s["cache_hits"] == 12 and s["forward_sequences"] == 12  # none re-run
    assert all(torch.equal(a, b) for x, y in zip(v1, v2) for a, b in zip(x, y))
    # A new service (a new process, a later run) reads the values from the disk.
    again = ReferenceService(model, cache_dir=tmp_path)
    v3 = again.score(requests)
    assert again.stats()["forward_passes"] == 0 and again.stats()["cache_hits"] == 12
    assert all(torch.equal(a, b) for x, y in zip(v1, v3) for a, b in zip(x, y))
    # A new completion of a cached prompt: only it runs.
    requests[0]["completion_ids"].append([11, 12, 13])
    again.score(requests)
    assert again.stats()["forward_sequences"] == 1


def test_cache_memory_stays_bounded_and_evicted_values_come_back(tiny_models, tmp_path):
    """A budget of one call's values: each later call drops the earlier calls' shards from
    memory, and asking for their sequences again reads them from disk, unchanged, with no
    forward pass."""
    model = tiny_models["llama"]
    calls = [make_requests(3, 4, seed=40 + i) for i in range(4)]
    service = ReferenceService(model, cache_dir=tmp_path, cache_memory_bytes=1)
    first = [service.score(requests) for requests in calls]
    largest_call = max(sum(v.numel() for per in values for v in per) for values in first) * 4
    assert 0 < service.store.held_bytes <= largest_call  # one shard held, not four
    assert len(service.store) == 4 * 12
    passes = service.stats()["forward_passes"]
    again = [service.score(requests) for requests in calls]
    s = service.stats()
    assert s["forward_passes"] == passes and s["cache_hits"] == 4 * 12
    assert all(torch.equal(a, b) for x, y in zip(first, again) for p, q in zip(x, y) for a, b in zip(p, q))
    assert service.store.held_bytes <= largest_call


def test_evicted_shard_removed_from_disk_is_recomputed(tiny_models, tmp_path):
    """A shard dropped from memory and then deleted (a cleaned cache directory) is a miss: the
    sequences run again, nothing fails."""
    model = tiny_models["llama"]
    old, new = make_requests(2, 2, seed=50), make_requests(2, 2, seed=51)
    service = ReferenceService(model, cache_dir=tmp_path, cache_memory_bytes=1)
    service.score(old)
    (old_shard,) = service.store.dir.glob("seq-*.safetensors")
    service.score(new)  # drops the first shard from memory
    old_shard.unlink()
    assert_matches_naive(model, old, service.score(old))
    assert service.stats()["forward_sequences"] == 4 + 4 + 4


def test_interrupted_call_keeps_what_it_computed(tiny_models, tmp_path):
    """Ctrl-C in the second forward of a call: the first batch's values are on disk."""
    model = tiny_models["llama"]
    requests = make_requests(4, 2, seed=15)
    service = ReferenceService(model, cache_dir=tmp_path, max_tokens=40)  # several batches
    run, calls = service.reference.shared_prompt_logprobs, []

    def interrupted(batch):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return run(batch)

    service.reference.shared_prompt_logprobs = interrupted
    with pytest.raises(KeyboardInterrupt):
        service.score(requests)
    again = ReferenceService(model, cache_dir=tmp_path, max_tokens=40)
    assert_matches_naive(model, requests, again.score(requests))
    assert 0 < again.stats()["cache_hits"] < 8


def test_corrupt_cache_shard_is_never_used(tiny_models, tmp_path):
    """A shard whose bytes no longer match its name is reported and skipped: recomputed."""
    model = tiny_models["llama"]
    requests = make_requests(2, 2, seed=16)
    first = ReferenceService(model, cache_dir=tmp_path)
    first.score(requests)
    (shard,) = first.store.dir.glob("seq-*.safetensors")
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF  # a value's last byte
    shard.write_bytes(bytes(data))
    again = ReferenceService(model, cache_dir=tmp_path)
    assert_matches_naive(model, requests, again.score(requests))
    assert again.stats()["cache_hits"] == 0 and len(again.store.corrupt) == 1


def test_cache_never_hits_across_dtype_or_weights(tiny_models, tokenizer, tmp_path):
    model = tiny_models["llama"]
    requests = make_requests(2, 2, seed=10)
    ReferenceService(model, cache_dir=tmp_path).score(requests)
    bf16 = ReferenceService(model, dtype=torch.bfloat16, cache_dir=tmp_path)
    bf16.score(requests)
    assert bf16.stats()["cache_hits"] == 0 and bf16.stats()["forward_sequences"] == 4
    other = ReferenceService(build_model("llama", tokenizer, seed=1).eval(), cache_dir=tmp_path)
    other.score(requests)
    assert other.stats()["cache_hits"] == 0 and other.stats()["forward_sequences"] == 4


def test_from_pretrained_cache_and_stats_file(model_dir, tmp_path):
    requests = make_requests(2, 3, seed=12)
    stats_file = tmp_path / "stats.jsonl"
    service = ReferenceService.from_pretrained(model_dir, dtype="float32", device="cpu", cache_dir=tmp_path / "c",
                                               stats_file=stats_file)
    service.score(requests)
    again = ReferenceService.from_pretrained(model_dir, dtype="float32", device="cpu", cache_dir=tmp_path / "c")
    again.score(requests)
    assert again.stats()["forward_passes"] == 0 and again.stats()["cache_hits"] == 6
    lines = [json.loads(x) for x in stats_file.read_text().splitlines()]
    assert len(lines) == 1 and lines[0]["forward_sequences"] == 6 and lines[0]["calls"] == 1


def test_peft_policy_adapter_off(tiny_models, tokenizer, tmp_path):
    """The reference of a LoRA policy is its base: the adapter (non-zero here) does not change
    the values, and the cache namespace is that of the base weights alone."""
    from peft import LoraConfig, get_peft_model

    base = build_model("llama", tokenizer, seed=0).eval()
    lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)  # a non-zero adapter
    policy = get_peft_model(build_model("llama", tokenizer, seed=0), lora)
    policy.train()
    requests = make_requests(2, 2, seed=13)
    service = ReferenceService.from_peft_policy(policy, cache_dir=tmp_path)
    assert_matches_naive(base, requests, service.score(requests))
    assert service.store.namespace.id == namespace_for_module(base, torch.float32).id
    assert base_namespace(policy, torch.float32).id == service.store.namespace.id
    assert policy.training  # left as it was


@pytest.mark.parametrize("mutate, message", [
    (lambda rs: rs[1].update(prompt_ids=[]), "request 1: empty prompt"),
    (lambda rs: rs[0]["completion_ids"].__setitem__(2, []), "request 0, completion 2: empty completion"),
    (lambda rs: rs[1]["completion_ids"][1].append(100_000), "request 1, completion 1: token id 100000 is outside"),
    (lambda rs: rs[0]["prompt_ids"].append(-1), "request 0: prompt token id -1 is outside"),
    (lambda rs: rs[1]["completion_ids"][0].extend([20] * 600), "request 1, completion 0: prompt + completion is"),
    (lambda rs: rs[0].pop("completion_ids"), "request 0: no 'completion_ids' (it has 'prompt_ids'); expected "
                                             "{'prompt_ids': [...], 'completion_ids': [[...], ...]}"),
    (lambda rs: rs[1].update(prompt=rs[1].pop("prompt_ids")), "request 1: no 'prompt_ids' (it has "
                                                              "'completion_ids', 'prompt'); expected"),
    (lambda rs: rs.__setitem__(1, [1, 2]), "request 1: expected {'prompt_ids': [...], 'completion_ids': [[...], "
                                           "...]}, got list"),
    (lambda rs: rs[0].update(prompt_ids=torch.tensor([rs[0]["prompt_ids"]])),
     "request 0: prompt must be a 1-D tensor or list of token ids, got a 2-D Tensor of shape (1, "),
    (lambda rs: rs[1]["completion_ids"].__setitem__(0, [rs[1]["completion_ids"][0]]),
     "request 1, completion 0: completion must be one flat list of token ids (ints), got a list of lists"),
    (lambda rs: rs[0]["prompt_ids"].append(2.0), "request 0: prompt must be a list of token ids (ints), got a float"),
    (lambda rs: rs[1]["completion_ids"][0].append(True), "request 1, completion 0: completion must be a list of "
                                                          "token ids (ints), got a bool"),
    (lambda rs: rs[1].update(prompt_ids="12 13"), "request 1: prompt must be a list of token ids (ints), got str"),
])
def test_bad_requests_get_one_line(tiny_models, mutate, message):
    service = ReferenceService(tiny_models["llama"])
    requests = make_requests(2, 3, seed=14)
    mutate(requests)
    with pytest.raises(ValueError) as err:
        service.score(requests)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)
    assert service.stats()["forward_passes"] == 0  # checked before anything runs


def test_a_request_alone_or_a_list_for_a_tensor_is_named_as_such(tiny_models):
    """One request not in a list was read as the list of its keys ("request 0: expected {...}");
    ``forward`` given a list raised "'list' object has no attribute 'dim'"."""
    service = ReferenceService(tiny_models["llama"])
    (request,) = make_requests(1, 2, seed=16)
    with pytest.raises(TypeError, match=r"^score takes a list of requests; got one request \(a dict\): pass "
                                        r"\[request\]$"):
        service.score(request)
    with pytest.raises(TypeError, match=r"^score takes a list of requests, each \{'prompt_ids': \[...\], "
                                        r"'completion_ids': \[\[...\], ...\]\}; got NoneType$"):
        service.score(None)
    with pytest.raises(TypeError, match="^input_ids must be a \\(G, T\\) tensor of token ids; got list$"):
        service.forward([[1, 5, 6, 7, 8, 9]], 4, 0)
    assert service.stats()["forward_passes"] == 0
    assert len(service.score(iter([request]))) == 1  # any iterable of requests, a generator too


def test_a_closed_service_refuses_calls_in_one_line_and_still_counts(tokenizer):
    """``close`` (and leaving a ``with`` block) lets the model go; a later call is one line, not
    an AttributeError from deep inside, and the counters stay readable."""
    import weakref

    requests = make_requests(2, 2, seed=17)
    with ReferenceService(build_model("llama", tokenizer, seed=0)) as service:
        service.score(requests)
        model = weakref.ref(service.reference.model)
    assert model() is None  # nothing holds the model once closed
    for call in (lambda: service.score(requests), lambda: service.forward(torch.ones(1, 4, dtype=torch.long), 2, 0),
                 service.weights_changed):
        with pytest.raises(RuntimeError, match=r"^this ReferenceService was closed; start a new one$"):
            call()
    assert service.stats()["requests"] == 2
    service.close()  # twice: nothing


def test_numpy_token_ids_are_token_ids(tiny_models):
    """A rollout's ids often come as numpy arrays or numpy ints; they were refused."""
    import numpy as np

    model = tiny_models["llama"]
    requests = make_requests(2, 3, seed=15)
    as_numpy = [{"prompt_ids": np.array(r["prompt_ids"]),
                 "completion_ids": [[np.int64(t) for t in c] for c in r["completion_ids"]]} for r in requests]
    values = ReferenceService(model).score(as_numpy)
    assert_matches_naive(model, requests, values)


# ------------------------------------------------------------------------------- dpocache score


def _score_cli(args, capsys):
    from dpocache.cli.entry import main

    code = main(["score", *map(str, args)])
    return code, capsys.readouterr()


def test_score_cli_text_ids_and_resume(model_dir, tokenizer, tmp_path, capsys):
    """Text rows are tokenized as ``cache build`` does (what the tokenizer puts before a plain
    prompt, EOS after each completion): the same ids given as ids score the same. A second run
    computes nothing."""
    from dpocache.data.pairs import special_prefix
    from dpocache.data.rows import write_jsonl

    prompt, completions = "sort: 3 1 2", [" 1 2 3", " 3 2 1", " 2"]
    ids = {"prompt_ids": special_prefix(tokenizer) + tokenizer(prompt, add_special_tokens=False)["input_ids"],
           "completion_ids": [tokenizer(c, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
                              for c in completions]}
    messages = {"prompt": [{"role": "user", "content": "sort: 5 4"}],
                "completions": [[{"role": "assistant", "content": "4 5"}], [{"role": "assistant", "content": "5"}]]}
    data = write_jsonl([{"prompt": prompt, "completions": completions}, ids, messages], tmp_path / "rows.jsonl")
    out, stats = tmp_path / "out" / "logps.jsonl", tmp_path / "stats.jsonl"
    args = ["--model", model_dir, "--data", data, "--out", out, "--cache-dir", tmp_path / "cache",
            "--dtype", "float32", "--device", "cpu", "--stats", stats]
    code, _ = _score_cli(args, capsys)
    assert code == 0
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["index"] for r in rows] == [0, 1, 2]
    assert rows[0]["token_logps"] == rows[1]["token_logps"]
    assert rows[0]["tokens"] == [len(c) for c in ids["completion_ids"]]
    assert rows[2]["tokens"][0] > 2  # the template's end-of-turn marker is part of the completion
    expected = ReferenceService.from_pretrained(model_dir, dtype="float32", device="cpu").score([ids])[0]
    for got, want in zip(rows[0]["token_logps"], expected):
        assert max(abs(a - b) for a, b in zip(got, want.tolist())) < TOL
    assert rows[0]["logps"][0] == pytest.approx(sum(rows[0]["token_logps"][0]), abs=1e-5)
    first = out.read_text()
    code, printed = _score_cli(args, capsys)
    assert code == 0 and out.read_text() == first
    runs = [json.loads(x) for x in stats.read_text().splitlines()]
    assert runs[0]["forward_sequences"] == 5 and runs[0]["duplicates"] == 3  # rows 0 and 1 are the same ids
    assert runs[-1]["forward_passes"] == 0 and runs[-1]["cache_hits"] == 8  # every sequence of the 3 rows
    assert "0 computed" in printed.out


def test_score_cli_stopped_by_a_signal_says_what_it_kept_and_continues(model_dir, tmp_path, capsys, monkeypatch):
    """Ctrl-C in the second of three chunks: "stopped by SIGINT" said nothing of what was kept.
    The line counts the rows scored, names the cache, and the same command continues: the first
    chunk's sequences come from the cache."""
    import signal

    from dpocache.data.rows import write_jsonl

    rows = [{"prompt_ids": [5, 6, 7 + i], "completion_ids": [[8, 9], [10 + i]]} for i in range(3)]
    data, out, cache = write_jsonl(rows, tmp_path / "rows.jsonl"), tmp_path / "o.jsonl", tmp_path / "cache"
    args = ["--model", model_dir, "--data", data, "--out", out, "--cache-dir", cache, "--dtype", "float32",
            "--device", "cpu", "--chunk-rows", "1"]
    score, calls = ReferenceService.score, []

    def interrupted_second(self, requests):
        calls.append(len(requests))
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGINT)
        return score(self, requests)

    with monkeypatch.context() as m:
        m.setattr(ReferenceService, "score", interrupted_second)
        code, printed = _score_cli(args, capsys)
    assert code == 130 and not out.exists()
    assert printed.err.strip().splitlines()[-1] == (
        f"dpocache: stopped by SIGINT: 1 of 3 rows were scored before it; every value computed is in the look-aside "
        f"cache ({cache}), and the same command continues from them")
    code, printed = _score_cli(args, capsys)
    assert code == 0 and "(2 from the cache" in printed.out and len(out.read_text().splitlines()) == 3


@pytest.mark.parametrize("row, message", [
    # a row of ids is named by its own fields (it was 'completions[1]', and 'prompt_ids' for an empty list)
    ({"prompt_ids": [1, 2], "completion_ids": [[3], [4, 100_000]]},
     "rows.jsonl:2: field 'completion_ids[1]': token id 100000 is outside"),
    ({"prompt_ids": [1, 2], "completion_ids": []},
     "rows.jsonl:2: field 'completion_ids': completion_ids must be a non-empty list"),
    ({"prompt_ids": [], "completion_ids": [[3]]}, "rows.jsonl:2: field 'prompt_ids': empty prompt"),
    # ids and text in one row: the ids were scored without a word
    ({"prompt_ids": [1, 2], "completion_ids": [[3]], "prompt": "x", "completions": ["y"]},
     "rows.jsonl:2: both token ids (prompt_ids, completion_ids) and text (prompt, completions): give one or the "
     "other"),
    ({"prompt": "sort: 1", "completions": []}, "rows.jsonl:2: field 'completions': expected a non-empty list"),
    # a DPO file given to score: its columns named, not "expected a non-empty list"
    ({"prompt": "sort: 1", "chosen": " 1", "rejected": " 2"}, "rows.jsonl:2: field 'completions': missing; the row "
     "has prompt, chosen, rejected (a preference pair: give its chosen and rejected as completions: [...])"),
    ({"prompt": "sort: 1", "completions": [" 1", ""]}, "rows.jsonl:2: field 'completions[1]': empty string"),
])
def test_score_cli_bad_row_one_line(model_dir, tmp_path, capsys, row, message):
    from dpocache.data.rows import write_jsonl

    data = write_jsonl([{"prompt_ids": [1, 2], "completion_ids": [[3]]}, row], tmp_path / "rows.jsonl")
    code, printed = _score_cli(["--model", model_dir, "--data", data, "--out", tmp_path / "o.jsonl",
                                "--cache-dir", tmp_path / "c", "--device", "cpu"], capsys)
    assert code == 2 and printed.err.startswith("dpocache score: error: ")  # as every command's errors
    assert printed.err.count("\n") == 1 and message in printed.err and "Traceback" not in printed.err
    assert not (tmp_path / "o.jsonl").exists()


def test_score_cli_bad_token_budget_one_line(model_dir, tmp_path, capsys):
    from dpocache.data.rows import write_jsonl

    data = write_jsonl([{"prompt_ids": [1, 2], "completion_ids": [[3]]}], tmp_path / "rows.jsonl")
    code, printed = _score_cli(["--model", model_dir, "--data", data, "--out", tmp_path / "o.jsonl",
                                "--max-tokens", -5], capsys)
    assert code == 2 and printed.err.count("\n") == 1 and "--max-tokens" in printed.err
    assert not (tmp_path / "o.jsonl").exists()


def test_score_cli_missing_model_one_line(tmp_path, capsys):
    from dpocache.data.rows import write_jsonl

    data = write_jsonl([{"prompt_ids": [1, 2], "completion_ids": [[3]]}], tmp_path / "rows.jsonl")
    code, printed = _score_cli(["--model", tmp_path / "nope", "--data", data, "--out", tmp_path / "o.jsonl"], capsys)
    assert code == 2 and printed.err.count("\n") == 1
    assert "--model" in printed.err and "not a model directory" in printed.err


def test_pool_without_ray_says_how_to_install(monkeypatch, model_dir):
    """The package and the service work without Ray; the pool names the extra to install."""
    import sys

    from dpocache.service.pool import ReferencePool

    monkeypatch.setitem(sys.modules, "ray", None)  # as if not installed
    with pytest.raises(ImportError, match=r"pip install 'dpocache\[ray\]'"):
        ReferencePool(model_dir, num_replicas=2)


def test_default_budget_keeps_a_wide_group_in_one_row(tiny_models):
    """A group shares its prompt only within one row of the budget: the service's default on a
    CPU is not the offline pass's 1024, which would split this 1,100-token group in two and run
    its prompt twice."""
    from dpocache.cache.build import CPU_MAX_TOKENS
    from dpocache.service.reference_service import GROUP_MAX_TOKENS

    prompt, completions = 400, 7
    request = make_requests(1, completions, seed=3, prompt=(prompt, prompt), completion=(100, 100))
    assert CPU_MAX_TOKENS < prompt + 100 * completions <= GROUP_MAX_TOKENS
    service = ReferenceService(tiny_models["llama"])
    values = service.score(request)
    assert service.stats()["prompt_tokens_saved"] == prompt * (completions - 1)  # the prompt ran once
    for c, v in zip(request[0]["completion_ids"], values[0]):  # values equal the model's own forward
        assert torch.allclose(v, naive(tiny_models["llama"], request[0]["prompt_ids"], c), atol=TOL, rtol=0)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_window_on_every_layer_without_layer_types(tokenizer, attention):
    """Mistral, Mixtral, Phi-3 and Starcoder2 configs have a ``sliding_window`` and no
    ``layer_types``: every layer slides. The group row's block mask ignored the window there,
    so a sequence longer than it got full-attention values (0.33 off on this Mixtral)."""
    from dpocache.scoring.groups import Group, collate_groups
    from dpocache.scoring.shared import PAD, flex_block_masks

    model = build_model("mixtral", tokenizer, sliding_window=5).eval()
    model.set_attn_implementation(attention)
    requests = make_requests(3, 4, seed=60, prompt=(6, 12), completion=(4, 10))
    assert_matches_naive(model, requests, ReferenceService(model).score(requests))
    # FlexAttention's rule is the dense mask's, window included (evaluated element by element).
    batch = collate_groups([Group(0, tuple(range(9, 20)), ((1,), (2, 3, 4, 5, 6, 7, 8)), (0, 1))])
    t = batch.input_ids.shape[1]
    q, k = torch.arange(t)[None, :, None], torch.arange(t)[None, None, :]
    flex = flex_block_masks(batch, model.config).mask_mod(torch.zeros(1, 1, 1, dtype=torch.long), None, q, k)
    dense = attention_mask(batch, type("C", (), {"_attn_implementation": "sdpa", "sliding_window": 5})())[:, 0]
    real = batch.segments != PAD
    assert torch.equal(flex.expand(1, t, t)[real], dense[real]) and not dense[0, -1, :11].any()


@pytest.mark.parametrize("layout", ["shared", "padded"])
@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_temperature_divides_the_logits_before_the_log_softmax(tiny_models, arch, layout, tmp_path):
    """GRPO and PPO trainers (TRL, verl, OpenRLHF) divide the policy's and the reference's logits
    by the sampling temperature: without it the reference's values were the model's own, and the
    KL against a policy equal to the reference was not 0. Gemma 2: after its soft-capping."""
    model = tiny_models[arch]
    requests = make_requests(4, 3, seed=31)
    hot = ReferenceService(model, max_tokens=96, layout=layout, temperature=0.7, cache_dir=tmp_path)
    assert_matches_naive(model, requests, hot.score(requests), temperature=0.7)
    assert hot.stats()["cache_hits"] == 0
    # The same weights at temperature 1 are another namespace: none of those values is served.
    plain = ReferenceService(model, max_tokens=96, layout=layout, cache_dir=tmp_path)
    assert plain.store.namespace.id != hot.store.namespace.id
    assert_matches_naive(model, requests, plain.score(requests))
    assert plain.stats()["cache_hits"] == 0
    again = ReferenceService(model, max_tokens=96, layout=layout, temperature=0.7, cache_dir=tmp_path)
    assert_matches_naive(model, requests, again.score(requests), temperature=0.7)
    assert again.stats()["cache_hits"] == sum(len(r["completion_ids"]) for r in requests)


def test_temperature_in_the_full_forward_fallback(tiny_models):
    """A model whose head the fast path cannot reproduce runs its own forward: the temperature
    applies there too."""
    from dpocache.scoring.logprobs import CompletionLogProbs

    model = tiny_models["llama"]
    scorer = CompletionLogProbs(model, temperature=0.5)
    assert scorer.fast_path  # the probe compares the fast head with the forward at the same temperature
    scorer.fast_path = False
    request = make_requests(1, 1, seed=32)[0]
    prompt, comp = request["prompt_ids"], request["completion_ids"][0]
    ids = torch.tensor([prompt + comp])
    completion_mask = torch.zeros_like(ids)
    completion_mask[0, len(prompt):] = 1
    with torch.no_grad():
        got = scorer(ids, torch.ones_like(ids), completion_mask)[0, len(prompt):]
    assert (got - naive(model, prompt, comp, temperature=0.5)).abs().max().item() < TOL
    with pytest.raises(ValueError, match="temperature must be a finite number above 0"):
        ReferenceService(model, temperature=0)
    # A ReferenceModel brings its own temperature; asking the service for another is refused.
    hot = ReferenceModel(model, temperature=0.5)
    assert_matches_naive(model, [request], ReferenceService(hot).score([request]), temperature=0.5)
    with pytest.raises(ValueError, match="divides its logits by 0.5"):
        ReferenceService(hot, temperature=1.0)


def test_construction_mistakes_are_one_clear_error(tiny_models, tokenizer, tmp_path):
    """A missing model directory was transformers' traceback (and, for a pool, every replica's
    after Ray started); a dtype given as a string, as from_pretrained takes it, a TypeError from
    inside autocast; a ReferenceModel on the causal backend an AttributeError at the first call."""
    from dpocache.runtime.preflight import UsageError

    with pytest.raises(UsageError, match=f"path {tmp_path / 'nowhere'}: no such directory"):
        ReferenceService.from_pretrained(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UsageError, match="no config.json"):
        ReferenceService.from_pretrained(tmp_path / "empty")
    model = tiny_models["llama"]
    requests = make_requests(2, 2, seed=33)
    service = ReferenceService(model, dtype="float32")
    assert service.reference.dtype == torch.float32
    assert_matches_naive(model, requests, service.score(requests))
    causal = ReferenceModel(build_model("llama", tokenizer).eval(), layout="shared", attention="causal")
    assert causal.layout_choice.attention == "dpocache_causal"
    with pytest.raises(ValueError, match="attention='sdpa'"):
        ReferenceService(causal)


def test_the_look_aside_cache_removes_temp_files_of_killed_writes(tiny_models, tmp_path):
    import os

    from dpocache.cache.store import STALE_TEMP_SECONDS

    model = tiny_models["llama"]
    requests = make_requests(2, 2, seed=34)
    service = ReferenceService(model, cache_dir=tmp_path)
    service.score(requests)
    seq_dir = service.store.dir
    stale = seq_dir / ".seq-0123456789abcdef.safetensors.0123456789ab.tmp"
    stale.write_bytes(b"torn")
    old = os.stat(stale).st_mtime - STALE_TEMP_SECONDS - 60
    os.utime(stale, (old, old))
    fresh = seq_dir / ".seq-fedcba9876543210.safetensors.ba9876543210.tmp"
    fresh.write_bytes(b"a write in progress")
    again = ReferenceService(model, cache_dir=tmp_path)
    assert not stale.exists() and fresh.exists()
    assert_matches_naive(model, requests, again.score(requests))
    assert again.stats()["cache_hits"] == 4
