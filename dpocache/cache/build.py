"""Build, verify and export the reference cache.

``build_missing`` is incremental by construction: it looks every pair's key up in the store and
runs the reference only on the keys it lacks, so shuffled, subset, appended or re-truncated data
reuses every value already computed. The reference model is loaded only if something is
missing: a complete cache costs no model load and no forward pass.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import math
import os
import random
import resource
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable, Sequence

import torch
from tqdm.auto import tqdm

from dpocache.cache.atomic import UnsafeFileError, read_regular_file
from dpocache.cache.concurrent_builds import SharedBuild, shared_build
from dpocache.cache.fingerprint import FingerprintMemo, default_memo_path, model_dir_fingerprint, module_fingerprint
from dpocache.cache.sequences import SUBDIR as SEQUENCES
from dpocache.cache.store import (
    DEFAULT_SHARD_PAIRS,
    MANIFEST,
    MAX_MANIFEST_BYTES,
    CacheError,
    CacheStore,
    CorruptShard,
    Namespace,
    ShardWriter,
    parse_manifest,
)
from dpocache.config import with_fields
from dpocache.data.pairs import TokenizedPair
from dpocache.data.values import PairValues
from dpocache.distributed.process_group import (
    DistEnv,
    barrier,
    broadcast_object,
    differing_on_ranks,
    reduce_counts,
    split_by_weight,
)
from dpocache.distributed.sharded_reference import build_share_sharded
from dpocache.models.directories import reference_source
from dpocache.models.reference import DTYPES, ReferenceModel, dtype_name, resolve_dtype
from dpocache.runtime.lookahead import ahead
from dpocache.runtime.preflight import UsageError, context_length, unwritable
from dpocache.runtime.signals import StopRequest, stop_signals
from dpocache.scoring.layout_choice import PADDED
from dpocache.scoring.layouts import budget_batches
from dpocache.scoring.logprobs import unwrap_causal_lm

# Padded token slots per reference forward when none is given (``--max-tokens``), by device.
# The CPU's: on the 2-core bench CPU the reference pass ran faster at 1024 than at 4096, 2048 or
# 512, and 768 and 1536 were no better, interleaved in one process (bench/token_budget_ab.py):
# a batch's activations stay in the L3 cache between the layer's products
# (docs/benchmarks/levers-cpu-2core-20261123.md). The GPU's: on an H100 (1.1B Llama, bf16) 16384
# ran the pass almost as fast as 32768 with less GPU memory, 8192 was slower, and 65536 was no
# faster than 32768 (docs/benchmarks/vs-trl-h100-20261123.md).
CPU_MAX_TOKENS = 1024
GPU_MAX_TOKENS = 16384


def default_max_tokens(device: torch.device | str) -> int:
    """The token budget of a reference forward on ``device`` when the user gives none."""
    return CPU_MAX_TOKENS if torch.device(device).type == "cpu" else GPU_MAX_TOKENS


def default_cache_dir() -> Path:
    """``$DPOCACHE_CACHE_DIR``, else ``$XDG_CACHE_HOME/dpocache``, else ``~/.cache/dpocache``."""
    if os.environ.get("DPOCACHE_CACHE_DIR"):
        return Path(os.environ["DPOCACHE_CACHE_DIR"]).expanduser()  # quoted in a shell, ~ reaches us as is
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache")
    return Path(base).expanduser() / "dpocache"


_ADAPTER_CONFIG_IGNORED = {"base_model_name_or_path", "inference_mode", "revision", "peft_version"}


def _adapter_fingerprint(adapter_dir: Path, memo: FingerprintMemo) -> tuple[str, str]:
    """(weights, config) digests of a PEFT adapter directory's ``adapter_model.*`` files and
    its ``adapter_config.json``."""
    files = sorted(p for p in adapter_dir.iterdir() if p.is_file() and p.name.startswith("adapter_model."))
    if not files:
        raise FileNotFoundError(f"{adapter_dir}: no adapter weights (adapter_model.safetensors or adapter_model.bin)")
    weights = hashlib.sha256()
    for f in files:
        weights.update(f.name.encode() + b"\0" + memo.sha256(f).encode() + b"\n")
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    kept = {k: v for k, v in config.items() if k not in _ADAPTER_CONFIG_IGNORED}
    return weights.hexdigest(), hashlib.sha256(json.dumps(kept, sort_keys=True, default=str).encode()).hexdigest()


def namespace_for_dir(model_path: str | Path, dtype: torch.dtype | str, cache_dir: str | Path,
                      reference: str = "initial", read_only: bool = False) -> Namespace:
    """The namespace of the reference ``model_path`` describes (``reference_source``): the base's
    weights and config, and with an adapter on, the adapter's weights and config too.
    ``dtype``: the one the values are computed in (a ``torch.dtype`` or its name; ``auto`` is
    resolved first, ``resolve_dtype``). ``read_only``: the caller only reads the cache
    (``FingerprintMemo``)."""
    if not Path(model_path).is_dir():
        raise FileNotFoundError(f"{model_path}: no such directory (a Hugging Face model directory is expected)")
    base, adapter = reference_source(model_path, reference)
    return _namespace_of(base, adapter, _value_dtype(dtype), FingerprintMemo(default_memo_path(Path(cache_dir)),
                                                                             read_only))


def _value_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """``dtype`` as a namespace takes it: one of ``DTYPES``, never ``auto`` (which differs by device)."""
    if dtype == "auto":
        raise ValueError("dtype 'auto': a namespace is for the dtype its values are computed in; resolve it first "
                         "(dpocache.models.reference.resolve_dtype('auto', device))")
    if isinstance(dtype, str):
        return resolve_dtype(dtype)
    if dtype not in DTYPES.values():
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}; got {dtype}")
    return dtype


def _namespace_of(base: Path, adapter: Path | None, dtype: torch.dtype, memo: FingerprintMemo) -> Namespace:
    fp = model_dir_fingerprint(base, memo)
    if adapter is None:
        return Namespace(fp["weights_sha256"], fp["config_sha256"], dtype_name(dtype), model=str(base.resolve()))
    adapter_weights, adapter_config = _adapter_fingerprint(adapter, memo)
    weights = hashlib.sha256(f"{fp['weights_sha256']}+adapter:{adapter_weights}".encode()).hexdigest()
    config = hashlib.sha256(f"{fp['config_sha256']}+adapter:{adapter_config}".encode()).hexdigest()
    return Namespace(weights, config, dtype_name(dtype), model=f"{base.resolve()} + adapter {adapter.resolve()}")


def namespace_for_module(model: torch.nn.Module, dtype: torch.dtype) -> Namespace:
    fp = module_fingerprint(model)
    return Namespace(fp["weights_sha256"], fp["config_sha256"], dtype_name(dtype),
                     model=f"<in memory {type(model).__name__}>")


def peak_memory_bytes(device: torch.device | None = None) -> int:
    if device is not None and device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


@dataclass
class BuildSummary:
    pairs: int  # pairs in the data
    unique: int  # distinct keys
    computed: int
    reused: int
    tokens: int  # tokens the reference scored, each prompt counted once
    seconds: float
    tokens_per_s: float
    peak_memory_bytes: int
    cache_dir: str
    namespace: str
    forward_passes: int
    corrupt_shards: list[str] = field(default_factory=list)
    world_size: int = 1  # processes that shared the work (the counts above are their totals)
    interrupted: int = 0  # the signal that stopped the build (0: it ran to the end)
    # The reference pass's layout (dpocache.scoring.layout_choice.LayoutChoice.to_json: requested, used,
    # attention, reason); None when no pass ran (every pair was cached).
    layout: dict | None = None
    compiled_layers: int = 0  # decoder layers the reference pass ran compiled (dpocache.scoring.compiling)
    max_tokens: int | None = None  # the token budget of its forwards (None when no pass ran)
    # The kernels the reference pass ran (dpocache.models.kernels.KernelChoice.to_json: requested, used, reason,
    # applied); None when no pass ran.
    kernels: dict | None = None
    # The decoder layers streamed from host memory (dpocache.models.streaming.StreamedLayers.to_json: layers,
    # slots, host_gib, device_gib); None when the reference was resident or no pass ran.
    streamed: dict | None = None
    # Of the pairs computed or to compute, those the cache held as sums alone when per-token values
    # were asked for (``BuildOptions.per_token``): scored again for them (their sums are unchanged).
    per_token_again: int = 0

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class BuildOptions:
    """How a reference pass runs: one record from the command line, a trainer or a script down
    to each rank's scoring loop (``build_missing``, ``build_distributed``). The store, the pairs
    and the reference to load are the build's arguments; these are its settings."""

    pad_id: int = 0  # the tokenizer's; padding is never scored
    per_token: bool = False  # also store per-token values (LD-DPO, ``cache export``)
    max_tokens: int | None = None  # padded token slots per forward; None: ``default_max_tokens`` of the device
    shard_pairs: int = DEFAULT_SHARD_PAIRS  # pairs per shard file
    flush_seconds: float = 60.0  # a shard is written at least this often, however few pairs it holds
    show_progress: bool = True
    sharded: bool = False  # ``build_distributed``: the reference's weights sharded over the ranks


