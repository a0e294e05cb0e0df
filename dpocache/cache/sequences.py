"""Per-token reference values of single sequences ``prompt + completion``: the look-aside cache of
``dpocache.service.reference_service``.

The same content-addressed scheme as the pair cache (``store.py``): one directory per
``Namespace`` (weights, config, dtype), safetensors shards named by the start of their own
SHA-256, written atomically and verified before use as the pair shards are (checksum, the
namespace in their metadata, shapes, finite values: a bad one is reported and never loaded).
The values live in a ``sequences/`` sub-directory of the namespace's directory, so the pair
cache's shards and manifest are not touched and the two kinds of values never mix::

    CACHE_DIR/<namespace id>/sequences/
      namespace.json                      the namespace in words (for people)
      seq-<sha256[:16]>.safetensors       keys (n, 16) uint8, tokens (n,) int32,
                                          token_logps (sum tokens,) float32, sequence after sequence

No manifest: a shard's name is its checksum, so every shard in the directory, whoever wrote
it (several replicas may share one directory), is verifiable on its own; ``refresh`` loads
shards written since the last look.
"""

from __future__ import annotations

import hashlib
import json
import logging
import struct
from array import array
from collections import OrderedDict
from pathlib import Path
from typing import Sequence

import torch
from safetensors.torch import save as save_safetensors

from dpocache.cache.atomic import atomic_write_bytes, atomic_write_text, read_regular_file, remove_stale_temps
from dpocache.cache.store import (
    MAX_SHARD_BYTES,
    STALE_TEMP_SECONDS,
    Namespace,
    non_finite_problem,
    read_namespaced_shard,
)
from dpocache.data.pairs import KEY_BYTES

log = logging.getLogger(__name__)

SUBDIR = "sequences"


def sequence_key(prompt_ids: Sequence[int], completion_ids: Sequence[int]) -> bytes:
    """16-byte BLAKE2b digest of (prompt ids, completion ids), lengths included, under a
    ``seq`` domain so it can never equal a pair key (``data.example_key``)."""
    h = hashlib.blake2b(digest_size=KEY_BYTES, person=b"dpocache-seq")
    h.update(struct.pack("<2I", len(prompt_ids), len(completion_ids)))
    h.update(array("q", prompt_ids).tobytes())
    h.update(array("q", completion_ids).tobytes())
    return h.digest()


DEFAULT_MEMORY_BYTES = 1 << 30  # values held in memory per store; shards past it are read again on demand


