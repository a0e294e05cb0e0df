"""The on-disk reference cache: content-addressed safetensors shards plus a JSON manifest.

Layout::

    CACHE_DIR/
      fingerprints.json                   memo of weight-file hashes (path, size, mtime → sha256)
      <namespace id>/
        manifest.json                     namespace in words, shards with sha256 and counts
        shard-<sha256[:16]>.safetensors   one flushed batch of pairs

A shard's name carries the start of its own SHA-256, so a shard written by a build that died
before updating the manifest (or by another rank) is still verifiable, and is adopted on the
next open. Every shard's checksum is checked before its values are used; one that fails is
reported by name and never loaded.

Shard tensors (n pairs; per-token arrays only in per-token shards)::

    keys                 (n, 16) uint8   example keys (data.example_key)
    chosen_logps         (n,)    float32 sum of completion-token log-probs
    rejected_logps       (n,)    float32
    chosen_tokens        (n,)    int32   completion token counts
    rejected_tokens      (n,)    int32
    chosen_token_logps   (sum chosen_tokens,)   float32, pair after pair
    rejected_token_logps (sum rejected_tokens,) float32
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from ..data import KEY_BYTES
from .atomic import atomic_write_bytes, atomic_write_text

SCHEMA_VERSION = 1
MANIFEST = "manifest.json"


class CacheError(RuntimeError):
    pass


class MissingReferenceError(CacheError):
    def __init__(self, missing: int, total: int, namespace_dir: Path):
        self.missing = missing
        super().__init__(
            f"{missing} of {total} pairs have no cached reference log-probs in {namespace_dir}. "
            "Build them with: dpocache cache build --model <reference model> --data <data> "
            f"--cache-dir {namespace_dir.parent} (same --max-length and --dtype)"
        )


@dataclass(frozen=True)
class Namespace:
    """Everything besides the example itself that changes a reference value."""

    weights_sha256: str
    config_sha256: str
    dtype: str
    model: str = ""  # where the weights were read from: for people, not hashed
    schema: int = SCHEMA_VERSION

    @property
    def id(self) -> str:
        hashed = {"weights": self.weights_sha256, "config": self.config_sha256, "dtype": self.dtype, "schema": self.schema}
        return hashlib.sha256(json.dumps(hashed, sort_keys=True).encode()).hexdigest()[:20]


@dataclass
class ShardInfo:
    file: str
    sha256: str
    pairs: int
    per_token: bool
    bytes: int


@dataclass
class CorruptShard:
    file: str
    reason: str

    def __str__(self) -> str:
        return f"{self.file}: {self.reason}"


@dataclass
class CachedValues:
    """Reference values aligned with the keys asked for."""

    chosen_logps: torch.Tensor  # (N,) float32
    rejected_logps: torch.Tensor  # (N,)
    chosen_tokens: torch.Tensor  # (N,) int32
    rejected_tokens: torch.Tensor  # (N,)


@dataclass
class _Shard:
    info: ShardInfo
    tensors: dict[str, torch.Tensor]
    chosen_offsets: torch.Tensor | None = None  # (n+1,) where each pair's per-token run starts
    rejected_offsets: torch.Tensor | None = None


class CacheStore:
    """One namespace of the cache. ``open()`` reads and verifies every shard."""

    def __init__(self, root: str | Path, namespace: Namespace):
        self.root = Path(root)
        self.namespace = namespace
        self.dir = self.root / namespace.id
        self.shards: list[_Shard] = []
        self.corrupt: list[CorruptShard] = []
        self._index: dict[bytes, tuple[int, int]] = {}  # key → (shard position, row)

    # ---------------------------------------------------------------- opening and verifying

    def open(self, repair: bool = False) -> "CacheStore":
        """Load every shard whose checksum holds; bad shards go to ``self.corrupt``, unloaded.

        Read-only unless ``repair``: then bad shards are renamed ``*.corrupt`` (so no later run
        trips on them again) and the manifest is rewritten to list exactly the good shards,
        adopting those a killed build (or another rank) wrote but did not record."""
        self.shards, self.corrupt, self._index = [], [], {}
        recorded = {s["file"]: s for s in self._read_manifest().get("shards", [])}
        on_disk = {p.name for p in self.dir.glob("shard-*.safetensors")} if self.dir.exists() else set()
        for name in sorted(recorded.keys() - on_disk):
            self.corrupt.append(CorruptShard(name, "listed in the manifest but missing on disk"))
        for name in sorted(on_disk):
            expected = recorded.get(name, {}).get("sha256")
            self._load_shard(name, expected)
        if repair:
            self.dir.mkdir(parents=True, exist_ok=True)
            for bad in self.corrupt:
                path = self.dir / bad.file
                if path.exists():
                    path.rename(path.with_name(path.name + ".corrupt"))
            if set(recorded) != {s.info.file for s in self.shards}:
                self.write_manifest()
        return self

    def _read_manifest(self) -> dict:
        path = self.dir / MANIFEST
        if not path.exists():
            return {}
        try:
            return json.loads(path.read_text())
        except json.JSONDecodeError as e:
            # The shards carry their own checksums, so a damaged manifest loses nothing.
            self.corrupt.append(CorruptShard(MANIFEST, f"malformed JSON ({e.msg}); rebuilt from the shards"))
            return {}

    def _load_shard(self, name: str, expected_sha: str | None) -> None:
        data = (self.dir / name).read_bytes()
        digest = hashlib.sha256(data).hexdigest()
        if expected_sha is not None and digest != expected_sha:
            self.corrupt.append(CorruptShard(name, f"checksum mismatch (sha256 {digest[:16]}…, manifest says {expected_sha[:16]}…)"))
            return
        if expected_sha is None and not name.startswith(f"shard-{digest[:16]}"):
            self.corrupt.append(CorruptShard(name, f"checksum mismatch (content sha256 {digest[:16]}… does not match its name)"))
            return
        try:
            tensors = load_safetensors(data)
            n = tensors["keys"].shape[0]
        except Exception as e:  # a shard that hashes right but does not parse: written by a bug
            self.corrupt.append(CorruptShard(name, f"unreadable ({e})"))
            return
        per_token = "chosen_token_logps" in tensors
        info = ShardInfo(name, digest, n, per_token, len(data))
        self._register(_Shard(info, tensors))

    def _register(self, shard: _Shard) -> None:
        t = shard.tensors
        if shard.info.per_token:
            shard.chosen_offsets = _offsets(t["chosen_tokens"])
            shard.rejected_offsets = _offsets(t["rejected_tokens"])
        position = len(self.shards)
        self.shards.append(shard)
        raw = t["keys"].numpy().tobytes()
        for row in range(shard.info.pairs):
            key = raw[row * KEY_BYTES:(row + 1) * KEY_BYTES]
            # A per-token copy of a key wins over a sums-only one: it holds strictly more.
            old = self._index.get(key)
            if old is None or shard.info.per_token or not self.shards[old[0]].info.per_token:
                self._index[key] = (position, row)

    def write_manifest(self) -> None:
        ns = self.namespace
        manifest = {
            "schema": SCHEMA_VERSION,
            "namespace_id": ns.id,
            "namespace": asdict(ns),
            "pairs": len(self._index),
            "shards": [asdict(s.info) for s in self.shards],
            "updated": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        atomic_write_text(self.dir / MANIFEST, json.dumps(manifest, indent=1))

    # ---------------------------------------------------------------- reading values

    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, key: bytes) -> bool:
        return key in self._index

    def has(self, key: bytes, per_token: bool = False) -> bool:
        loc = self._index.get(key)
        return loc is not None and (not per_token or self.shards[loc[0]].info.per_token)

    def missing(self, keys: Iterable[bytes], per_token: bool = False) -> list[bytes]:
        """Unique keys without a value (or without per-token values when asked), in order."""
        seen: set[bytes] = set()
        out = []
        for k in keys:
            if k not in seen and not self.has(k, per_token):
                out.append(k)
            seen.add(k)
        return out

    def lookup(self, keys: Sequence[bytes]) -> CachedValues:
        """Values for ``keys`` in order; raises ``MissingReferenceError`` if any is absent."""
        missing = sum(1 for k in keys if k not in self._index)
        if missing:
            raise MissingReferenceError(missing, len(keys), self.dir)
        cols: dict[str, list] = {name: [] for name in ("chosen_logps", "rejected_logps", "chosen_tokens", "rejected_tokens")}
        for k in keys:
            pos, row = self._index[k]
            t = self.shards[pos].tensors
            for name in cols:
                cols[name].append(t[name][row])
        return CachedValues(*(torch.stack(cols[name]) if cols[name] else torch.zeros(0) for name in cols))

    def token_logps(self, key: bytes) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token reference log-probs ``((Tc,), (Tr,))`` of one pair (per-token shards only)."""
        pos, row = self._index[key]
        shard = self.shards[pos]
        if not shard.info.per_token:
            raise CacheError("this pair was cached without per-token values; rebuild with --per-token")
        t = shard.tensors
        c0, c1 = shard.chosen_offsets[row], shard.chosen_offsets[row + 1]
        r0, r1 = shard.rejected_offsets[row], shard.rejected_offsets[row + 1]
        return t["chosen_token_logps"][c0:c1], t["rejected_token_logps"][r0:r1]

    def size_bytes(self) -> int:
        return sum(s.info.bytes for s in self.shards)

    # ---------------------------------------------------------------- writing

    def writer(self, shard_pairs: int = 4096, flush_seconds: float = 60.0, update_manifest: bool = True) -> "ShardWriter":
        return ShardWriter(self, shard_pairs, flush_seconds, update_manifest)

    def add_shard(self, tensors: dict[str, torch.Tensor], update_manifest: bool = True) -> ShardInfo:
        """Write one shard atomically, register it, and (by default) record it in the manifest."""
        self.dir.mkdir(parents=True, exist_ok=True)
        data = save_safetensors(tensors, metadata={"schema": str(SCHEMA_VERSION), "namespace": self.namespace.id})
        digest = hashlib.sha256(data).hexdigest()
        name = f"shard-{digest[:16]}.safetensors"
        atomic_write_bytes(self.dir / name, data)
        info = ShardInfo(name, digest, tensors["keys"].shape[0], "chosen_token_logps" in tensors, len(data))
        self._register(_Shard(info, tensors))
        if update_manifest:
            self.write_manifest()
        return info


