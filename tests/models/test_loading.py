"""A frozen bf16 reference stored in bf16 (dpocache.models.loading): the same values, bit for bit, as
the fp32-stored reference under bf16 autocast, in about half the parameter memory."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dpocache.cache import CacheStore, namespace_for_dir
from dpocache.cache.build import reference_batches, score_batch
from dpocache.data.pairs import load_preference_data
from dpocache.models.loading import load_causal_lm, load_tokenizer, parameter_bytes, store_frozen_matrices_
from dpocache.models.reference import ReferenceModel
from dpocache.models.tiny import save_tiny_model
from dpocache.scoring.logprobs import CompletionLogProbs

MODELS = {
    "llama": ("llama", {}),
    # Tied embeddings: lm_head is the embedding table, which must stay fp32.
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "gpt2": ("gpt2", {}),  # tied, and its matrices are Conv1D, not nn.Linear
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("loading")
    return {name: save_tiny_model(root / name, arch, seed=3, **kw) for name, (arch, kw) in MODELS.items()}


def _all_values(reference: ReferenceModel, pairs, pad_id: int) -> list[torch.Tensor]:
    out = []
    for batch in reference_batches(reference, pairs, max_tokens=512):
        v = score_batch(reference, batch, pad_id)
        out += [v.chosen_logps, v.rejected_logps, *v.chosen_token_logps, *v.rejected_token_logps]
    return out


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("layout", ["shared", "padded"])
def test_bf16_stored_reference_is_bit_identical_and_half_the_bytes(saved, name, layout, pref_jsonl, monkeypatch):
    # The native bf16 kernels (CUDA, AMX CPUs): where the fp32-GEMM route is not taken.
    monkeypatch.setenv("DPOCACHE_BF16_MATMUL", "native")
    model_dir = saved[name]
    tokenizer = load_tokenizer(model_dir)
    pairs = load_preference_data(str(pref_jsonl), tokenizer, max_length=96, show_progress=False).pairs[:24]
    pad = tokenizer.pad_token_id or 0

    stored = ReferenceModel.from_pretrained(model_dir, "bfloat16", "cpu", layout=layout)
    # Today's reference, independently: fp32 storage, bf16 by autocast alone.
    fp32_stored = ReferenceModel(load_causal_lm(model_dir), torch.bfloat16, layout=layout)
    assert stored.layout == fp32_stored.layout == layout
    got, want = _all_values(stored, pairs, pad), _all_values(fp32_stored, pairs, pad)
    assert len(got) == len(want) > 24
    assert all(torch.equal(a, b) for a, b in zip(got, want))

    lm = stored.model
    dtypes = {p.dtype for p in lm.parameters()}
    assert dtypes == {torch.bfloat16, torch.float32}
    for module in lm.modules():
        if isinstance(module, nn.Embedding) or "Norm" in type(module).__name__:
            assert all(p.dtype == torch.float32 for p in module.parameters(recurse=False)), type(module).__name__
    head = lm.get_output_embeddings().weight
    tied = head is lm.get_input_embeddings().weight
    assert tied == (name != "llama") and head.dtype == (torch.float32 if tied else torch.bfloat16)
    # Every matrix is half its fp32 size: the bytes drop by 2 per matrix element.
    before, after = parameter_bytes(fp32_stored.model), parameter_bytes(lm)
    matrices = sum(p.numel() for p in lm.parameters() if p.dtype == torch.bfloat16)
    assert after == before - 2 * matrices
    assert after < 0.7 * before  # tiny models: the embedding table is a large share of them


def test_fp32_gemm_route_keeps_fp32_storage_and_float32_is_untouched(saved, monkeypatch):
    monkeypatch.setenv("DPOCACHE_BF16_MATMUL", "fp32-gemm")
    routed = ReferenceModel.from_pretrained(saved["llama"], "bfloat16", "cpu")
    assert {p.dtype for p in routed.model.parameters()} == {torch.float32}
    monkeypatch.setenv("DPOCACHE_BF16_MATMUL", "native")
    plain = ReferenceModel.from_pretrained(saved["llama"], "float32", "cpu")
    assert {p.dtype for p in plain.model.parameters()} == {torch.float32}


def test_the_namespace_does_not_depend_on_the_storage(saved, tmp_path, monkeypatch):
    monkeypatch.setenv("DPOCACHE_BF16_MATMUL", "native")
    ns = namespace_for_dir(saved["llama"], torch.bfloat16, tmp_path)
    ReferenceModel.from_pretrained(saved["llama"], "bfloat16", "cpu")  # reads the same directory
    assert namespace_for_dir(saved["llama"], torch.bfloat16, tmp_path).id == ns.id
    assert CacheStore(tmp_path, ns).namespace.dtype == "bfloat16"


def test_meta_loaded_policy_has_fp32_masters_bf16_gathers_and_per_layer_checkpointing(saved, world_of_one,
                                                                                        monkeypatch):
    """``train --fsdp``'s policy (dpocache.models.policy.load_sharded_policy): created on the meta
    device and filled from the files (the weights are the checkpoint's), fp32 sharded master
    weights and gradients, layers gathered in bf16 for compute (FSDP2 MixedPrecisionPolicy),
    activation checkpointing per decoder layer."""
    from torch.distributed.tensor import DTensor

    from dpocache.config import Config
    from dpocache.distributed.fsdp import decoder_layers
    from dpocache.models.policy import load_sharded_policy

    monkeypatch.setenv("DPOCACHE_BF16_MATMUL", "native")
    cfg = Config()
    cfg.model.path, cfg.model.gradient_checkpointing = str(saved["llama"]), True
    policy, scorer = load_sharded_policy(cfg, world_of_one, torch.bfloat16)
    full = load_causal_lm(saved["llama"])
    for (name, p), (name_full, q) in zip(policy.named_parameters(), full.named_parameters(), strict=True):
        assert name == name_full and isinstance(p, DTensor) and p.dtype == torch.float32 and p.requires_grad
        assert torch.equal(p.full_tensor(), q), name
    assert all(layer.gradient_checkpointing for layer in decoder_layers(policy))

    seen = []
    proj = decoder_layers(policy)[0].self_attn.q_proj
    proj.register_forward_pre_hook(lambda module, args: seen.append(module.weight.dtype))
    ids = torch.randint(3, 400, (2, 12))
    mask = torch.zeros_like(ids)
    mask[:, 6:] = 1
    logps = scorer(ids, torch.ones_like(ids), mask)  # (2, 12)
    logps.sum().backward()
    assert torch.bfloat16 in seen  # gathered in bf16 (a second time when the checkpoint recomputes)
    assert torch.isfinite(logps).all() and logps[:, 7:].lt(0).all()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in policy.parameters())


@pytest.mark.parametrize("rows", [1, 2, 5, 8, 13])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_shard_rows_are_fsdp2s_split_of_dim0(rows, world):
    """Each rank reads the rows its FSDP2 shard holds: ``torch.chunk``'s split, empty shares
    for the ranks past the last chunk."""
    from dpocache.models.loading import shard_rows

    chunks = list(torch.arange(rows).chunk(world))
    chunks += [torch.arange(0)] * (world - len(chunks))
    for rank, want in enumerate(chunks):
        assert torch.equal(torch.arange(rows)[shard_rows(rows, world, rank)], want), (rank, want)


def test_sharded_loading_reads_only_each_shards_rows(saved, world_of_one, monkeypatch):
    """``load_for_sharding`` reads every parameter with safetensors' ``get_slice`` (the
    shard's rows), never whole with ``get_tensor``; the filled shards are the file's weights,
    in memory of their own (not views of the file's mapping)."""
    import safetensors
    from torch.distributed.tensor import DTensor

    from dpocache.distributed.sharded_reference import load_sharded_reference

    whole = []
    real_open = safetensors.safe_open

    class Spy:
        def __init__(self, *args, **kwargs):
            self.f = real_open(*args, **kwargs)

        def __enter__(self):
            self.f.__enter__()
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def get_tensor(self, key):
            whole.append(key)
            return self.f.get_tensor(key)

        def __getattr__(self, name):
            return getattr(self.f, name)

    monkeypatch.setattr(safetensors, "safe_open", Spy)
    reference = load_sharded_reference(saved["llama"], torch.float32, world_of_one)
    monkeypatch.undo()
    assert whole == []
    full = load_causal_lm(saved["llama"])
    for (name, p), q in zip(reference.model.named_parameters(), full.parameters(), strict=True):
        # The embeddings and the head are streamed from their shards (whole in a world of one).
        assert torch.equal(p.full_tensor() if isinstance(p, DTensor) else p, q), name


def test_sharded_reference_never_gathers_its_vocabulary_tables(saved, world_of_one, monkeypatch):
    """The sharded reference streams its embeddings and output head from their shards
    (``dpocache.distributed.vocab_stream``): FSDP gathers only the decoder layers' matrices one at a time,
    the layers' norms and the root (final norm), as many times per forward however many row
    chunks the head scores, nothing stays gathered after a forward, and the values do not
    depend on the chunking."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group
    from torch.distributed.tensor import DTensor

    from dpocache.distributed.fsdp import decoder_layers, matrix_units
    from dpocache.distributed.sharded_reference import load_sharded_reference
    from dpocache.distributed.vocab_stream import StreamedEmbedding, StreamedHead

    reference = load_sharded_reference(saved["llama"], torch.float32, world_of_one)
    scorer, lm = reference._scorer, reference.model
    assert isinstance(lm.get_input_embeddings(), StreamedEmbedding)
    assert isinstance(lm.get_output_embeddings(), StreamedHead)
    gathers = []  # one per unit whose parameters go from sharded to gathered: an all-gather on several ranks
    group = _fsdp_param_group.FSDPParamGroup
    real_gather = group._to_unsharded
    monkeypatch.setattr(group, "_to_unsharded", lambda self: gathers.extend(
        [] if self.is_unsharded else [sum(p._orig_size.numel() for p in self.fsdp_params)]) or real_gather(self))

    ids = torch.randint(3, 400, (2, 12))
    mask = torch.zeros_like(ids)
    mask[:, 2:] = 1
    counts, outs = [], []
    for budget in (scorer.logits_budget, 2 * scorer.config.vocab_size):  # one chunk; 2 rows a chunk
        scorer.logits_budget = budget
        gathers.clear()
        with torch.no_grad():
            outs.append(scorer(ids, torch.ones_like(ids), mask))
        counts.append(len(gathers))
        assert all(isinstance(p, DTensor) for n, p in lm.named_parameters() if not n.endswith(".shard"))
    layers = decoder_layers(lm)
    matrices = [m for layer in layers for m in matrix_units(layer)]
    assert len(matrices) == 7 * len(layers)  # q, k, v, o, gate, up, down
    assert counts[0] == counts[1] == len(matrices) + len(layers) + 1  # matrices, layers (norms), root (final norm)
    assert max(gathers) == max(m.weight.numel() for m in matrices)  # never more than one matrix at a time
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=1e-6)  # row chunks of another size: the GEMM's rounding


@pytest.mark.parametrize("mode", ["native", "fp32-gemm"])
def test_sharded_reference_with_its_own_head_unit_equals_the_unsharded_one_in_bf16(saved, world_of_one, pref_jsonl,
                                                                                     mode, monkeypatch):
    """An untied head, an FSDP unit of its own in the sharded reference, keeps the unsharded
    reference's arithmetic under bf16 in both CPU routes: bf16 storage with the native kernels,
    ``dpocache.scoring.bf16_matmul``'s fp32 GEMM otherwise. Values equal bit for bit."""
    from dpocache.distributed.sharded_reference import load_sharded_reference

    monkeypatch.setenv("DPOCACHE_BF16_MATMUL", mode)
    tokenizer = load_tokenizer(saved["llama"])
    pairs = load_preference_data(str(pref_jsonl), tokenizer, max_length=64, show_progress=False).pairs
    pad = tokenizer.pad_token_id or 0
    want = _all_values(ReferenceModel.from_pretrained(saved["llama"], "bfloat16", "cpu", layout="padded"), pairs, pad)
    sharded = load_sharded_reference(saved["llama"], torch.bfloat16, world_of_one, layout="padded")
    got = _all_values(sharded, pairs, pad)
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))