class SequenceStore:
    """Per-token values by ``sequence_key``, for one namespace.

    Every key on disk is indexed (about 100 bytes a sequence); the values themselves (4 bytes a
    token) are held a shard at a time, least recently used shard dropped first once they pass
    ``memory_bytes``. A dropped shard is read (and verified) again when one of its keys is
    asked for, so a long online-RL run's memory stays bounded however many sequences it scores.
    """

    def __init__(self, root: str | Path, namespace: Namespace, memory_bytes: int = DEFAULT_MEMORY_BYTES,
                 namespace_id: str | None = None):
        """``namespace_id``: the directory, and what each shard's metadata must name (default
        ``namespace.id``; ``in_directory`` reads a directory by its name)."""
        if memory_bytes < 0:
            raise ValueError(f"memory_bytes must be at least 0; got {memory_bytes}")
        self.namespace = namespace
        self.namespace_id = namespace_id or namespace.id
        self.dir = Path(root) / self.namespace_id / SUBDIR
        remove_stale_temps(self.dir, STALE_TEMP_SECONDS)  # a shard write killed (SIGKILL) long ago
        self.memory_bytes = memory_bytes
        self._shard_of: dict[bytes, str] = {}  # every key on disk -> the shard file holding it
        self._held: OrderedDict[str, dict[bytes, torch.Tensor]] = OrderedDict()  # least recently used first
        self._held_bytes = 0
        self._seen: set[str] = set()  # shard files already read (or found bad)
        self.corrupt: list[str] = []
        self._pending: dict[bytes, torch.Tensor] = {}  # computed, not yet written

    @classmethod
    def in_directory(cls, ns_dir: Path) -> "SequenceStore":
        """The look-aside values already under the namespace directory ``ns_dir``, indexed: every
        shard read and verified (one held in memory at a time) against the directory's name, which
        is authoritative (as ``cache.build.open_namespace_dir`` takes it for the pair cache), so a
        damaged ``namespace.json`` costs no value. For reading (``cache info``): ``namespace`` is
        the one ``namespace.json`` records, a placeholder where that is unsound."""
        namespace = recorded_namespace(ns_dir / SUBDIR) or Namespace("?", "?", "?", model="(no sound namespace.json)")
        store = cls(ns_dir.parent, namespace, memory_bytes=0, namespace_id=ns_dir.name)
        store.refresh()
        return store

    def __len__(self) -> int:
        return len(self._shard_of) + len(self._pending)

    def shard_files(self) -> list[Path]:
        """The shard files in its directory, good or not."""
        return sorted(self.dir.glob("seq-*.safetensors")) if self.dir.is_dir() else []

    @property
    def held_bytes(self) -> int:
        """Bytes of values held in memory (written shards; pending values not counted)."""
        return self._held_bytes

    def refresh(self) -> int:
        """Index the shards not read yet (another process's, or a previous run's); returns how many."""
        if not self.dir.exists():
            return 0
        new = sorted(p for p in self.dir.glob("seq-*.safetensors") if p.name not in self._seen)
        for path in new:
            self._seen.add(path.name)
            values = self._read(path)
            if values is None:
                continue
            for key in values:
                self._shard_of.setdefault(key, path.name)
            self._hold(path.name, values)
        return len(new)

    def _read(self, path: Path) -> dict[bytes, torch.Tensor] | None:
        """A shard's values by key, verified against the checksum in its name, the namespace in
        its metadata, its shapes and finite values; None (and an entry in ``corrupt``) for a
        file that is not a good shard."""
        try:  # a FIFO, device, directory or link under a shard's name is refused unread
            data = read_regular_file(path, MAX_SHARD_BYTES)
        except OSError as e:
            self.corrupt.append(f"{path.name}: {e}")
            log.warning("%s: %s; not loaded", path, e)
            return None
        digest = hashlib.sha256(data).hexdigest()
        if not path.name.startswith(f"seq-{digest[:16]}"):
            self.corrupt.append(f"{path.name}: checksum mismatch (content sha256 {digest[:16]}...)")
            log.warning("%s: checksum mismatch; not loaded", path)
            return None
        problem, t = read_namespaced_shard(data, self.namespace_id)
        problem = problem or _shape_problem(t) or non_finite_problem(t)
        if problem:
            self.corrupt.append(f"{path.name}: {problem}")
            log.warning("%s: %s; not loaded", path, problem)
            return None
        keys, counts, values = t["keys"], t["tokens"].long(), t["token_logps"]
        raw = keys.numpy().tobytes()
        return {raw[row * KEY_BYTES:(row + 1) * KEY_BYTES]: part
                for row, part in enumerate(values.split(counts.tolist()))}

    def _hold(self, name: str, values: dict[bytes, torch.Tensor]) -> None:
        """Keep ``name``'s values in memory as the most recently used; drop the least recently
        used shards past ``memory_bytes`` (always keeping this one)."""
        self._held[name] = values
        self._held_bytes += sum(v.numel() for v in values.values()) * 4
        while self._held_bytes > self.memory_bytes and len(self._held) > 1:
            _, dropped = self._held.popitem(last=False)
            self._held_bytes -= sum(v.numel() for v in dropped.values()) * 4

    def get(self, key: bytes) -> torch.Tensor | None:
        """``(c,)`` fp32 per-token values, or None."""
        value = self._pending.get(key)
        if value is not None:
            return value
        name = self._shard_of.get(key)
        if name is None:
            return None
        values = self._held.get(name)
        if values is None:
            values = self._read(self.dir / name)
            if values is None:  # removed or damaged since it was indexed: its keys are misses now
                self._shard_of = {k: n for k, n in self._shard_of.items() if n != name}
                return None
            self._hold(name, values)
        self._held.move_to_end(name)
        return values.get(key)

    def put(self, key: bytes, token_logps: torch.Tensor) -> None:
        """Record a finite value (visible at once); it reaches the disk at the next ``flush``. A key
        already stored keeps its value."""
        value = token_logps.detach().float().cpu()
        if not bool(torch.isfinite(value).all()):
            return  # a NaN or inf is never cached: it would be served again (and its shard refused whole)
        if key not in self._shard_of:
            self._pending.setdefault(key, value)

    def flush(self) -> None:
        """Write the pending values as one shard (atomically: a reader sees all of it or none)."""
        if not self._pending:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        info = self.dir / "namespace.json"
        if not info.exists():
            atomic_write_text(info, json.dumps(self.namespace.record(), indent=1))
        keys = list(self._pending)
        tensors = {
            "keys": torch.frombuffer(bytearray(b"".join(keys)), dtype=torch.uint8).reshape(-1, KEY_BYTES),
            "tokens": torch.tensor([self._pending[k].numel() for k in keys], dtype=torch.int32),
            "token_logps": torch.cat([self._pending[k] for k in keys]),
        }
        data = save_safetensors(tensors, metadata={"namespace": self.namespace.id})
        name = f"seq-{hashlib.sha256(data).hexdigest()[:16]}.safetensors"
        atomic_write_bytes(self.dir / name, data)
        self._seen.add(name)
        for key in keys:
            self._shard_of[key] = name
        pending, self._pending = self._pending, {}
        self._hold(name, pending)


def recorded_namespace(directory: Path) -> Namespace | None:
    """The namespace ``directory/namespace.json`` records (``SequenceStore.flush`` writes it), or
    None where it is missing or unsound."""
    try:
        record = json.loads(read_regular_file(directory / "namespace.json", 1 << 16))
        return Namespace(**record)
    except (OSError, ValueError, TypeError):
        return None


def _shape_problem(t: dict[str, torch.Tensor]) -> str | None:
    """What is wrong with a look-aside shard's tensors, or None: the shapes ``flush`` writes."""
    keys, tokens, values = t.get("keys"), t.get("tokens"), t.get("token_logps")
    if keys is None or keys.dtype != torch.uint8 or keys.dim() != 2 or keys.shape[1] != KEY_BYTES:
        return "no (n, 16) uint8 'keys' tensor"
    n = keys.shape[0]
    if tokens is None or tokens.dtype != torch.int32 or tuple(tokens.shape) != (n,) or bool((tokens < 0).any()):
        return f"'tokens' is not a ({n},) int32 tensor of counts"
    if values is None or values.dtype != torch.float32 or tuple(values.shape) != (int(tokens.long().sum()),):
        return "'token_logps' does not hold one float32 value per counted token"
    return None