def unique_pairs(pairs: Sequence[TokenizedPair]) -> dict[bytes, TokenizedPair]:
    out: dict[bytes, TokenizedPair] = {}
    for p in pairs:
        out.setdefault(p.key, p)
    return out


def score_batch(reference: ReferenceModel, batch: Sequence[TokenizedPair], pad_id: int,
                max_tokens: int | None = None, laid=None) -> PairValues:
    """Reference values of one batch ``(B,)`` of the pass, per-token values included, on the CPU
    (``ReferenceModel.score``: the reference's layout, rows as the pass planned them under
    ``max_tokens``); ``laid``: the batch laid out already (``laid_out_ahead``)."""
    return reference.score(batch, pad_id, max_tokens, laid)


def laid_out_ahead(reference: ReferenceModel, batches: Sequence[Sequence[TokenizedPair]], pad_id: int,
                   max_tokens: int):
    """``(batch, laid out)`` for each of ``batches``, the next laid out on a background thread
    while the device runs this one (``dpocache.runtime.lookahead``), in page-locked memory: on a
    GPU only, whose forward runs while the host collates (on a CPU the thread would take a core
    from the forward); elsewhere ``(batch, None)``."""
    if reference.device.type != "cuda":
        return ((batch, None) for batch in batches)
    return ahead(batches, lambda batch: reference.lay_out(batch, pad_id, max_tokens).pin_memory())


