"""The frozen reference sharded with FSDP2 over the ``torchrun`` processes (``cache build
--fsdp``, and the build ``train --fsdp`` runs for missing values).

Each process holds ``1 / world`` of the weights; every decoder layer is all-gathered just
before it runs and freed after, as in ``dpocache.distributed.fsdp`` (``CompletionLogProbs`` is the root,
which owns the final norm), and the embeddings and the output head are used a tile at a time
from the shards, never gathered whole (``dpocache.distributed.vocab_stream``). Each process still scores its
own token-balanced share of the pairs (``cache.build.build_distributed``).

An FSDP2 forward is a collective: every rank must run the same number of forwards, with the
same all-gathers in the same order. Shares differ in their number of batches (and a rank may
have none), so before each forward a rank says whether it has a real batch (an all-reduce of
one flag), and a rank whose share is done keeps answering with dummy forwards of one tiny pair
(``drain``) until no rank has work left. Every round is then one all-reduce and one forward on
every rank.
"""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import torch
from torch import nn

from dpocache.cache.probes import ProbeMemo, probe_key
from dpocache.data.pairs import TokenizedPair
from dpocache.distributed.fsdp import gather_head_around, shard_policy, vocabulary_modules
from dpocache.distributed.process_group import DistEnv, broadcast_object, reduce_counts
from dpocache.distributed.vocab_stream import StreamedEmbedding, StreamedHead
from dpocache.models.kernels import apply_kernels, kernels_for
from dpocache.models.loading import (
    disable_dropout,
    load_for_sharding,
    routes_bf16_through_fp32,
    store_frozen_matrices_,
)
from dpocache.models.reference import ReferenceModel
from dpocache.runtime.allocator import trim_heap
from dpocache.runtime.preflight import UsageError
from dpocache.scoring import bf16_matmul
from dpocache.scoring.layout_choice import SHARED, shares_prompts
from dpocache.scoring.logprobs import CompletionLogProbs, autocast, unwrap_causal_lm

# One tiny pair for the padding forwards: a prompt token and one token per completion.
_DUMMY_PAIR = TokenizedPair(index=-1, prompt_ids=(1, 1), chosen_ids=(1,), rejected_ids=(1,), key=b"\0" * 16)


class ShardedReference(ReferenceModel):
    """A ``ReferenceModel`` whose weights are FSDP2 shards; call ``drain`` on every rank when
    its own share is done."""

    def __init__(self, model, scorer: CompletionLogProbs, env: DistEnv, dtype: torch.dtype, layout: str,
                 attention: str | None = None, kernels=None):
        self.env = env
        super().__init__(model, dtype, layout=layout, scorer=scorer, attention=attention, kernels=kernels)
        if shares_prompts(self.layout):
            # The shared layout calls the body and the head, not the root's forward: gather the
            # root's own parameters (embeddings, final norm, head) around it.
            run_shared = self._run_shared

            def gathered(scorer, batch):
                scorer.unshard()
                try:
                    return run_shared(scorer, batch)
                finally:
                    scorer.reshard()

            self._run_shared = gathered
        self.padding_passes = 0
        self._padding = False

    def _call(self, fn, tokens: int) -> torch.Tensor:
        if not self._padding:
            self._round(working=True)
        return super()._call(fn, tokens)

    def _round(self, working: bool) -> bool:
        """One round's flag: whether any rank has a real batch in this round."""
        (busy,) = reduce_counts(self.env, [1.0 if working else 0.0])
        return busy > 0

    def drain(self, pad_id: int = 0) -> None:
        """Padding forwards until every rank's share is done (a collective; call it on every
        rank once its own batches are scored, also after an error)."""
        while self._round(working=False):
            self._padding = True  # this round's flag is already sent
            try:
                self.score([_DUMMY_PAIR], pad_id)
            finally:
                self._padding = False
            self.forward_passes -= 1  # not a pass over the data
            self.padding_passes += 1


def shard_reference(scorer: CompletionLogProbs, env: DistEnv) -> None:
    """``fully_shard`` every matrix of every decoder layer (and the layer, for its norms), the
    embeddings, the output head and the root (``dpocache.distributed.fsdp.shard_policy``), the head
    gathered once around each forward's head chunks (``gather_head_around``) unless streamed,
    and the root's parameters freed after each forward too (FSDP2 keeps a root's gathered for
    the backward, and a reference has none). So besides its shards a process holds one matrix
    (twice, for the moment of its gather) at a time."""
    shard_policy(scorer, scorer.model, env, head_unit=True, matrix_granularity=True)
    scorer.set_reshard_after_forward(True, recurse=False)