def _offsets(counts: torch.Tensor) -> torch.Tensor:
    return torch.cat([torch.zeros(1, dtype=torch.long), counts.long().cumsum(0)])


@dataclass
class _Pending:
    keys: list[bytes] = field(default_factory=list)
    chosen_logps: list[torch.Tensor] = field(default_factory=list)
    rejected_logps: list[torch.Tensor] = field(default_factory=list)
    chosen_tokens: list[torch.Tensor] = field(default_factory=list)
    rejected_tokens: list[torch.Tensor] = field(default_factory=list)
    chosen_token_logps: list[torch.Tensor] = field(default_factory=list)
    rejected_token_logps: list[torch.Tensor] = field(default_factory=list)


class ShardWriter:
    """Buffers computed pairs and flushes a shard every ``shard_pairs`` pairs or
    ``flush_seconds`` seconds, so a killed build loses at most that much work."""

    def __init__(self, store: CacheStore, shard_pairs: int, flush_seconds: float, update_manifest: bool):
        self.store = store
        self.shard_pairs = shard_pairs
        self.flush_seconds = flush_seconds
        self.update_manifest = update_manifest
        self._pending = _Pending()
        self._last_flush = time.monotonic()
        self.written: list[ShardInfo] = []

    def add(self, keys: Sequence[bytes], chosen_logps: torch.Tensor, rejected_logps: torch.Tensor,
            chosen_tokens: torch.Tensor, rejected_tokens: torch.Tensor,
            chosen_token_logps: Sequence[torch.Tensor] | None = None,
            rejected_token_logps: Sequence[torch.Tensor] | None = None) -> None:
        """Add B pairs: sums and counts ``(B,)``; per-token values as B tensors ``(T_i,)``."""
        p = self._pending
        p.keys.extend(keys)
        p.chosen_logps.append(chosen_logps.detach().float().cpu())
        p.rejected_logps.append(rejected_logps.detach().float().cpu())
        p.chosen_tokens.append(chosen_tokens.detach().to(torch.int32).cpu())
        p.rejected_tokens.append(rejected_tokens.detach().to(torch.int32).cpu())
        if chosen_token_logps is not None:
            p.chosen_token_logps.extend(t.detach().float().cpu() for t in chosen_token_logps)
            p.rejected_token_logps.extend(t.detach().float().cpu() for t in rejected_token_logps)
        if len(p.keys) >= self.shard_pairs or time.monotonic() - self._last_flush >= self.flush_seconds:
            self.flush()

    def flush(self) -> None:
        p = self._pending
        if p.keys:
            tensors = {
                "keys": torch.frombuffer(bytearray(b"".join(p.keys)), dtype=torch.uint8).reshape(-1, KEY_BYTES),
                "chosen_logps": torch.cat(p.chosen_logps),
                "rejected_logps": torch.cat(p.rejected_logps),
                "chosen_tokens": torch.cat(p.chosen_tokens),
                "rejected_tokens": torch.cat(p.rejected_tokens),
            }
            if p.chosen_token_logps:
                if len(p.chosen_token_logps) != len(p.keys):
                    raise CacheError("per-token values given for some pairs of a shard but not all")
                tensors["chosen_token_logps"] = torch.cat(p.chosen_token_logps)
                tensors["rejected_token_logps"] = torch.cat(p.rejected_token_logps)
            self.written.append(self.store.add_shard(tensors, self.update_manifest))
        self._pending = _Pending()
        self._last_flush = time.monotonic()