def test_an_embedding_subclass_is_gathered_not_streamed(saved, world_of_one, monkeypatch):
    """An ``nn.Embedding`` subclass may compute in its forward (Gemma 3 scales its rows): the
    sharded reference then gathers its tables as FSDP units instead of streaming raw rows, and
    its values stay the model's."""
    from dpocache.distributed.sharded_reference import load_sharded_reference
    from dpocache.distributed.vocab_stream import StreamedEmbedding
    from dpocache.models import loading

    class Scaled(nn.Embedding):
        def forward(self, ids):
            return super().forward(ids) * 3.0

    def scaled(model):
        plain = model.model.embed_tokens
        model.model.embed_tokens = Scaled(plain.num_embeddings, plain.embedding_dim, device=plain.weight.device)
        model.model.embed_tokens.weight = plain.weight
        return model

    real_meta_model = loading.meta_model
    monkeypatch.setattr(loading, "meta_model", lambda *args: scaled(real_meta_model(*args)))
    sharded = load_sharded_reference(saved["llama"], torch.float32, world_of_one)
    full = scaled(load_causal_lm(saved["llama"]))
    assert not isinstance(sharded.model.get_input_embeddings(), StreamedEmbedding)
    ids = torch.randint(3, 400, (2, 12))
    mask = torch.zeros_like(ids)
    mask[:, 2:] = 1
    with torch.no_grad():
        want = CompletionLogProbs(full)(ids, torch.ones_like(ids), mask)
        got = sharded._scorer(ids, torch.ones_like(ids), mask)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_a_sharded_probe_verdict_is_recorded_by_the_reference_and_reused_by_the_policy(saved, world_of_one, tmp_path,
                                                                                        monkeypatch):
    """The sharded reference's fast-path probe records its verdict in the cache directory
    (``dpocache.cache.probes``); the sharded policy of the same architecture and dtype takes it
    from there without a probe (which would gather the whole head and embeddings), and a
    verdict recorded as unusable is honoured, not re-derived."""
    from dpocache.cache.probes import ProbeMemo, probe_key
    from dpocache.config import Config
    from dpocache.distributed.sharded_reference import load_sharded_reference
    from dpocache.models.policy import load_sharded_policy

    calls = []
    real_probe = CompletionLogProbs.probe_fast_path
    monkeypatch.setattr(CompletionLogProbs, "probe_fast_path", lambda self: calls.append(1) or real_probe(self))
    memo = ProbeMemo(tmp_path / "cache")
    reference = load_sharded_reference(saved["llama"], torch.float32, world_of_one, probe_memo=memo)
    assert calls == [1] and reference._scorer.fast_path
    key = probe_key(reference.model.config, torch.float32, "cpu")
    assert memo.get(key) is True and memo.get(probe_key(reference.model.config, torch.bfloat16, "cpu")) is None

    cfg = Config()
    cfg.model.path = str(saved["llama"])
    _, scorer = load_sharded_policy(cfg, world_of_one, torch.float32, memo)
    assert calls == [1] and scorer.fast_path  # no second probe
    memo.put(key, False)
    _, scorer = load_sharded_policy(cfg, world_of_one, torch.float32, memo)
    assert calls == [1] and not scorer.fast_path
    # Without a memo (or with another directory's) the policy probes, and finds the fast path.
    _, scorer = load_sharded_policy(cfg, world_of_one, torch.float32, ProbeMemo(tmp_path / "other"))
    assert calls == [1, 1] and scorer.fast_path

    (tmp_path / "cache" / "probes.json").write_text("{not json")  # a damaged memo costs a probe, nothing else
    assert memo.get(key) is None