def stream_vocabulary(scorer: CompletionLogProbs, env: DistEnv) -> None:
    """Once the shards are loaded: the embeddings and a bias-free head are used tile by tile
    from the shards (``dpocache.distributed.vocab_stream``), never gathered whole; another head (a bias)
    is gathered once around each forward's head chunks (``dpocache.distributed.fsdp.gather_head_around``).
    After the routing of ``bf16_matmul.install``, which the streamed head keeps."""
    from torch.distributed.fsdp import FSDPModule


    lm = unwrap_causal_lm(scorer.model)
    embed, head = vocabulary_modules(lm)
    # An FSDP2 unit of exactly nn.Embedding underneath (fully_shard subclasses the class it is
    # given): a subclass of nn.Embedding may scale or mix in its forward (Gemma 3's scales).
    plain_embed = (isinstance(embed, FSDPModule) and type(embed).__bases__[-1] is nn.Embedding
                   and embed.max_norm is None)
    if not plain_embed or head is None or head.bias is not None:
        return gather_head_around(scorer)
    streamed = StreamedHead.from_sharded(head, env)
    lm.set_input_embeddings(StreamedEmbedding.from_sharded(embed, env))
    lm.set_output_embeddings(streamed)
    head_logps = scorer.head_logps

    def finished(hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        out = head_logps(hidden, labels)
        streamed.finish()  # the head's calls of every rank in this forward are done
        if hidden.device.type == "cpu":
            trim_heap()  # the chunks' logits buffers, kept by glibc below its mmap threshold
        return out

    scorer.head_logps = finished
    # Without the fast path the model's own forward calls the head: finish after the root's.
    scorer.register_forward_hook(lambda module, args, out: streamed.finish())


def make_root(scorer: CompletionLogProbs, env: DistEnv, dtype: torch.dtype) -> None:
    """One tiny forward through ``scorer`` (a collective): FSDP makes the first module to run
    forward its root, which then gathers the parameters no other unit owns. Needed before
    anything calls the body or the model's own forward directly (the shared layout, the probe):
    a layer whose forward ran first would make itself a root."""
    ids = torch.ones((1, 4), dtype=torch.long, device=env.device)
    mask = torch.zeros_like(ids)
    mask[:, 2:] = 1
    # Under the compute dtype's autocast: matrices stored in bf16 take no fp32 input.
    with torch.no_grad(), autocast(dtype, env.device):
        scorer(ids, torch.ones_like(ids), mask)


def probe_sharded(scorer: CompletionLogProbs, env: DistEnv, dtype: torch.dtype, memo: ProbeMemo | None = None,
                  rooted: bool = False) -> None:
    """The fast-path probe of ``CompletionLogProbs`` on a sharded model (a collective), or its
    verdict from ``memo`` (``dpocache.cache.probes``: the same architecture, dtype and versions
    probed before, by a sharded reference pass), which costs no forward and no gathering.

    The probe calls the model's own forward with the root's parameters gathered around it and
    each layer gathering its own, after ``make_root`` (unless ``rooted``: done already)."""
    key = probe_key(scorer.config, dtype, env.device) if memo is not None else None
    known = broadcast_object(env, memo.get(key) if memo is not None and env.is_main else None)
    if known is not None:
        scorer.fast_path = known
        return
    if not rooted:
        make_root(scorer, env, dtype)
    with torch.no_grad(), autocast(dtype, env.device):
        scorer.unshard()
        try:
            scorer.fast_path = scorer.probe_fast_path()
        finally:
            scorer.reshard()
    if memo is not None and env.is_main:
        memo.put(key, scorer.fast_path)


def load_sharded_reference(path: str | Path, dtype: torch.dtype, env: DistEnv, layout: str = SHARED,
                           attn_implementation: str | None = "sdpa", attention: str | None = None,
                           probe_memo: ProbeMemo | None = None, kernels: str = "auto") -> ShardedReference:
    """The reference of ``path`` sharded over ``env``'s ranks (a collective: every rank calls
    it). Values are those of ``ReferenceModel.from_pretrained``: bf16 matrices stored in bf16
    where the native bf16 kernels run, the fp32-GEMM route on CPUs without AMX. ``probe_memo``:
    where the fast-path probe's verdict is looked up and recorded (``dpocache.cache.probes``);
    ``kernels``: Liger's or the model's own (``dpocache.models.kernels``), patched in before sharding."""
    routed = dtype == torch.bfloat16 and routes_bf16_through_fp32(env.device)
    storage = None if routed else dtype
    kernel_choice = kernels_for(kernels, env.device, path)

    def prepare(model):
        disable_dropout(model)
        model.eval()
        model.requires_grad_(False)
        if storage is not None:
            store_frozen_matrices_(model, storage)
        apply_kernels(model, kernel_choice)  # on the meta device: Liger patches the modules' forwards

    def shard(model):
        scorer = CompletionLogProbs(model, probe=False)  # probed below, once sharded
        shard_reference(scorer, env)
        return scorer

    model, scorer = load_for_sharding(path, env, prepare, shard, attn_implementation)
    if routed:
        bf16_matmul.install(model)  # after loading: it skips a model whose weights are on meta
    stream_vocabulary(scorer, env)
    # The shared layout calls the body, not the root's forward: make the root first. Its tables
    # are streamed, so this forward gathers one layer at a time.
    make_root(scorer, env, dtype)
    probe_sharded(scorer, env, dtype, probe_memo, rooted=True)
    report_shards("reference", model, env)
    return ShardedReference(model, scorer, env, dtype, layout, attention, kernel_choice)


def report_shards(what: str, model, env: DistEnv) -> None:
    """One line on rank 0: the model is sharded, and this rank's share of its weights."""
    from torch.distributed.tensor import DTensor

    if env.is_main:
        local = [p.to_local() if isinstance(p, DTensor) else p for p in model.parameters()]
        mib = sum(p.numel() * p.element_size() for p in local) / 2**20
        print(f"{what}: FSDP2-sharded over {env.world_size} processes, {mib:.1f} MiB of weights in rank 0",
              file=sys.stderr)


def build_share_sharded(build_share, load_reference, todo: bool, pad_id: int):
    """Run ``build_share(load)`` (``cache.build.build_missing`` on this rank's share) with a
    sharded reference: loaded on every rank whenever any pair is missing (loading is a
    collective, even for a rank with an empty share), then drained."""
    if not todo:
        return build_share(load_reference)
    reference = load_reference()
    try:
        return build_share(lambda: reference)
    finally:
        reference.drain(pad_id)
        # Free the shards and FSDP's state now, while the process group they use still exists
        # (collected at interpreter exit, after it is destroyed, they can abort the process).
        reference = None  # noqa: F841 - the last reference to it (the closure above holds this cell)
        gc.collect()
        trim_heap()  # its shards: freed, but kept by glibc (blocks under the mmap threshold) unless trimmed


def reference_loader(path: str | Path, dtype: torch.dtype, env: DistEnv, layout: str = SHARED,
                     sharded: bool = False, adapter: str | Path | None = None, attention: str | None = None,
                     probe_memo: ProbeMemo | None = None, compile: str = "off", kernels: str = "auto",
                     stream: bool = False, liger_rope: bool = True):
    """What ``build_distributed`` calls to load the reference: sharded over ``env``'s ranks
    (``sharded`` and a world of several), else whole in every process; ``adapter``: a PEFT
    adapter directory applied on top of ``path`` (the initial policy of an adapter run);
    ``probe_memo``: the sharded reference's probe verdicts (``dpocache.cache.probes``);
    ``compile``: the whole reference's decoder layers (``dpocache.scoring.compiling``; a sharded one stays eager);
    ``kernels``: Liger's or the model's own (``dpocache.models.kernels``); ``stream``: the whole
    reference's decoder layers streamed from host memory (``dpocache.models.streaming``);
    ``liger_rope``: the whole reference's, False beside a compiled policy
    (``dpocache.models.kernels``; a sharded reference's policy is never compiled)."""
    if sharded and env.enabled:
        if adapter is not None:
            raise UsageError(f"--fsdp: a sharded reference with a PEFT adapter ({adapter}) is not supported; build "
                             "without --fsdp (the adapter's base is loaded whole) or with --reference base")
        return lambda: load_sharded_reference(path, dtype, env, layout, attention=attention, probe_memo=probe_memo,
                                              kernels=kernels)
    return lambda: ReferenceModel.from_pretrained(path, dtype, env.device, layout=layout, adapter=adapter,
                                                  attention=attention, compile=compile, kernels=kernels,
                                                  stream=stream, liger_rope=liger_rope)