def reference_batches(reference: ReferenceModel, pairs: Sequence[TokenizedPair],
                      max_tokens: int) -> list[list[TokenizedPair]]:
    """Length-grouped batches under ``max_tokens`` padded slots, for the reference's layout."""
    return budget_batches(pairs, max_tokens, getattr(reference, "layout", PADDED))


def build_missing(
    store: CacheStore,
    pairs: Sequence[TokenizedPair],
    load_reference: Callable[[], ReferenceModel],
    options: BuildOptions | None = None,
    update_manifest: bool = True,
    **fields,
) -> BuildSummary:
    """Compute and store the reference values of every pair ``store`` lacks.

    ``options``: a ``BuildOptions``, or its fields as keywords (``max_tokens=2048``), or both.
    ``update_manifest``: False leaves the manifest to whoever opens the store next (it adopts
    the shards written here).

    ``load_reference``: a function that loads the reference (``ReferenceModel.from_pretrained``),
    called only when a pair is missing, or the ``ReferenceModel`` itself. A store not opened yet
    is opened first.

    SIGTERM or SIGINT ends the build after the batch in flight: what was computed is flushed
    (shard and manifest), then ``signals.Interrupted`` is raised (the command line exits 143 or
    130); the next build reuses every pair computed before the signal.
    """
    if isinstance(load_reference, ReferenceModel):  # loaded already: "loading" it gives it
        load_reference = functools.partial(_given, load_reference)
    if not store.opened:
        store.open()
    with stop_signals() as stop:
        options = with_fields(BuildOptions, options, fields)
        summary = score_missing(store, pairs, load_reference, stop, options, update_manifest)
        if summary.interrupted:
            raise stop.interrupted(interrupted_message(summary))
    return summary


def _given(reference: ReferenceModel) -> ReferenceModel:
    return reference


def check_reference(store: CacheStore, reference: ReferenceModel) -> None:
    """The reference is the model whose values the store files: a store opened for one model or
    dtype and a loader giving another (the Python API names both twice) would file values of
    one under the other's namespace, where every later run would read them as its own. The
    weights are compared where the reference knows the directories it was loaded from
    (``ReferenceModel.source``: their digests are memoised, so this hashes nothing again)."""
    if not hasattr(reference, "score") or not hasattr(reference, "dtype"):
        raise TypeError(f"load_reference returned a {type(reference).__name__}, not a ReferenceModel: load it with "
                        "dpocache.ReferenceModel.from_pretrained(model_dir) (or wrap a loaded model in "
                        "ReferenceModel(model))")
    check_namespace_dtype(store.namespace, reference)
    source = getattr(reference, "source", None)
    if source is None:
        return
    memo = FingerprintMemo(default_memo_path(store.root), read_only=True)
    loaded = _namespace_of(*source, reference.dtype, memo)
    namespace = store.namespace
    if (loaded.weights_sha256, loaded.config_sha256) != (namespace.weights_sha256, namespace.config_sha256):
        raise ValueError(f"the reference was loaded from {loaded.model}, but the store's namespace {namespace.id} is "
                         f"that of other weights ({namespace.model or 'unnamed'}): its values would be filed as that "
                         "model's; open the store with namespace_for_dir of the directory the reference loads")


def check_pairs_fit(pairs: Sequence[TokenizedPair], reference: ReferenceModel, pad_id: int) -> None:
    """The pairs fit the model: a pad id inside its vocabulary, no sequence past its context (the
    command line refuses such data as it is read, ``data.pairs.unfit_pairs``; data loaded in
    Python without ``context`` reaches here, where the model is known)."""
    config = unwrap_causal_lm(reference.model).config
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    vocab_size = getattr(config, "vocab_size", None)
    if isinstance(vocab_size, int) and not 0 <= pad_id < vocab_size:
        raise ValueError(f"pad_id {pad_id} is outside the model's vocabulary (0..{vocab_size - 1}); pass the "
                         "tokenizer's (tokenizer.pad_token_id, or 0 where it has none)")
    context = context_length(config.to_dict())
    if context is None:
        return
    for pair in pairs:
        if pair.unique_tokens <= context:  # the prompt and both completions: a bound read without the ids
            continue
        longest = len(pair.prompt_ids) + max(len(pair.chosen_ids), len(pair.rejected_ids))
        if longest > context:
            raise ValueError(f"pair {pair.index}: {longest} tokens, longer than the model's context ({context} "
                             f"positions, from its config); load the data with max_length={context} or less")


def check_namespace_dtype(namespace: Namespace, reference: ReferenceModel) -> None:
    """The reference runs in the dtype its values are filed under (``check_reference``)."""
    if dtype_name(reference.dtype) != namespace.dtype:
        raise ValueError(f"the reference runs in {dtype_name(reference.dtype)}, but the store's namespace is for "
                         f"{namespace.dtype} (values are filed by the dtype they were computed in): load it in "
                         f"{namespace.dtype}, or open the store under the namespace of {dtype_name(reference.dtype)}")