def test_probe_of_a_reference_stored_in_bf16_runs_under_autocast(tokenizer, monkeypatch):
    """Off the CPU a bf16 reference's matrices are stored in bf16 before its weights move to the
    device (``ReferenceModel.from_pretrained``), so its head probe meets bf16 matrices beside
    fp32 embeddings: it runs under autocast, as every forward of that model does, and finds the
    fast path."""
    from dpocache.models.tiny import build_model
    from dpocache.scoring.logprobs import CompletionLogProbs

    monkeypatch.setenv("DPOCACHE_BF16_MATMUL", "native")  # the fp32-GEMM route needs fp32 storage
    model = build_model("llama", tokenizer).eval()
    assert store_frozen_matrices_(model, torch.bfloat16) > 0
    assert {p.dtype for p in model.parameters()} == {torch.float32, torch.bfloat16}
    assert CompletionLogProbs(model).fast_path


@pytest.mark.parametrize("arch", ["llama", "gpt2"])  # an untied head; a head tied to the table
def test_an_embedding_saved_in_bf16_is_stored_in_bf16_with_the_same_values(tmp_path, tokenizer, arch, monkeypatch):
    """A checkpoint saved in bf16 has a table whose every value is exact in bf16: the frozen
    reference stores it in bf16 (half its memory) and casts each lookup back to fp32, so every
    log-prob equals the fp32 table's, bit for bit. A head tied to it shares the bf16 weight."""
    from dpocache.models import loading
    from dpocache.models.reference import ReferenceModel
    from dpocache.models.tiny import build_model
    from dpocache.scoring.logprobs import unwrap_causal_lm

    monkeypatch.setenv("DPOCACHE_BF16_MATMUL", "native")  # as on a GPU: the matrices in bf16 too
    model = build_model(arch, tokenizer)
    table = model.get_input_embeddings().weight
    with torch.no_grad():
        table.copy_(table.to(torch.bfloat16))  # as a checkpoint saved in bf16 loads
    tied = model.get_output_embeddings().weight is table
    assert tied == (arch == "gpt2")
    model.save_pretrained(tmp_path / arch)
    tokenizer.save_pretrained(tmp_path / arch)

    stored = ReferenceModel.from_pretrained(tmp_path / arch, "bfloat16", "cpu")
    lm = unwrap_causal_lm(stored.model)
    assert lm.get_input_embeddings().weight.dtype == torch.bfloat16
    assert (lm.get_output_embeddings().weight is lm.get_input_embeddings().weight) == tied
    monkeypatch.setattr(loading, "store_exact_embeddings_", lambda *args, **kwargs: 0)  # the fp32 table, as before
    plain = ReferenceModel.from_pretrained(tmp_path / arch, "bfloat16", "cpu")
    assert unwrap_causal_lm(plain.model).get_input_embeddings().weight.dtype == torch.float32
    assert loading.parameter_bytes(stored.model) < loading.parameter_bytes(plain.model)

    torch.manual_seed(0)
    ids = torch.randint(3, len(tokenizer), (2, 24))
    attn = torch.ones_like(ids)
    completion = torch.zeros_like(ids)
    completion[:, 10:] = 1
    assert torch.equal(stored.logprobs(ids, attn, completion), plain.logprobs(ids, attn, completion))


