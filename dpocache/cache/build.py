"""Build, verify and export the reference cache.

``build_missing`` is incremental by construction: it looks every pair's key up in the store and
runs the reference only on the keys it lacks, so shuffled, subset, appended or re-truncated data
reuses every value already computed. The reference model is loaded only if something is
missing: a complete cache costs no model load and no forward pass.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import resource
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch
from tqdm.auto import tqdm

from ..batching import PairBatch, collate_pairs, pair_logprobs, token_budget_batches
from ..data import TokenizedPair
from ..distributed import DistEnv, barrier, broadcast_object, reduce_counts, same_on_all_ranks, split_by_weight
from ..reference import ReferenceModel, dtype_name
from .fingerprint import FingerprintMemo, default_memo_path, model_dir_fingerprint, module_fingerprint
from .store import CacheError, CacheStore, CorruptShard, Namespace

DEFAULT_MAX_TOKENS = 4096  # padded token slots per reference forward (bench/: best on CPU; GPUs like more)


def default_cache_dir() -> Path:
    """``$DPOCACHE_CACHE_DIR``, else ``$XDG_CACHE_HOME/dpocache``, else ``~/.cache/dpocache``."""
    if os.environ.get("DPOCACHE_CACHE_DIR"):
        return Path(os.environ["DPOCACHE_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "dpocache"


def reference_weights_dir(model_path: str | Path) -> Path:
    """The directory whose weights are the reference: for a PEFT adapter directory, its base
    model (the reference of a LoRA policy is the base with the adapter off)."""
    path = Path(model_path)
    adapter_config = path / "adapter_config.json"
    if adapter_config.exists():
        base = json.loads(adapter_config.read_text()).get("base_model_name_or_path")
        if not base or not Path(base).is_dir():
            raise FileNotFoundError(f"{adapter_config}: base_model_name_or_path '{base}' is not a local directory")
        return Path(base)
    return path


def namespace_for_dir(model_path: str | Path, dtype: torch.dtype, cache_dir: Path) -> Namespace:
    weights_dir = reference_weights_dir(model_path)
    fp = model_dir_fingerprint(weights_dir, FingerprintMemo(default_memo_path(cache_dir)))
    return Namespace(fp["weights_sha256"], fp["config_sha256"], dtype_name(dtype), model=str(weights_dir.resolve()))


def namespace_for_module(model: torch.nn.Module, dtype: torch.dtype) -> Namespace:
    fp = module_fingerprint(model)
    return Namespace(fp["weights_sha256"], fp["config_sha256"], dtype_name(dtype), model=f"<in memory {type(model).__name__}>")


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

    def to_json(self) -> dict:
        return asdict(self)


def unique_pairs(pairs: Sequence[TokenizedPair]) -> dict[bytes, TokenizedPair]:
    out: dict[bytes, TokenizedPair] = {}
    for p in pairs:
        out.setdefault(p.key, p)
    return out


def score_batch(reference: ReferenceModel, batch: Sequence[TokenizedPair], pad_id: int):
    """Reference values of one batch: (sums and counts ``(B,)``, per-token lists), in the
    reference's layout (``ReferenceModel.layout``)."""
    if getattr(reference, "layout", "padded") == "shared":
        from ..prefix import score_batch_shared

        return score_batch_shared(reference, batch, pad_id)
    pb: PairBatch = collate_pairs(batch, pad_id)
    token_logps = reference.logprobs(pb.input_ids, pb.attention_mask, pb.completion_mask).cpu()  # (2B, T)
    mask = pb.completion_mask.bool()
    sums = token_logps.sum(-1)  # (2B,)
    counts = pb.completion_mask.sum(-1)  # (2B,)
    per_token = [token_logps[i][mask[i]] for i in range(token_logps.shape[0])]
    b = len(batch)
    return sums[:b], sums[b:], counts[:b], counts[b:], per_token[:b], per_token[b:]


def reference_batches(reference: ReferenceModel, pairs: Sequence[TokenizedPair], max_tokens: int) -> list[list[TokenizedPair]]:
    """Length-grouped batches under ``max_tokens`` padded slots, for the reference's layout."""
    return token_budget_batches(pairs, max_tokens, layout=getattr(reference, "layout", "padded"))