@dataclass
class _Scoring:
    """One pass's batches scored into a shard writer, and its counts: pairs ``computed`` (those
    with a NaN or inf among them, listed in ``non_finite`` and not stored), ``skipped`` (written
    by another build in this directory since the pass began) and the real ``tokens`` scored."""

    reference: ReferenceModel | None
    store: CacheStore
    options: BuildOptions
    max_tokens: int | None
    start: float
    computed: int = 0
    skipped: int = 0
    tokens: int = 0
    non_finite: list[TokenizedPair] = field(default_factory=list)

    def score(self, batch: Sequence[TokenizedPair], laid, writer: ShardWriter) -> None:
        """Score the pairs of ``batch`` the store lacks (``laid``: the whole batch laid out ahead)."""
        per_token, pad_id = self.options.per_token, self.options.pad_id
        # A build running at once in this directory may have written these since: each flush
        # and exchange (concurrent_builds) adopts its shards, so they are not computed twice.
        scored = [p for p in batch if not self.store.has(p.key, per_token)]
        self.skipped += len(batch) - len(scored)
        if not scored:
            return
        whole = laid if len(scored) == len(batch) else None
        values = score_batch(self.reference, scored, pad_id, self.max_tokens, whole)
        scored, values, bad = _finite_only(scored, values)
        self.non_finite += bad
        if scored:
            writer.add([p.key for p in scored], values if per_token else values.sums_only())
        self.computed += len(scored) + len(bad)
        self.tokens += sum(p.unique_tokens for p in scored)

    def tokens_per_s(self) -> float:
        return self.tokens / max(1e-9, time.perf_counter() - self.start)


def _score_shared(shared: SharedBuild, batches: list[list[TokenizedPair]], scoring: _Scoring, writer: ShardWriter,
                  bar: tqdm, stop: StopRequest, siblings: int = 0) -> None:
    """Score ``batches`` chunk by chunk as ``shared`` hands them out (each claimed from the other
    builds running at once in this directory), until done or ``stop``. ``siblings``: the other
    ranks of this build, which hold slots too but are not other builds."""
    others = shared.slot if not siblings else max(0, shared.others_running() - siblings)
    if others and scoring.options.show_progress:
        cpu = " and the CPU's threads" if shared.cpu_threads is not None else ""
        bar.write(f"cache: another build of this cache is running: they split the pairs (each claims a chunk "
                  f"before scoring it){cpu}", file=sys.stderr)  # above the bar, not after it
    with contextlib.closing(shared.chunks(batches)) as chunks:
        for chunk in chunks:
            shared.exchange(writer, scoring.store)
            for batch, laid in laid_out_ahead(scoring.reference, chunk, scoring.options.pad_id, scoring.max_tokens):
                if stop:
                    return
                scoring.score(batch, laid, writer)
                bar.update(len(batch))
                bar.set_postfix(tok_s=f"{scoring.tokens_per_s():.0f}", refresh=False)
            shared.exchange(writer, scoring.store)  # before its claim is let go


def score_missing(
    store: CacheStore,
    pairs: Sequence[TokenizedPair],
    load_reference: Callable[[], ReferenceModel],
    stop: StopRequest,
    options: BuildOptions,
    update_manifest: bool = True,
    siblings: int | None = 0,
) -> BuildSummary:
    """``build_missing``'s work, stopping when ``stop`` is set: the summary then counts the pairs
    computed (and flushed) before the signal, and ``interrupted`` names it. The caller decides
    what a stop means (``build_distributed`` first agrees on it with the other ranks).
    ``siblings``: the other ranks of a distributed build (each scoring its own share, claiming
    its chunks from other builds in the directory as one process does, the CPU's threads left
    as torchrun set them); None: a share that claims nothing (a sharded reference's ranks run
    every forward together, and one waiting for another build's chunk would hold up the rest)."""
    start = time.perf_counter()
    by_key = unique_pairs(pairs)
    per_token, max_tokens = options.per_token, options.max_tokens
    todo = [by_key[k] for k in store.missing(by_key, per_token)]
    again = _held_as_sums(store, [p.key for p in todo]) if per_token else 0
    reference = load_reference() if todo else None
    if reference is not None:
        check_reference(store, reference)
        check_pairs_fit(todo, reference, options.pad_id)
        max_tokens = max_tokens or default_max_tokens(reference.device)
        reference.prepare(sum(p.unique_tokens for p in todo))  # --compile auto: compile if the pass repays it
    scoring = _Scoring(reference, store, options, max_tokens, start)
    if todo:
        writer = store.writer(options.shard_pairs, options.flush_seconds, update_manifest)
        bar = tqdm(total=len(todo), unit="pairs", desc="reference log-probs", disable=not options.show_progress,
                   dynamic_ncols=True)
        # A signal only sets ``stop`` here: a batch is scored and added whole, never half.
        on_cpu = torch.device(reference.device).type == "cpu"
        with stop.deferred(), shared_build(store.dir, stop, enabled=siblings is not None,
                                           on_cpu=on_cpu and siblings == 0) as shared:
            try:
                _score_shared(shared, reference_batches(reference, todo, max_tokens), scoring, writer, bar, stop,
                              siblings or 0)
            finally:
                # Whatever was computed before a signal or an error is kept.
                writer.flush()
                bar.close()
    if scoring.non_finite:
        raise CacheError(_non_finite_message(scoring.non_finite, scoring.computed, store))
    seconds = time.perf_counter() - start
    device = reference.device if reference is not None else None
    return BuildSummary(
        # Pairs another build wrote while this one ran count as reused.
        pairs=len(pairs), unique=len(by_key), computed=scoring.computed,
        reused=len(by_key) - len(todo) + scoring.skipped, tokens=scoring.tokens, seconds=seconds,
        tokens_per_s=scoring.tokens / seconds if scoring.tokens else 0.0, peak_memory_bytes=peak_memory_bytes(device),
        cache_dir=str(store.dir), namespace=store.namespace.id,
        forward_passes=reference.forward_passes if reference is not None else 0,
        corrupt_shards=[str(c) for c in store.corrupt], interrupted=stop.signum or 0,
        layout=reference.layout_choice.to_json() if reference is not None else None,
        compiled_layers=reference.compiled_layers if reference is not None else 0,
        max_tokens=max_tokens if reference is not None else None,
        kernels=_kernels_json(reference),
        streamed=reference.streamed.to_json() if reference is not None and reference.streamed is not None else None,
        per_token_again=again,
    )