def test_an_embedding_not_exact_in_bf16_and_a_subclass_stay_fp32(tokenizer):
    from dpocache.models.loading import store_exact_embeddings_
    from dpocache.models.tiny import build_model

    model = build_model("llama", tokenizer)  # random fp32 values: most are not bf16 values
    assert store_exact_embeddings_(model, torch.bfloat16) == 0
    assert model.get_input_embeddings().weight.dtype == torch.float32

    class Scaled(torch.nn.Embedding):  # Gemma 3's kind: it scales inside the lookup, in the table's dtype
        pass

    scaled = Scaled(8, 4)
    with torch.no_grad():
        scaled.weight.copy_(scaled.weight.to(torch.bfloat16))
    assert store_exact_embeddings_(torch.nn.Sequential(scaled), torch.bfloat16) == 0


@pytest.mark.parametrize("arch", ["llama", "gpt2", "qwen2", "mixtral", "gemma2"])
def test_a_checkpoint_saved_in_bf16_is_read_in_bf16_to_the_same_stored_model(tmp_path, tokenizer, arch):
    """``load_for_storage`` reads a bf16 checkpoint in bf16 (no fp32 copy on the host) and gives,
    once the matrices are stored, exactly what the fp32 load gives: every parameter's dtype and
    values, every buffer, the same embedding lookup. Gemma 2's embedding scale, a buffer the bf16
    load would compute in bf16, sends it to the fp32 load."""
    from dpocache.models import loading
    from dpocache.models.tiny import build_model

    build_model(arch, tokenizer).to(torch.bfloat16).save_pretrained(tmp_path)
    assert loading.checkpoint_dtypes(tmp_path) == {torch.bfloat16}
    read = []
    real = loading.load_causal_lm

    def spied(*args, **kwargs):
        read.append(args[3] if len(args) > 3 else kwargs.get("dtype", torch.float32))
        return real(*args, **kwargs)

    loading.load_causal_lm, saved = spied, loading.load_causal_lm
    try:
        direct = loading.load_for_storage(tmp_path, torch.bfloat16)
    finally:
        loading.load_causal_lm = saved
    assert read[0] == torch.bfloat16 and (read[1:] == [torch.float32]) == (arch == "gemma2")
    full = loading.load_causal_lm(tmp_path)
    for model in (direct, full):
        loading.store_frozen_matrices_(model, torch.bfloat16)
    params = [dict(m.named_parameters(remove_duplicate=False)) for m in (direct, full)]
    assert params[0].keys() == params[1].keys()
    for name, p in params[0].items():
        q = params[1][name]
        assert p.dtype == q.dtype and torch.equal(p, q), name
    assert {n: b for n, b in direct.named_buffers()}.keys() == {n: b for n, b in full.named_buffers()}.keys()
    for (name, b), (_, c) in zip(direct.named_buffers(), full.named_buffers()):
        assert b.dtype == c.dtype and torch.equal(b, c), name
    ids = torch.randint(3, len(tokenizer), (2, 16))
    with torch.no_grad():
        assert torch.equal(direct.get_input_embeddings()(ids), full.get_input_embeddings()(ids))


