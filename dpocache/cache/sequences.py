"""Per-token reference values of single sequences ``prompt + completion``: the look-aside cache of
``dpocache.service``.

The same content-addressed scheme as the pair cache (``store.py``): one directory per
``Namespace`` (weights, config, dtype), safetensors shards named by the start of their own
SHA-256 and verified before use, written atomically. The values live in a ``sequences/``
sub-directory of the namespace's directory, so the pair cache's shards and manifest are not
touched and the two kinds of values never mix::

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
from dataclasses import asdict
from pathlib import Path
from typing import Sequence

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from ..data import KEY_BYTES
from .atomic import atomic_write_bytes, atomic_write_text, read_regular_file
from .store import MAX_SHARD_BYTES, Namespace

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


class SequenceStore:
    """Per-token values by ``sequence_key``, for one namespace. Values are held in memory once
    read (4 bytes a token)."""

    def __init__(self, root: str | Path, namespace: Namespace):
        self.namespace = namespace
        self.dir = Path(root) / namespace.id / SUBDIR
        self._values: dict[bytes, torch.Tensor] = {}
        self._seen: set[str] = set()  # shard files already read (or found bad)
        self.corrupt: list[str] = []
        self._pending: dict[bytes, torch.Tensor] = {}

    def __len__(self) -> int:
        return len(self._values)

    def refresh(self) -> int:
        """Read the shards not read yet (another process's, or a previous run's); returns how many."""
        if not self.dir.exists():
            return 0
        new = sorted(p for p in self.dir.glob("seq-*.safetensors") if p.name not in self._seen)
        for path in new:
            self._seen.add(path.name)
            self._load(path)
        return len(new)

    def _load(self, path: Path) -> None:
        try:  # a FIFO, device, directory or link under a shard's name is refused unread
            data = read_regular_file(path, MAX_SHARD_BYTES)
        except OSError as e:
            self.corrupt.append(f"{path.name}: {e}")
            log.warning("%s: %s; not loaded", path, e)
            return
        digest = hashlib.sha256(data).hexdigest()
        if not path.name.startswith(f"seq-{digest[:16]}"):
            self.corrupt.append(f"{path.name}: checksum mismatch (content sha256 {digest[:16]}...)")
            log.warning("%s: checksum mismatch; not loaded", path)
            return
        try:
            t = load_safetensors(data)
            keys, counts, values = t["keys"], t["tokens"].long(), t["token_logps"]
        except Exception as e:  # noqa: BLE001 - a shard that hashes right but does not parse
            self.corrupt.append(f"{path.name}: unreadable ({e})")
            log.warning("%s: unreadable (%s); not loaded", path, e)
            return
        raw = keys.numpy().tobytes()
        for row, part in enumerate(values.split(counts.tolist())):
            self._values.setdefault(raw[row * KEY_BYTES:(row + 1) * KEY_BYTES], part)

    def get(self, key: bytes) -> torch.Tensor | None:
        """``(c,)`` fp32 per-token values, or None."""
        return self._values.get(key)

    def put(self, key: bytes, token_logps: torch.Tensor) -> None:
        """Record a value (visible at once); it reaches the disk at the next ``flush``."""
        value = token_logps.detach().float().cpu()
        if key not in self._values:
            self._pending[key] = value
        self._values[key] = value

    def flush(self) -> None:
        """Write the pending values as one shard (atomically: a reader sees all of it or none)."""
        if not self._pending:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        info = self.dir / "namespace.json"
        if not info.exists():
            atomic_write_text(info, json.dumps(asdict(self.namespace), indent=1))
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
        self._pending = {}