def _held_as_sums(store: CacheStore, keys: Sequence[bytes]) -> int:
    """How many of ``keys`` (pairs lacking per-token values) the cache holds as sums alone."""
    return sum(k in store for k in keys)


def _kernels_json(reference: ReferenceModel | None) -> dict | None:
    """The kernels of the pass's reference, for the summary (None: no pass ran, or none chosen)."""
    choice = reference.kernels if reference is not None else None
    return choice.to_json() if choice is not None else None


def _any_rank_choices(env: DistEnv, layout: dict | None, kernels: dict | None) -> tuple[dict | None, dict | None]:
    """The layout and kernels of a rank whose reference pass ran (every rank applies the same
    rules to the same model), in one collective: every rank calls it."""
    if not env.enabled:
        return layout, kernels
    gathered = [None] * env.world_size
    torch.distributed.all_gather_object(gathered, (layout, kernels))
    return next((x for x in gathered if x[0] is not None), (None, None))


def interrupted_message(summary: BuildSummary) -> str:
    """The line a stopped build ends with: what was saved, what remains. Said of ``cache build``
    and of ``train``'s own reference pass alike: the same command, run again, reuses what was saved."""
    missing = summary.unique - summary.reused
    return (f"{summary.computed} of the {missing} pairs the cache lacked were computed and saved in "
            f"{summary.cache_dir}; run the same command again to compute the other {missing - summary.computed}")


def _finite_only(batch: list[TokenizedPair],
                 values: PairValues) -> tuple[list[TokenizedPair], PairValues, list[TokenizedPair]]:
    """``(kept pairs, their values, pairs with a NaN or inf)`` of one scored batch: a
    non-finite reference value is never stored (it would poison every later run)."""
    ok = values.finite()  # (B,)
    if bool(ok.all()):
        return batch, values, []
    keep = ok.nonzero().flatten().tolist()
    return [batch[i] for i in keep], values.select(keep), [p for p, good in zip(batch, ok.tolist()) if not good]


def _non_finite_message(bad: list[TokenizedPair], scored: int, store: CacheStore) -> str:
    bad = sorted(bad, key=lambda p: p.index)
    first = ", ".join(f"row {p.index} (key {p.key.hex()[:12]})" for p in bad[:5])
    return (f"the reference gave NaN or inf log-probs for {len(bad)} of {scored} pairs scored: {first}"
            f"{', ...' if len(bad) > 5 else ''}; none of them were stored in {store.dir} (the others were). Check the "
            "model's weights for NaN/inf, and try --dtype float32 if a half-precision forward overflows.")


# ------------------------------------------------------------------------------- distributed


def split_by_tokens(pairs: Sequence[TokenizedPair], world_size: int) -> list[list[TokenizedPair]]:
    """Each rank's share of ``pairs``, balanced by the tokens the reference runs on (both
    sequences of a pair, as the padded layout runs them), not by row count: a share of long
    pairs costs more than one of short pairs. Deterministic (ties broken by example key), so
    every rank computes the same split with no communication; every pair is in exactly one
    share."""
    return split_by_weight(pairs, world_size, weight=lambda p: p.num_tokens, tiebreak=lambda p: p.key)


def _keys_digest(keys: Sequence[bytes]) -> int:
    """62 bits of a hash of a key list, to check that every rank sees the same work."""
    h = hashlib.blake2b(digest_size=8)
    h.update(len(keys).to_bytes(8, "little"))
    for k in keys:
        h.update(k)
    return int.from_bytes(h.digest(), "little") >> 2


def build_distributed(
    store: CacheStore,
    pairs: Sequence[TokenizedPair],
    load_reference: Callable[[], ReferenceModel],
    env: DistEnv,
    options: BuildOptions | None = None,
    **fields,
) -> BuildSummary:
    """``build_missing`` over every rank of ``env`` (a world of one is exactly ``build_missing``
    with the store opened and bad shards quarantined first).

    Every rank must call it with the same pairs and an unopened (or stale) ``store`` on a
    directory all ranks share. Rank 0 opens the store first (quarantining bad shards, adopting
    orphan shards of a killed build), then the others open it; each rank computes the same
    missing keys and the same token-balanced split (``split_by_tokens``), scores its share and
    writes its own shards without touching the manifest (names are content-addressed: no two
    ranks can write the same file). Only counters are reduced. Afterwards rank 0 re-opens the
    store, which adopts every rank's shards, writes the manifest once, and checks that every
    pair has a value. On return rank 0's ``store`` holds every pair; other ranks must
    ``store.open()`` to see the new shards. The summary holds totals over ranks.

    SIGTERM or SIGINT on any rank ends that rank's scoring after the batch in flight; once the
    others are done (or stopped too), every rank's shards are in the manifest and every rank
    raises ``signals.Interrupted``.

    ``options.sharded``: ``load_reference`` returns a ``dpocache.distributed.sharded_reference.ShardedReference`` (its
    weights sharded over the ranks), loaded on every rank and drained (``build_share_sharded``).
    """
    # Every rank stops at the same place: a stop signal (torchrun forwards SIGTERM to every
    # worker; a scheduler may signal one) only ends a rank's scoring loop, and the ranks agree
    # on it in the reduction below, so none waits forever in a collective another left.
    with stop_signals() as stop, stop.deferred() if env.enabled else contextlib.nullcontext():
        return _build_shares(store, pairs, load_reference, env, stop, with_fields(BuildOptions, options, fields))


