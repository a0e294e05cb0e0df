"""The on-disk reference cache: content-addressed safetensors shards plus a JSON manifest.

Layout::

    CACHE_DIR/
      fingerprints.json                   memo of weight-file and shard hashes (path, size, times, inode → sha256)
      <namespace id>/
        manifest.json                     namespace in words, shards with sha256 and counts
        shard-<sha256[:16]>.safetensors   one flushed batch of pairs

A shard's name carries the start of its own SHA-256, so a shard written by a build that died
before updating the manifest (or by another rank or process) is still verifiable, and is adopted
on the next open. Every shard is checked before its values are used: its checksum, the namespace
recorded in its metadata (a shard copied from another model's directory holds that model's
values), its shapes, and that every value is finite. One that fails is reported by name and
never loaded; a build quarantines it (``*.corrupt``). A shard is hashed once: its digest is
memoised by the file's size, times and inode (``cache.fingerprint``), recorded by the writer, and
hashed again only when the file changed or on ``rehash`` (``cache verify``). Its tensors map the
file (copy-on-write), so every process reading a cache shares its pages.

The manifest only lists files; it is trusted for nothing. Only plain names of the shard pattern
are honoured (never a path), a manifest of the wrong shape or namespace is ignored and rebuilt
from the shards, and only regular files are read (no link, FIFO or device), with their sizes
bounded before reading. Its updates are read-merge-write under a lock file (``manifest.lock``),
so builds running at once in one directory lose no shard from it.

Shard tensors (n pairs; per-token arrays only in per-token shards)::

    keys                 (n, 16) uint8   example keys (data.example_key)
    chosen_logps         (n,)    float32 sum of completion-token log-probs
    rejected_logps       (n,)    float32
    chosen_tokens        (n,)    int32   completion token counts
    rejected_tokens      (n,)    int32
    chosen_token_logps   (sum chosen_tokens,)   float32, pair after pair
    rejected_token_logps (sum rejected_tokens,) float32

Besides ``keys``, a shard holds the fields of ``dpocache.data.values.PairValues`` under their own
names, as its ``stored`` declarations say: this module reads, checks and writes them from those
declarations, so a field added there is cached with no change here.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import load_file as load_safetensors_file
from safetensors.torch import save as save_safetensors

from dpocache.cache.atomic import (
    UnsafeFileError,
    atomic_write_bytes,
    atomic_write_text,
    file_stamp,
    locked,
    read_regular_file,
    read_regular_file_head,
    remove_stale_temps,
)
from dpocache.cache.fingerprint import FingerprintMemo, default_memo_path, file_sha256
from dpocache.config import CacheConfig
from dpocache.data.pairs import KEY_BYTES
from dpocache.data.values import PairValues
from dpocache.runtime.preflight import unwritable

SCHEMA_VERSION = 1
# A temp file older than this was left by a writer that died mid-write (a shard is written in
# seconds), and a repairing open removes it.
STALE_TEMP_SECONDS = 3600
MANIFEST = "manifest.json"
# What becomes of a bad shard in a directory this user cannot write (``CacheStore.repair_skipped``).
LEFT_AS_IT_IS = "not loaded (left as it is: the cache cannot be written here)"
LOCK_FILE = "manifest.lock"
SHARD_NAME = re.compile(r"shard-[0-9a-f]{16}\.safetensors")  # the only file names a manifest may give
MAX_MANIFEST_BYTES = 256 << 20  # ~1.5M shard entries
MAX_SHARD_BYTES = 64 << 30
MAX_HEADER_BYTES = 1 << 20  # a shard's safetensors header is < 2 KiB: 7 tensors and 2 metadata fields
_IGNORED = "; ignored (a build rewrites it from the shards)"
DEFAULT_SHARD_PAIRS = CacheConfig.shard_size  # pairs per shard: the one default is the config's


class CacheError(RuntimeError):
    """The cache cannot give or take what was asked: values missing or damaged, a store used
    before ``open``, values that are not finite."""


class MissingReferenceError(CacheError):
    """Some pairs asked for have no cached value. ``missing``: how many; ``positions``: where
    they are among the keys asked for (to build exactly those: ``[pairs[i] for i in positions]``)."""

    def __init__(self, missing: int, total: int, namespace_dir: Path, positions: Sequence[int] = ()):
        self.missing = missing
        self.positions = list(positions)
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
    # The sampling temperature the logits are divided by (online RL: dpocache.service.reference_service). Hashed,
    # and recorded, only when it is not 1, so every other namespace keeps its id.
    temperature: float = 1.0

    @property
    def id(self) -> str:
        hashed = {"weights": self.weights_sha256, "config": self.config_sha256, "dtype": self.dtype,
                  "schema": self.schema}
        if self.temperature != 1.0:
            hashed["temperature"] = self.temperature
        return hashlib.sha256(json.dumps(hashed, sort_keys=True).encode()).hexdigest()[:20]

    def record(self) -> dict:
        """The namespace as manifests and ``namespace.json`` record it."""
        fields = asdict(self)
        if self.temperature == 1.0:
            del fields["temperature"]
        return fields


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

    @property
    def problem(self) -> str:
        """The reason without what becomes of the file (a manifest's "; ignored (...)")."""
        return self.reason.removesuffix(_IGNORED)


@dataclass
class _Shard:
    info: ShardInfo
    tensors: dict[str, torch.Tensor]
    offsets: dict[str, torch.Tensor] = field(default_factory=dict)  # per-token field → (n+1,) run starts


class CacheStore:
    """One namespace of the cache. ``open()`` reads and verifies every shard."""

    def __init__(self, root: str | Path, namespace: Namespace):
        self.root = Path(root)
        self.namespace = namespace
        self.dir = self.root / namespace.id
        self.shards: list[_Shard] = []
        self.corrupt: list[CorruptShard] = []
        self.recorded_namespace: Namespace | None = None  # the manifest's record, when it is sound
        self._index: dict[bytes, tuple[int, int]] = {}  # key → (shard position, row)
        self._seen: set[str] = set()  # directory entries already loaded or refused
        self._loaded: set[str] = set()  # shard names whose values are in the index
        self._quarantine: list[str] = []  # directory entries a repairing open renames *.corrupt
        # Shard digests memoised beside the weight files' (read-only: a memo not written costs a hash)
        self._memo = FingerprintMemo(default_memo_path(self.root), read_only=True)
        self.rehash = False  # True: hash every shard on open, memo or not (``cache verify``)
        self.opened = False  # by ``open``: before it the store holds only what this process wrote
        self.repair_skipped = False  # the last open(repair=True) found the directory read-only: nothing changed

    # ---------------------------------------------------------------- opening and verifying

    def open(self, repair: bool = False) -> "CacheStore":
        """Load every shard that passes its checks; bad shards go to ``self.corrupt``, unloaded.

        Read-only unless ``repair``: then bad shards are renamed ``*.corrupt`` (so no later run
        trips on them again), the manifest is rewritten to list exactly the good shards,
        adopting those a killed build (or another rank) wrote but did not record, and the temp
        files of writes killed more than ``STALE_TEMP_SECONDS`` ago are removed. Only entries
        of this directory's own listing are ever renamed, never a name read from the manifest.
        A directory this user cannot write (a team's cache) is read as it is, unrepaired
        (``repair_skipped``): what is sound is used, what is not stays for its owner's next build."""
        self.repair_skipped = bool(repair and self.dir.is_dir() and unwritable(self.dir) is not None)
        repair = repair and not self.repair_skipped
        self.shards, self.corrupt, self._index = [], [], {}
        self._seen, self._loaded, self._quarantine = set(), set(), []
        self.opened = True
        recorded, manifest_sound = self._read_manifest()
        on_disk = self._scan()
        for name in sorted(recorded.keys() - set(on_disk)):
            self.corrupt.append(CorruptShard(name, "listed in the manifest but missing on disk"))
        with self._memo.batched():  # a copied cache's shards are all hashed anew: the memo written once
            for name in on_disk:
                self._load_shard(name, recorded.get(name, {}).get("sha256"))
        if repair:
            self.dir.mkdir(parents=True, exist_ok=True)
            remove_stale_temps(self.dir, STALE_TEMP_SECONDS)
            for name in self._quarantine:
                path = self.dir / name
                if os.path.lexists(path):  # renames the entry itself, a link included, never its target
                    path.rename(path.with_name(path.name + ".corrupt"))
            self._quarantine = []
            if not manifest_sound or set(recorded) != {s.info.file for s in self.shards}:
                self.write_manifest()
        return self

    def describe_corrupt(self, entry: str, action: str, repaired: bool = True) -> str:
        """One line for a refused entry (``str(CorruptShard)``, as a build's ``corrupt_shards`` holds
        them): a shard, whose pairs get ``action``; or the manifest, which costs no value (the
        shards carry their own checksums) and which a repairing open (a build's, a training
        run's) has rewritten from the shards, else (``repaired`` False) the next one will."""
        name, _, reason = entry.partition(": ")
        if name != MANIFEST:
            return f"corrupt shard {self.dir / entry}; {action}"
        done = ("rebuilt from the shards" if repaired else
                "not used; the next cache build or train rebuilds it from the shards")
        return (f"damaged manifest {self.dir / MANIFEST}: {reason.removesuffix(_IGNORED)}; {done}, which carry their "
                "own checksums (no pair is recomputed for it)")

    def refresh(self) -> int:
        """Load the shards that appeared in the directory since ``open`` (written by another
        process building into the same namespace); returns how many pairs that added."""
        before = len(self._index)
        if self.dir.is_dir():
            with self._memo.batched():
                for name in self._scan():
                    self._load_shard(name, None)
        return len(self._index) - before

    def _refuse(self, name: str, reason: str, quarantine: bool = True) -> None:
        self.corrupt.append(CorruptShard(name, reason))
        self._seen.add(name)
        if quarantine:
            self._quarantine.append(name)

    def _scan(self) -> list[str]:
        """Shard names in the directory not seen yet, sorted; a ``shard-*`` entry of any other
        name is refused (quarantined by a repair)."""
        if not self.dir.is_dir():
            return []
        names = []
        for name in sorted(os.listdir(self.dir)):
            if name in self._seen or not name.startswith("shard-") or name.endswith(".corrupt"):
                continue
            if SHARD_NAME.fullmatch(name):
                names.append(name)
            elif name.endswith(".safetensors"):
                self._refuse(name, "not a shard name (shard-<16 hex digits>.safetensors)")
        return names

    def _read_manifest(self) -> tuple[dict[str, dict], bool]:
        """``({file: entry}, sound)``. A manifest that is not sound is reported and ignored:
        the shards carry their own checksums, so rebuilding it from them loses nothing."""
        path = self.dir / MANIFEST
        if not os.path.lexists(path):
            return {}, True
        try:
            raw = read_regular_file(path, MAX_MANIFEST_BYTES)
        except OSError as e:  # UnsafeFileError included
            unsafe = isinstance(e, UnsafeFileError)
            self._refuse(MANIFEST, f"{e if unsafe else f'unreadable ({e.strerror})'}{_IGNORED}", quarantine=unsafe)
            return {}, False
        entries, self.recorded_namespace, problem = parse_manifest(raw, self.dir.name)
        if problem:
            self._refuse(MANIFEST, problem + _IGNORED)
            return {}, False
        return entries, True

    def _load_shard(self, name: str, expected_sha: str | None) -> None:
        path = self.dir / name
        try:
            header, stamp = read_regular_file_head(path, MAX_SHARD_BYTES, 8 + MAX_HEADER_BYTES)
            # Hashed once: a later open finds the digest in the memo while the file's size, times
            # and inode are those it was hashed with (cache.fingerprint), unless asked to re-hash.
            digest = file_sha256(path) if self.rehash else self._memo.sha256(path)
        except UnsafeFileError as e:
            return self._refuse(name, str(e))
        except OSError as e:  # e.g. another user's file without read permission: not bad content
            return self._refuse(name, f"unreadable ({e.strerror})", quarantine=False)
        if expected_sha is not None and digest != expected_sha:
            return self._refuse(name, f"checksum mismatch (sha256 {digest[:16]}…, "
                                      f"manifest says {expected_sha[:16]}…)")
        if name != f"shard-{digest[:16]}.safetensors":
            return self._refuse(name, f"checksum mismatch (content sha256 {digest[:16]}… does not match its name)")
        problem, tensors = _parse_shard(header, self.dir.name, path)
        if not problem and file_stamp(os.stat(path)) != stamp:
            problem = "replaced while being read"
        if problem:
            return self._refuse(name, problem)
        self._seen.add(name)
        self._loaded.add(name)
        info = ShardInfo(name, digest, tensors["keys"].shape[0], _has_per_token(tensors), stamp["size"])
        self._register(_Shard(info, tensors))

    def _register(self, shard: _Shard) -> None:
        t = shard.tensors
        if shard.info.per_token:
            shard.offsets = {name: _offsets(t[PairValues.spec(name)["counts"]]) for name in PairValues.token_fields()}
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
        """Rewrite the manifest under the namespace's lock file, after adopting the shards
        other processes have written since ``open``: read-merge-write, so two builds in one
        directory cannot drop each other's shards from it."""
        ns = self.namespace
        self.dir.mkdir(parents=True, exist_ok=True)
        with locked(self.dir / LOCK_FILE):
            self.refresh()
            manifest = {
                "schema": SCHEMA_VERSION,
                "namespace_id": ns.id,
                "namespace": ns.record(),
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

    def _check_opened(self, method: str) -> None:
        """Read before ``open``, the store knows none of the shards on disk: every pair would
        read as missing (and be built again), which is said instead."""
        if not self.opened:
            raise CacheError(f"CacheStore.{method}: the store is not open; call store.open() first (it reads and "
                             f"checks the shards of {self.dir})")

    def has(self, key: bytes, per_token: bool = False) -> bool:
        """Whether ``key`` has a value (with ``per_token``: per-token values too)."""
        self._check_opened("has")
        loc = self._index.get(key)
        return loc is not None and (not per_token or self.shards[loc[0]].info.per_token)

    def missing(self, keys: Iterable[bytes], per_token: bool = False) -> list[bytes]:
        """Unique keys without a value (or without per-token values when asked), in order."""
        self._check_opened("missing")
        keys = _checked_keys(keys)
        seen: set[bytes] = set()
        out = []
        for k in keys:
            if k not in seen and not self.has(k, per_token):
                out.append(k)
            seen.add(k)
        return out

    def lookup(self, keys: Sequence[bytes], per_token: bool = False) -> PairValues:
        """The values of ``keys``, in order (``N`` pairs; per-token fields only if ``per_token``).
        Raises ``MissingReferenceError`` if a key is absent, ``CacheError`` if ``per_token`` and a
        pair was cached without per-token values. An optional field is given (else None) only
        when every pair asked for has it: shards written before the field existed lack it."""
        self._check_opened("lookup")
        keys = _checked_keys(keys)
        absent = [i for i, k in enumerate(keys) if k not in self._index]
        if absent:
            raise MissingReferenceError(len(absent), len(keys), self.dir, absent)
        locations = [self._index[k] for k in keys]
        if per_token and not all(self.shards[pos].info.per_token for pos, _ in locations):
            raise CacheError(_NO_PER_TOKEN)
        position = torch.tensor([pos for pos, _ in locations], dtype=torch.long)  # (N,)
        rows = torch.tensor([row for _, row in locations], dtype=torch.long)  # (N,)
        used = sorted(set(position.tolist()))
        values: dict[str, object] = {}
        for name in PairValues.pair_fields():
            if any(name not in self.shards[s].tensors for s in used):
                values[name] = None
                continue
            column = torch.zeros(len(keys), dtype=PairValues.spec(name)["dtype"])
            for s in used:  # one gather per shard, not one per pair
                here = position == s
                column[here] = self.shards[s].tensors[name][rows[here]]
            values[name] = column
        for name in PairValues.token_fields():
            values[name] = [self._token_run(pos, row, name) for pos, row in locations] if per_token else None
        return PairValues(**values)

    def token_logps(self, key: bytes) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token reference log-probs ``((Tc,), (Tr,))`` of one pair (per-token shards only)."""
        values = self.lookup([key], per_token=True)
        return values.chosen_token_logps[0], values.rejected_token_logps[0]

    def _token_run(self, position: int, row: int, name: str) -> torch.Tensor:
        shard = self.shards[position]
        start, stop = shard.offsets[name][row], shard.offsets[name][row + 1]
        return shard.tensors[name][start:stop]

    def size_bytes(self) -> int:
        return sum(s.info.bytes for s in self.shards)

    # ---------------------------------------------------------------- writing

    def writer(self, shard_pairs: int = DEFAULT_SHARD_PAIRS, flush_seconds: float = 60.0,
               update_manifest: bool = True) -> "ShardWriter":
        return ShardWriter(self, shard_pairs, flush_seconds, update_manifest)

    def add_shard(self, tensors: dict[str, torch.Tensor], update_manifest: bool = True) -> ShardInfo:
        """Write one shard atomically, register it, and (by default) record it in the manifest."""
        bad = _count_non_finite(tensors)
        if bad:
            raise CacheError(f"refusing to store {bad} non-finite reference values (NaN or inf)")
        self.dir.mkdir(parents=True, exist_ok=True)
        data = save_safetensors(tensors, metadata={"schema": str(SCHEMA_VERSION), "namespace": self.namespace.id})
        digest = hashlib.sha256(data).hexdigest()
        name = f"shard-{digest[:16]}.safetensors"
        atomic_write_bytes(self.dir / name, data)
        self._memo.remember(self.dir / name, digest)  # hashed as written: no open hashes it again
        info = ShardInfo(name, digest, tensors["keys"].shape[0], _has_per_token(tensors), len(data))
        if name not in self._loaded:  # the same bytes may be loaded already (another process wrote them first)
            self._seen.add(name)
            self._loaded.add(name)
            self._register(_Shard(info, tensors))
        if update_manifest:
            self.write_manifest()
        return info


def _checked_keys(keys: Iterable[bytes]) -> list[bytes]:
    """``keys`` as a list, each a pair's key (``TokenizedPair.key``): a pair, a string or one key
    given where keys are asked for would otherwise read as that many missing pairs."""
    if isinstance(keys, (bytes, bytearray, str)):
        raise TypeError(f"keys: expected a list of pair keys, got one {type(keys).__name__} object (wrap a single "
                        "key in a list)")
    keys = list(keys)
    for k in keys:
        if not isinstance(k, bytes) or len(k) != KEY_BYTES:
            what = f"bytes of length {len(k)}" if isinstance(k, bytes) else type(k).__name__
            raise TypeError(f"keys: each must be a pair's key ({KEY_BYTES} bytes, TokenizedPair.key), got {what}: "
                            "pass [pair.key for pair in pairs]")
    return keys


def _offsets(counts: torch.Tensor) -> torch.Tensor:
    return torch.cat([torch.zeros(1, dtype=torch.long), counts.long().cumsum(0)])


_NO_PER_TOKEN = "this pair was cached without per-token values; rebuild with --per-token"


def _has_per_token(tensors: dict[str, torch.Tensor]) -> bool:
    return all(name in tensors for name in PairValues.token_fields())


def _count_non_finite(tensors: dict[str, torch.Tensor]) -> int:
    # A million values at a time: a mask the size of a mapped shard would be private memory
    # that the allocator keeps after it is freed.
    return sum(int((~torch.isfinite(part)).sum()) for t in tensors.values() if t.is_floating_point()
               for part in t.reshape(-1).split(1 << 20))


def non_finite_problem(tensors: dict[str, torch.Tensor]) -> str | None:
    """What a loaded shard's NaN or inf values make of it, or None (any kind of shard)."""
    bad = _count_non_finite(tensors)
    return f"holds {bad} non-finite values (NaN or inf)" if bad else None


_MANIFEST_FIELDS = {"schema", "namespace_id", "namespace", "pairs", "shards", "updated"}
_NAMESPACE_TYPES = {"weights_sha256": str, "config_sha256": str, "dtype": str, "model": str, "schema": int,
                    "temperature": float}
_ENTRY_TYPES = {"file": str, "sha256": str, "pairs": int, "per_token": bool, "bytes": int}


def parse_manifest(raw: bytes, namespace_id: str) -> tuple[dict[str, dict], Namespace | None, str | None]:
    """``({file: entry}, namespace record, problem)`` of a manifest's bytes, checked against the
    id of the directory that holds it. On any problem (the one line says what) the entries are
    empty: a manifest is either entirely as this version writes it or not used."""
    try:
        manifest = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        return {}, None, f"not UTF-8 (byte {e.start})"
    except (ValueError, RecursionError) as e:
        return {}, None, f"malformed JSON ({getattr(e, 'msg', 'nested too deep')})"
    problem = _fields_problem(manifest, {k: object for k in _MANIFEST_FIELDS}, "the manifest")
    if problem:
        return {}, None, problem
    if manifest.get("namespace_id") != namespace_id:
        recorded = str(manifest.get("namespace_id"))[:40]
        return {}, None, f"records namespace {recorded!r}, not its directory's {namespace_id}"
    record = manifest.get("namespace")
    problem = _fields_problem(record, _NAMESPACE_TYPES, "its namespace record",
                              required=("weights_sha256", "config_sha256", "dtype"))
    if problem:
        return {}, None, problem
    namespace = Namespace(**record)
    if namespace.id != namespace_id:
        return {}, None, f"its namespace record hashes to {namespace.id}, not {namespace_id}"
    shards = manifest.get("shards", [])
    if not isinstance(shards, list):
        return {}, None, f"'shards' is a {type(shards).__name__}, not a list"
    entries: dict[str, dict] = {}
    for i, entry in enumerate(shards):
        problem = _fields_problem(entry, _ENTRY_TYPES, f"shard entry {i}", required=tuple(_ENTRY_TYPES))
        if problem:
            return {}, None, problem
        name = entry["file"]
        if not SHARD_NAME.fullmatch(name):
            return {}, None, f"shard entry {i} names {name[:80]!r}, not a shard file name (never a path)"
        if not re.fullmatch(r"[0-9a-f]{64}", entry["sha256"]) or name in entries:
            return {}, None, f"shard entry {i} ({name}): bad sha256 or listed twice"
        entries[name] = entry
    return entries, namespace, None


def _fields_problem(obj, types: dict[str, type], what: str, required: tuple[str, ...] = ()) -> str | None:
    if not isinstance(obj, dict):
        return f"{what} is a {type(obj).__name__}, not an object"
    unknown = sorted(set(obj) - set(types))
    if unknown:
        return f"{what} has an unknown field {unknown[0][:40]!r}"
    missing = [k for k in required if k not in obj]
    if missing:
        return f"{what} has no {missing[0]!r} field"
    for k, v in obj.items():
        # bool is an int to isinstance; a count of True is as wrong as a string.
        if types[k] is not object and (not isinstance(v, types[k]) or (types[k] is int and isinstance(v, bool))):
            return f"{what}: {k!r} is a {type(v).__name__}, not {types[k].__name__}"
    return None


def _parse_shard(head: bytes, namespace_id: str, path: Path) -> tuple[str | None, dict[str, torch.Tensor]]:
    """``(problem, tensors)`` of a shard file whose first bytes are ``head``: ``read_namespaced_shard``'s
    checks, and shapes and values must be those ``ShardWriter`` writes. The tensors map the file
    (copy-on-write): every process reading a cache shares its pages."""
    problem, tensors = read_namespaced_shard(head, namespace_id, path)
    if problem:
        return problem, {}
    problem = _shape_problem(tensors) or non_finite_problem(tensors)
    if problem:
        return problem, {}
    return None, tensors


def read_namespaced_shard(data: bytes, namespace_id: str,
                          path: Path | None = None) -> tuple[str | None, dict[str, torch.Tensor]]:
    """``(problem, tensors)`` of any cache shard's safetensors bytes (this module's pair shards,
    ``sequences.py``'s look-aside shards), or of the file ``path`` whose first bytes ``data`` are:
    the header size is bounded before it is parsed, and the namespace in its metadata must be
    ``namespace_id`` (a shard copied from another namespace's directory holds another model's,
    config's or dtype's values)."""
    size = len(data) if path is None else path.stat().st_size
    if size < 8:
        return "truncated (no safetensors header)", {}
    header_bytes = int.from_bytes(data[:8], "little")
    if header_bytes > min(MAX_HEADER_BYTES, size - 8):
        return f"header of {header_bytes} bytes (at most {min(MAX_HEADER_BYTES, size - 8)})", {}
    try:
        metadata = json.loads(data[8:8 + header_bytes]).get("__metadata__") or {}
        tensors = load_safetensors(data) if path is None else load_safetensors_file(path)
    except Exception as e:  # a shard that hashes right but does not parse: written by a bug
        return f"unreadable ({e})", {}
    recorded = metadata.get("namespace") if isinstance(metadata, dict) else None
    if recorded != namespace_id:
        return (f"foreign shard: written for namespace {str(recorded)[:40]} (another model, config or dtype), "
                f"not {namespace_id}"), {}
    return None, tensors


def _shape_problem(t: dict[str, torch.Tensor]) -> str | None:
    keys = t.get("keys")
    if keys is None or keys.dtype != torch.uint8 or keys.dim() != 2 or keys.shape[1] != KEY_BYTES:
        return "no (n, 16) uint8 'keys' tensor"
    n = keys.shape[0]
    counts = {PairValues.spec(name)["counts"] for name in PairValues.token_fields()}
    for name in PairValues.pair_fields():
        spec = PairValues.spec(name)
        if name not in t and spec["optional"]:
            continue
        if name not in t or t[name].dtype != spec["dtype"] or tuple(t[name].shape) != (n,):
            return f"'{name}' is not a ({n},) {spec['dtype']} tensor"
        if name in counts and bool((t[name] < 0).any()):
            return f"'{name}' holds negative counts"
    present = [name in t for name in PairValues.token_fields()]
    if any(present) and not all(present):
        return "per-token values for one side only"
    for name in PairValues.token_fields():
        spec = PairValues.spec(name)
        per_token = t.get(name)
        expected = (int(t[spec["counts"]].long().sum()),)
        if per_token is not None and (per_token.dtype != spec["dtype"] or tuple(per_token.shape) != expected):
            return f"'{name}' does not hold one value per counted token"
    return None


class ShardWriter:
    """Buffers computed pairs and flushes a shard every ``shard_pairs`` pairs or
    ``flush_seconds`` seconds, so a killed build loses at most that much work."""

    def __init__(self, store: CacheStore, shard_pairs: int, flush_seconds: float, update_manifest: bool):
        self.store = store
        self.shard_pairs = shard_pairs
        self.flush_seconds = flush_seconds
        self.update_manifest = update_manifest
        self._keys: list[bytes] = []
        self._values: list[PairValues] = []  # detached, on the CPU
        self._last_flush = time.monotonic()

    def add(self, keys: Sequence[bytes], values: PairValues) -> None:
        """Add the values of ``B`` pairs with keys ``keys`` (``B`` of them)."""
        if len(keys) != len(values):
            raise ValueError(f"{len(keys)} keys for {len(values)} pairs' values")
        self._keys.extend(keys)
        self._values.append(values.map(lambda t: t.detach().cpu()))
        if len(self._keys) >= self.shard_pairs or time.monotonic() - self._last_flush >= self.flush_seconds:
            self.flush()

    def flush(self) -> None:
        if self._keys:
            given = {tuple(name for name in PairValues.token_fields() if getattr(v, name) is not None)
                     for v in self._values}
            if len(given) > 1:
                raise CacheError("per-token values given for some pairs of a shard but not all")
            keys = torch.frombuffer(bytearray(b"".join(self._keys)), dtype=torch.uint8).reshape(-1, KEY_BYTES)
            self.store.add_shard({"keys": keys, **PairValues.cat(self._values).to_tensors()}, self.update_manifest)
        self._keys, self._values = [], []
        self._last_flush = time.monotonic()