def build_missing(
    store: CacheStore,
    pairs: Sequence[TokenizedPair],
    load_reference: Callable[[], ReferenceModel],
    pad_id: int = 0,
    per_token: bool = False,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    shard_pairs: int = 4096,
    flush_seconds: float = 60.0,
    show_progress: bool = True,
    update_manifest: bool = True,
) -> BuildSummary:
    """Compute and store the reference values of every pair ``store`` lacks."""
    start = time.perf_counter()
    by_key = unique_pairs(pairs)
    todo = [by_key[k] for k in store.missing(by_key, per_token)]
    reference = load_reference() if todo else None
    tokens = 0
    if todo:
        writer = store.writer(shard_pairs, flush_seconds, update_manifest)
        bar = tqdm(total=len(todo), unit="pairs", desc="reference log-probs", disable=not show_progress, dynamic_ncols=True)
        try:
            for batch in reference_batches(reference, todo, max_tokens):
                cs, rs, cn, rn, cpt, rpt = score_batch(reference, batch, pad_id)
                writer.add([p.key for p in batch], cs, rs, cn, rn, cpt if per_token else None, rpt if per_token else None)
                tokens += sum(p.unique_tokens for p in batch)
                bar.update(len(batch))
                bar.set_postfix(tok_s=f"{tokens / max(1e-9, time.perf_counter() - start):.0f}", refresh=False)
        finally:
            # Whatever was computed before an error or Ctrl-C is kept.
            writer.flush()
            bar.close()
    seconds = time.perf_counter() - start
    device = reference.device if reference is not None else None
    return BuildSummary(
        pairs=len(pairs), unique=len(by_key), computed=len(todo), reused=len(by_key) - len(todo), tokens=tokens,
        seconds=seconds, tokens_per_s=tokens / seconds if tokens else 0.0, peak_memory_bytes=peak_memory_bytes(device),
        cache_dir=str(store.dir), namespace=store.namespace.id,
        forward_passes=reference.forward_passes if reference is not None else 0,
        corrupt_shards=[str(c) for c in store.corrupt],
    )


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
    pad_id: int = 0,
    per_token: bool = False,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    shard_pairs: int = 4096,
    flush_seconds: float = 60.0,
    show_progress: bool = True,
    sharded: bool = False,
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

    ``sharded``: ``load_reference`` returns a ``dpocache.sharded.ShardedReference`` (its
    weights sharded over the ranks), loaded on every rank and drained (``build_share_sharded``).
    """
    start = time.perf_counter()
    if env.is_main:
        store.open(repair=True)
    corrupt = [str(c) for c in store.corrupt]
    barrier(env)  # the others read the store only after rank 0 has quarantined and rewritten
    if not env.is_main:
        store.open()
    by_key = unique_pairs(pairs)
    todo_keys = store.missing(by_key, per_token)
    if not same_on_all_ranks(env, _keys_digest(todo_keys)):
        raise CacheError("ranks disagree on which pairs the cache lacks: every rank must load the same data with the "
                         "same tokenizer and length limits, and see the same cache directory")
    mine = split_by_tokens([by_key[k] for k in todo_keys], env.world_size)[env.rank]
    local, error = None, None
    try:
        def build_share(load):
            return build_missing(store, mine, load, pad_id=pad_id, per_token=per_token, max_tokens=max_tokens,
                                 shard_pairs=shard_pairs, flush_seconds=flush_seconds,
                                 show_progress=show_progress and env.is_main, update_manifest=not env.enabled)

        if sharded and env.enabled:
            from ..sharded import build_share_sharded

            local = build_share_sharded(build_share, load_reference, bool(todo_keys), pad_id)
        else:
            local = build_share(load_reference)
    except Exception as e:  # noqa: BLE001 - re-raised below, after the other ranks learn of it
        error = e
    # Also the synchronisation point: every rank's shards are flushed and renamed into place.
    computed, tokens, passes, failed = reduce_counts(env, [
        local.computed if local else 0, local.tokens if local else 0, local.forward_passes if local else 0,
        1.0 if error else 0.0])
    (peak,) = reduce_counts(env, [local.peak_memory_bytes if local else 0], op="max")
    if error is not None:
        raise error
    if failed:
        raise CacheError(f"{int(failed)} of {env.world_size} ranks failed while building the reference cache (their "
                         "errors are above); what they computed before failing is kept: run the build again to resume")
    problem = None
    if env.is_main and env.enabled:
        store.open(repair=True)  # adopts every rank's new shards; writes the manifest (once, here)
        problem = _missing_after_build(store, by_key, per_token)
    problem = broadcast_object(env, problem)
    if problem:
        raise CacheError(problem)
    seconds = time.perf_counter() - start
    return BuildSummary(
        pairs=len(pairs), unique=len(by_key), computed=int(computed), reused=len(by_key) - len(todo_keys),
        tokens=int(tokens), seconds=seconds, tokens_per_s=tokens / seconds if tokens else 0.0,
        peak_memory_bytes=int(peak), cache_dir=str(store.dir), namespace=store.namespace.id, forward_passes=int(passes),
        corrupt_shards=corrupt, world_size=env.world_size,
    )


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
           seed: int = 0, pad_id: int = 0, max_tokens: int = DEFAULT_MAX_TOKENS) -> VerifyReport:
    """Recompute ``samples`` cached pairs (chosen at random) and compare with the store."""
    by_key = unique_pairs(pairs)
    cached = [p for k, p in by_key.items() if k in store]
    missing = len(by_key) - len(cached)
    chosen = random.Random(seed).sample(cached, min(samples, len(cached)))
    mismatches: list[str] = []
    max_diff = 0.0
    for batch in reference_batches(reference, chosen, max_tokens):
        cs, rs, *_ = score_batch(reference, batch, pad_id)
        stored = store.lookup([p.key for p in batch])
        for i, p in enumerate(batch):
            for side, new, old in (("chosen", cs[i], stored.chosen_logps[i]), ("rejected", rs[i], stored.rejected_logps[i])):
                diff = abs(float(new) - float(old))
                max_diff = max(max_diff, diff)
                if diff > tolerance(store.namespace.dtype, float(old)):
                    mismatches.append(f"row {p.index} key {p.key.hex()} {side}: stored {float(old):.6f}, recomputed {float(new):.6f}")
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


def namespace_dirs(cache_dir: Path) -> list[Path]:
    if not cache_dir.exists():
        return []
    return sorted(p for p in cache_dir.iterdir() if p.is_dir() and ((p / "manifest.json").exists() or any(p.glob("shard-*"))))


def open_namespace_dir(ns_dir: Path) -> CacheStore:
    """Open an existing namespace directory by reading its manifest's namespace record."""
    manifest_path = ns_dir / "manifest.json"
    record = {}
    if manifest_path.exists():
        try:
            record = json.loads(manifest_path.read_text()).get("namespace", {})
        except json.JSONDecodeError:
            record = {}
    ns = Namespace(**record) if record else Namespace("?", "?", "?", model="(manifest unreadable)")
    store = CacheStore(ns_dir.parent, ns)
    store.dir = ns_dir  # the directory name is authoritative even if the record is damaged
    return store.open()