def _build_shares(store: CacheStore, pairs: Sequence[TokenizedPair], load_reference: Callable[[], ReferenceModel],
                  env: DistEnv, stop: StopRequest, options: BuildOptions) -> BuildSummary:
    start = time.perf_counter()
    if env.is_main:
        store.open(repair=True)
    corrupt = [str(c) for c in store.corrupt]
    barrier(env)  # the others read the store only after rank 0 has quarantined and rewritten
    if not env.is_main:
        store.open()
    by_key = unique_pairs(pairs)
    todo_keys = store.missing(by_key, options.per_token)
    again = _held_as_sums(store, todo_keys) if options.per_token else 0  # before the pass adds them
    if todo_keys and not len(store) and options.show_progress and env.is_main:
        _say_why_new(store)
    if again and options.show_progress and env.is_main:
        print(f"cache: {again:,} of the {len(by_key):,} pairs are cached without per-token values, which this run "
              "stores (cache build --per-token, or a loss with ld_alpha); they are scored again (their sums stay "
              "the same)", file=sys.stderr)
    differing = differing_on_ranks(env, {"namespace": store.namespace.id, "missing": _keys_digest(todo_keys)})
    if "namespace" in differing:
        # Each rank would read another reference's values from its own namespace, even with a complete cache.
        raise CacheError(f"ranks disagree on the reference's namespace ({store.namespace.id} on rank {env.rank}): "
                         "its weights, config or adapter differ between machines; every rank must load the same "
                         "reference model")
    if differing:
        raise CacheError("ranks disagree on which pairs the cache lacks: every rank must load the same data with the "
                         "same tokenizer and length limits, and see the same cache directory")
    # The namespace's own directory too: a colleague's, in a cache whose top this user may write.
    unwritten = next(((d, why) for d in (store.root, store.dir) if (why := unwritable(d)) is not None), None) \
        if todo_keys else None
    if unwritten is not None:  # every rank alike: each sees the same directory and the same pairs missing
        where, read_only = unwritten
        there = "there" if where == store.root else f"to its namespace directory {where.name}"
        raise UsageError(f"--cache-dir {store.root}: cannot write {there} ({read_only}), and {len(todo_keys)} of the "
                         f"{len(by_key)} pairs are not in it; build them into a cache that can be written, one "
                         f"that links every value already there: cp -rs {store.root} DIR, then dpocache cache build "
                         "--cache-dir DIR and read from that one")
    if todo_keys and env.enabled:
        check_one_directory(store.root, env)  # before the pass, not after it
    mine = split_by_tokens([by_key[k] for k in todo_keys], env.world_size)[env.rank]
    options = replace(options, show_progress=options.show_progress and env.is_main)
    local, error = None, None
    try:
        sharded = options.sharded and env.enabled

        def build_share(load):
            return score_missing(store, mine, load, stop, options, update_manifest=not env.enabled,
                                 siblings=None if sharded else env.world_size - 1)

        if sharded:
            local = build_share_sharded(build_share, load_reference, bool(todo_keys), options.pad_id)
        else:
            local = build_share(load_reference)
    except Exception as e:  # noqa: BLE001 - re-raised below, after the other ranks learn of it
        error = e
    # Also the synchronisation point: every rank's shards are flushed and renamed into place.
    # A share's reused pairs are those another build in this directory wrote while it ran.
    computed, reused, tokens, passes, failed = reduce_counts(env, [
        local.computed if local else 0, local.reused if local else 0, local.tokens if local else 0,
        local.forward_passes if local else 0, 1.0 if error else 0.0])
    peak, signum = reduce_counts(env, [local.peak_memory_bytes if local else 0, stop.signum or 0], op="max")
    if error is not None:
        raise error
    if failed:
        raise CacheError(f"{int(failed)} of {env.world_size} ranks failed while building the reference cache (their "
                         "errors are above); what they computed before failing is kept: run the build again to resume")
    problem = None
    if env.is_main and env.enabled:
        store.open(repair=True)  # adopts every rank's new shards; writes the manifest (once, here)
        problem = None if signum else _missing_after_build(store, by_key, options.per_token)
    problem = broadcast_object(env, problem)
    if problem:
        raise CacheError(problem)
    layout, kernels = _any_rank_choices(env, local.layout if local else None, local.kernels if local else None)
    seconds = time.perf_counter() - start
    summary = BuildSummary(
        pairs=len(pairs), unique=len(by_key), computed=int(computed),
        reused=len(by_key) - len(todo_keys) + int(reused),
        tokens=int(tokens), seconds=seconds, tokens_per_s=tokens / seconds if tokens else 0.0,
        peak_memory_bytes=int(peak), cache_dir=str(store.dir), namespace=store.namespace.id,
        forward_passes=int(passes),
        corrupt_shards=corrupt, world_size=env.world_size, interrupted=int(signum),
        layout=layout, kernels=kernels,  # a rank's whose pass ran (every rank decides alike)
        compiled_layers=local.compiled_layers if local else 0,  # this rank's (each rank decides alike)
        max_tokens=local.max_tokens if local else None,
        streamed=local.streamed if local else None,  # this rank's (each rank streams alike)
        per_token_again=again,  # every rank alike
    )
    if signum:
        stopped = stop.interrupted(interrupted_message(summary), signum=int(signum))
        stopped.summary = summary  # for a caller that reports it (cache build --json)
        raise stopped
    return summary


