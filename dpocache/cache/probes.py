"""The fast-path probe's verdicts for sharded models, remembered per architecture in the cache
directory (``probes.json``).

``CompletionLogProbs.probe_fast_path`` checks, with one short forward, that the chunked output
head reproduces the model's own head. Unsharded that costs one small forward. On a model sharded
with FSDP2 it also all-gathers the root's parameters (the final norm and, in a policy, the whole
output head) and the input embeddings, each held twice for a moment (FSDP's all-gather buffer
and the unsharded copy): at start-up of ``train --fsdp`` that was the largest allocation a
process made besides its own shards (``bench/bench_sharded.py``).

The verdict is a property of the architecture's code and configuration, the dtype, the device
type and the library versions, not of the weights: a sharded reference pass (the one of
``cache build --fsdp``, or the build ``train --fsdp`` runs) records it, and a later sharded run
of the same architecture (the policy of ``train --fsdp``, a sweep's next build) takes it from
here instead of probing again. Rank 0 reads the file and broadcasts the verdict, so every rank
makes the same choice (the probe is a collective). The file is a memo, like ``fingerprints.json``:
a missing or unreadable one costs one probe, never a wrong answer from a stale key.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
from pathlib import Path

import torch

from dpocache import __version__
from dpocache.cache.atomic import atomic_write_text, read_regular_file
from dpocache.cache.fingerprint import config_sha256

PROBES_FILE = "probes.json"
MAX_PROBES_BYTES = 16 << 20  # about 200,000 verdicts


def probe_key(config, dtype: torch.dtype, device: torch.device | str) -> str:
    """What a probe's verdict depends on: the configuration (the namespace's config hash, which
    names the architecture), the compute dtype, the device type, and the versions of the code
    that computes both sides (torch, transformers, dpocache)."""
    versions = {name: importlib.metadata.version(name) for name in ("torch", "transformers")}
    versions["dpocache"] = __version__
    record = {"config_sha256": config_sha256(config.to_dict()), "dtype": str(dtype),
              "device": torch.device(device).type, **versions}
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()


class ProbeMemo:
    """``{probe key: fast path usable}`` in ``<cache dir>/probes.json``."""

    def __init__(self, cache_dir: str | Path):
        self.path = Path(cache_dir) / PROBES_FILE

    def _read(self) -> dict[str, bool]:
        try:  # as every cache file: a link, FIFO or device under its name is not read (UnsafeFileError)
            raw = json.loads(read_regular_file(self.path, MAX_PROBES_BYTES).decode("utf-8"))
        except (OSError, ValueError, RecursionError):
            return {}
        if not isinstance(raw, dict):
            return {}
        return {k: v for k, v in raw.items() if isinstance(k, str) and isinstance(v, bool)}

    def get(self, key: str) -> bool | None:
        return self._read().get(key)

    def put(self, key: str, verdict: bool) -> None:
        """Read, merge, write atomically; a cache directory that cannot be written is left as it is
        (the next run probes again)."""
        entries = self._read()
        entries[key] = verdict
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(self.path, json.dumps(entries, indent=1, sort_keys=True))
        except OSError:
            pass