def test_a_checkpoint_in_fp32_is_read_in_fp32(tmp_path, tokenizer):
    from dpocache.models.loading import checkpoint_dtypes, load_for_storage
    from dpocache.models.tiny import build_model

    build_model("llama", tokenizer).save_pretrained(tmp_path)
    assert checkpoint_dtypes(tmp_path) == {torch.float32}
    assert {p.dtype for p in load_for_storage(tmp_path, torch.bfloat16).parameters()} == {torch.float32}


def test_an_adapter_on_a_base_read_in_bf16_gives_the_same_stored_reference(tmp_path, tokenizer):
    """A reference of an adapter directory: its base read in bf16 (``load_for_storage``), the
    saved fp32 adapter on top, every matrix stored in bf16, equals the fp32 load's, tensor for
    tensor (PEFT casts a new adapter to the base's dtype before it loads the saved values)."""
    from peft import LoraConfig, PeftModel, get_peft_model

    from dpocache.models import loading
    from dpocache.models.tiny import build_model

    build_model("llama", tokenizer).to(torch.bfloat16).save_pretrained(tmp_path / "base")
    adapter = get_peft_model(loading.load_causal_lm(tmp_path / "base"),
                             LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False))
    adapter.save_pretrained(tmp_path / "adapter")  # random A and B: the adapter changes the values
    stored = []
    base = tmp_path / "base"
    for model in (loading.load_for_storage(base, torch.bfloat16), loading.load_causal_lm(base)):
        model = PeftModel.from_pretrained(model, str(tmp_path / "adapter"), is_trainable=False)
        loading.store_frozen_matrices_(model, torch.bfloat16)
        stored.append(dict(model.named_parameters()))
    assert stored[0].keys() == stored[1].keys() and any("lora_A" in name for name in stored[0])
    for name, p in stored[0].items():
        assert p.dtype == stored[1][name].dtype and torch.equal(p, stored[1][name]), name


def test_auto_dtype_takes_bf16_only_where_a_gpu_has_it_natively(monkeypatch):
    """torch counts an older GPU's emulated bf16 as support (``is_bf16_supported()``); there bf16
    runs slower than float32 and SDPA's fused kernels refuse it, so ``auto`` is float32."""
    from dpocache.models.reference import resolve_dtype

    def pre_ampere(including_emulation: bool = True) -> bool:
        return including_emulation  # a T4 or V100: emulated only

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", pre_ampere)
    assert resolve_dtype("auto", "cuda") == torch.float32
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)  # Ampere on
    assert resolve_dtype("auto", "cuda") == torch.bfloat16
    assert resolve_dtype("bfloat16", "cuda") == torch.bfloat16  # asked for: as asked