PROBE_WAIT_S = 90.0  # how long a rank looks for the others' probes: NFS caches a name not found for up to 60 s


def check_one_directory(cache_dir: Path, env: DistEnv, wait_s: float | None = None) -> None:
    """Every rank writes a probe file into ``cache_dir`` and looks for the others': a directory
    of the same name on each node's own disk (``--cache-dir /scratch/cache``) let every rank
    score its share and write it where rank 0 never sees it, which was found only after the
    whole reference pass. ``CacheError`` on every rank, naming the ranks not seen, before any
    pair is scored. Waits up to ``wait_s`` (``PROBE_WAIT_S``) for a shared file system's
    caches, only where a probe is missing."""
    token = broadcast_object(env, os.urandom(6).hex() if env.is_main else None)
    probe = Path(cache_dir) / f".rank-probe-{token}-{env.rank}"
    Path(cache_dir).mkdir(parents=True, exist_ok=True)
    probe.touch()
    barrier(env)
    deadline = time.monotonic() + (PROBE_WAIT_S if wait_s is None else wait_s)
    while True:
        unseen = [r for r in range(env.world_size) if not (Path(cache_dir) / f".rank-probe-{token}-{r}").exists()]
        if not unseen or time.monotonic() >= deadline:
            break
        time.sleep(2.0)
    (blind,) = reduce_counts(env, [float(bool(unseen))])
    barrier(env)  # every rank has looked before any probe goes
    probe.unlink(missing_ok=True)
    if blind:
        seen = f"rank {env.rank} does not see rank {', '.join(map(str, unseen))}'s" if unseen else \
            f"{int(blind)} of the {env.world_size} ranks do not see the others'"
        raise CacheError(f"--cache-dir {cache_dir}: {seen} files there: each node has a directory of its own under "
                         "that name, where every rank writes its share of the reference values for rank 0 to read; "
                         "give --cache-dir a directory on storage every node shares (nothing was computed)")


def _missing_after_build(store: CacheStore, by_key: dict[bytes, TokenizedPair], per_token: bool) -> str | None:
    missing = store.missing(by_key, per_token)
    if not missing:
        return None
    first = ", ".join(k.hex()[:12] for k in missing[:5])
    return (f"after the distributed build, {len(missing)} of {len(by_key)} pairs still have no cached value in "
            f"{store.dir} (keys {first}{', ...' if len(missing) > 5 else ''}). A rank's shards are not visible "
            "to rank 0: the cache directory must be one shared directory for every node (or build on one node "
            "and copy it), and no rank may fail silently. Run the build again to compute what is missing.")


# ------------------------------------------------------------------------------------ verify


@dataclass
class VerifyReport:
    checked: int
    max_abs_diff: float
    mismatches: list[str]
    corrupt_shards: list[CorruptShard]
    missing: int

    @property
    def ok(self) -> bool:
        return not self.mismatches and not self.corrupt_shards and self.missing == 0


def tolerance(dtype: str, value: float) -> float:
    """How far a recomputation may drift from the stored sum: batch composition and padding
    change kernel shapes, which changes float rounding (more so in bf16)."""
    if dtype == "float32":
        return 1e-3 + 1e-4 * abs(value)
    return 0.25 + 2e-2 * abs(value)


def verify(store: CacheStore, pairs: Sequence[TokenizedPair], reference: ReferenceModel, samples: int = 32,
           seed: int = 0, pad_id: int = 0, max_tokens: int | None = None) -> VerifyReport:
    """Recompute ``samples`` cached pairs (chosen at random) and compare with the store."""
    by_key = unique_pairs(pairs)
    cached = [p for k, p in by_key.items() if k in store]
    missing = len(by_key) - len(cached)
    chosen = random.Random(seed).sample(cached, min(samples, len(cached)))
    mismatches: list[str] = []
    max_diff = 0.0
    max_tokens = max_tokens or default_max_tokens(reference.device)
    for batch in reference_batches(reference, chosen, max_tokens):
        new_values = score_batch(reference, batch, pad_id, max_tokens)
        cs, rs = new_values.chosen_logps, new_values.rejected_logps
        stored = store.lookup([p.key for p in batch])
        for i, p in enumerate(batch):
            for side, new, old in (("chosen", cs[i], stored.chosen_logps[i]),
                                   ("rejected", rs[i], stored.rejected_logps[i])):
                new, old = float(new), float(old)
                # NaN compares false with everything: a NaN on either side is a mismatch, never "diff 0".
                finite = math.isfinite(new) and math.isfinite(old)
                diff = abs(new - old) if finite else math.inf
                max_diff = max(max_diff, diff)
                if diff > tolerance(store.namespace.dtype, old if finite else 0.0):
                    note = "" if finite else " (not finite)"
                    mismatches.append(f"row {p.index} key {p.key.hex()} {side}: stored {old:.6f}, "
                                      f"recomputed {new:.6f}{note}")
    return VerifyReport(len(chosen), max_diff, mismatches, list(store.corrupt), missing)


# ------------------------------------------------------------------------------------ export


def export_rows(store: CacheStore, pairs: Sequence[TokenizedPair], with_ids: bool = False):
    """One dict per pair, in data order (see the ``cache export`` command)."""
    values = store.lookup([p.key for p in pairs])
    for i, p in enumerate(pairs):
        row = {
            "index": p.index, "key": p.key.hex(),
            "chosen_logps": float(values.chosen_logps[i]), "rejected_logps": float(values.rejected_logps[i]),
            "chosen_tokens": int(values.chosen_tokens[i]), "rejected_tokens": int(values.rejected_tokens[i]),
        }
        if with_ids:
            row.update(prompt_ids=list(p.prompt_ids), chosen_ids=list(p.chosen_ids), rejected_ids=list(p.rejected_ids))
        yield row


# ------------------------------------------------------------------------------------ info


SAVED_AGAIN = ("a model saved again (another shard size, another file beside its weights) or trained is another "
               "namespace, its weights identified by their files' bytes (docs/cache.md)")


def _say_why_new(store: CacheStore) -> None:
    """A line where an empty namespace about to be filled has the model's values beside it in
    another dtype, or another model's of the same config (each namespace's manifest read once)."""
    others = _other_namespaces(store)
    in_other_dtype, similar = other_dtype_elsewhere(store, others), same_config_elsewhere(store, others)
    if in_other_dtype is not None:
        print(f"cache: namespace {in_other_dtype.id} holds this model's values in {in_other_dtype.dtype}; this run "
              f"computes them in {store.namespace.dtype} (--dtype {in_other_dtype.dtype} reads those)",
              file=sys.stderr)
    elif similar is not None:
        print(f"cache: no values here are of these weights ({store.namespace.model}); namespace {similar.id} "
              f"({similar.model}) has the same config and dtype and other weight files: {SAVED_AGAIN}",
              file=sys.stderr)


def same_config_elsewhere(store: CacheStore, others: list[Namespace] | None = None) -> Namespace | None:
    """Another namespace of the cache (``others``: its namespaces, read here if None) with
    ``store``'s config and dtype and other weights, or None: why a model the user thinks cached
    starts a new namespace."""
    ns = store.namespace
    return next((other for other in (_other_namespaces(store) if others is None else others)
                 if (other.config_sha256, other.dtype) == (ns.config_sha256, ns.dtype)
                 and other.weights_sha256 != ns.weights_sha256), None)


def other_dtype_elsewhere(store: CacheStore, others: list[Namespace] | None = None) -> Namespace | None:
    """A namespace of the cache (``others`` as above) with ``store``'s weights and config in
    another dtype, or None: the values a run in that dtype computed (``--dtype auto`` chooses by
    device: a login node's CPU and a GPU node choose differently)."""
    ns = store.namespace
    return next((other for other in (_other_namespaces(store) if others is None else others)
                 if (other.weights_sha256, other.config_sha256) == (ns.weights_sha256, ns.config_sha256)
                 and other.dtype != ns.dtype), None)


def _other_namespaces(store: CacheStore) -> list[Namespace]:
    """The namespaces of the cache's other directories, as their manifests record them (no shard opened)."""
    found = []
    for ns_dir in namespace_dirs(store.root):
        if ns_dir == store.dir:
            continue
        try:
            _, recorded, _ = parse_manifest(read_regular_file(ns_dir / MANIFEST, MAX_MANIFEST_BYTES), ns_dir.name)
        except (OSError, UnsafeFileError):
            continue
        if recorded is not None:
            found.append(recorded)
    return found


def namespace_dirs(cache_dir: Path) -> list[Path]:
    """The namespace directories under ``cache_dir``: those holding pair values (a manifest or
    shards) or look-aside values (``sequences/``, ``dpocache.cache.sequences``)."""
    if not cache_dir.exists():
        return []
    return sorted(p for p in cache_dir.iterdir()
                  if p.is_dir() and (has_pair_values(p) or (p / SEQUENCES).is_dir()))


def has_pair_values(ns_dir: Path) -> bool:
    """Whether a namespace directory holds the pair cache's values (a manifest or shards)."""
    return (ns_dir / MANIFEST).exists() or any(ns_dir.glob("shard-*"))


def open_namespace_dir(ns_dir: Path) -> CacheStore:
    """Open an existing namespace directory, described by its manifest's namespace record when
    that is sound (``CacheStore`` checks the manifest and every shard against the directory's
    name, which is authoritative)."""
    store = CacheStore(ns_dir.parent, Namespace("?", "?", "?", model="(no sound manifest)"))
    store.dir = ns_dir
    store.open()
    if store.recorded_namespace is not None:
        store.namespace = store.recorded_namespace
    return store
