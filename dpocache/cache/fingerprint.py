"""Fingerprints of what changes reference log-probs besides the data: the model's weights (by
content) and its config. Weight-file hashes are memoised by (path, size, mtime, ctime, inode) so
that a cache hit re-hashes nothing; TRL re-hashes the full state dict on every start instead.
The ctime and inode are in the memo's key because the mtime alone can be put back: a file edited
in place whose mtime is restored (``touch -r``, ``cp -p``, ``tar``, normalised image timestamps)
keeps its size and mtime, but every write and every ``utime`` sets the ctime to now, and a file
replaced by another gets another inode.

A model directory that is a Hugging Face cache snapshot (``snapshots/<commit>/<file>`` linking to
``blobs/<name>``) costs no hashing at all: the hub names an LFS file's blob by the SHA-256 of its
content (and a plain git file's by its 40-digit git SHA-1), so a weight file whose blob name is
64 hex digits has that digest as its hash, the same value ``file_sha256`` would compute.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
from pathlib import Path
from typing import Iterator

import torch

from dpocache.cache.atomic import atomic_write_text, file_stamp, read_regular_file
from dpocache.scoring.layout_choice import every_layer_slides

log = logging.getLogger(__name__)

MAX_MEMO_BYTES = 64 << 20
MEMO_NAME = "fingerprints.json"

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")

# Config fields that do not change a forward pass's numbers (the load dtype is ours to set and
# is part of the namespace separately).
_CONFIG_IGNORED = {
    "transformers_version", "_name_or_path", "torch_dtype", "dtype", "use_cache",
    "output_attentions", "output_hidden_states", "return_dict", "_attn_implementation_autoset",
}


_SHA256_NAME = re.compile(r"[0-9a-f]{64}")


def hub_blob_sha256(path: Path) -> str | None:
    """The SHA-256 of ``path`` read from its Hugging Face cache blob's name, or None when
    ``path`` is not a link into a hub cache's ``blobs/`` (of the same repository) whose target
    is an LFS blob (named by 64 hex digits; plain git files are named by their 40-digit SHA-1).
    Blobs are written once by ``huggingface_hub`` and never edited in place."""
    if not path.is_symlink():
        return None
    target = path.resolve()
    repo = path.parent.parent.parent  # <repo>/snapshots/<commit>/<file>
    if path.parent.parent.name != "snapshots" or target.parent != repo.resolve() / "blobs":
        return None
    return target.name if _SHA256_NAME.fullmatch(target.name) else None


def file_sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


class FingerprintMemo:
    """``{absolute path: {size, mtime_ns, ctime_ns, inode, sha256}}`` in one JSON file.

    ``read_only``: for commands that only read the cache (verify, export), a memo that cannot be
    written is skipped (a shared cache mounted read-only): what it would have held goes to the
    user's own memo (``user_memo_path``), read beside it, so that a team's read-only cache is
    hashed once per user, not at every start. Commands that write the cache let the error
    through: it is the first write, and a full or read-only disk should stop them before the
    reference pass, not after it."""

    def __init__(self, memo_file: Path | None, read_only: bool = False):
        self.path = memo_file
        self.read_only = read_only
        own = user_memo_path()
        self.fallback = own if read_only and memo_file is not None and own.absolute() != memo_file.absolute() else None
        self.entries: dict[str, dict] = {**_read_memo(self.fallback), **_read_memo(memo_file)}
        self.hashed_bytes = 0  # bytes actually read this session (0 on a memo hit)
        self._deferred = 0  # ``batched`` blocks open
        self._unwritten: Path | None = None  # the last file remembered within them, not yet written

    def sha256(self, path: Path) -> str:
        digest = hub_blob_sha256(path)
        if digest is not None:  # a hub snapshot's LFS file: its blob's name is its hash
            return digest
        st = path.stat()
        hit = self.entries.get(str(path.resolve()))
        fresh = isinstance(hit, dict) and all(hit.get(k) == v for k, v in file_stamp(st).items())
        if fresh and isinstance(hit.get("sha256"), str):
            return hit["sha256"]
        digest = file_sha256(path)
        self.hashed_bytes += st.st_size
        self.remember(path, digest, st)
        return digest

    def remember(self, path: Path, digest: str, st: os.stat_result | None = None) -> None:
        """Record ``digest`` as ``path``'s, as the file is now (a writer that hashed what it wrote)."""
        self.entries[str(path.resolve())] = {**file_stamp(st or path.stat()), "sha256": digest}
        if self._deferred:
            self._unwritten = path
        else:
            self._write(path)

    @contextlib.contextmanager
    def batched(self) -> Iterator[None]:
        """Within the block, the memo is written once, at its end: written at every file
        remembered, an open of a copied cache (every shard hashed anew) wrote it whole once a
        shard, a time quadratic in the shards (docs/cache.md gives the figure)."""
        self._deferred += 1
        try:
            yield
        finally:
            self._deferred -= 1
            if not self._deferred and self._unwritten is not None:
                path, self._unwritten = self._unwritten, None
                self._write(path)

    def _write(self, path: Path) -> None:
        """The memo to its file; in a memo that cannot be written there, to the user's own."""
        if self.path is None:
            return
        try:
            _write_memo(self.path, self.entries)
        except OSError as e:
            if not self.read_only:
                raise
            if self.fallback is not None:
                try:
                    _write_memo(self.fallback, self.entries)
                    return
                except OSError:
                    pass
            log.info("fingerprint memo %s not written (%s); the next run hashes %s again", self.path,
                     e.strerror or e, path.name)


def user_memo_path() -> Path:
    """The memo of this user's own: where hashes of files in caches they cannot write are kept
    (``$XDG_CACHE_HOME/dpocache``, else ``~/.cache/dpocache``, whatever ``--cache-dir`` is)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "dpocache" / MEMO_NAME


def _read_memo(memo_file: Path | None) -> dict[str, dict]:
    if memo_file is None:
        return {}
    try:
        entries = json.loads(read_regular_file(memo_file, MAX_MEMO_BYTES).decode("utf-8"))
    except (OSError, ValueError, RecursionError):
        return {}  # none, or a damaged (or refused, or unreachable) one: it only costs a re-hash
    return entries if isinstance(entries, dict) else {}


def _write_memo(memo_file: Path, entries: dict[str, dict]) -> None:
    memo_file.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(memo_file, json.dumps(entries, indent=1, sort_keys=True))


def weight_files(model_dir: Path) -> list[Path]:
    files = sorted(p for p in model_dir.iterdir() if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES)
                   and not p.name.startswith(("optimizer", "scheduler", "rng", "training_args")))
    # PEFT adapter weights are not the reference's weights.
    return [p for p in files if not p.name.startswith("adapter_")]


def config_sha256(config: dict) -> str:
    kept = {k: v for k, v in config.items() if k not in _CONFIG_IGNORED}
    if every_layer_slides(kept.get):
        # The shared and packed layouts left out the window of these models until the window
        # rule of prefix.sliding_layers: values of sequences longer than the window, stored
        # before, are wrong. A mark of the corrected rule gives them a namespace of their own,
        # so none is served again; every other model keeps its namespace and its values.
        kept["dpocache_window_on_every_layer"] = 1
    return hashlib.sha256(json.dumps(kept, sort_keys=True, default=str).encode()).hexdigest()


def model_dir_fingerprint(model_dir: str | Path, memo: FingerprintMemo) -> dict:
    """``{"weights_sha256", "config_sha256"}`` of a Hugging Face model directory."""
    model_dir = Path(model_dir)
    files = weight_files(model_dir)
    if not files:
        raise FileNotFoundError(f"{model_dir}: no weight files ({', '.join(WEIGHT_SUFFIXES)})")
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode() + b"\0" + memo.sha256(f).encode() + b"\n")
    config_path = model_dir / "config.json"
    if not config_path.exists():
        raise FileNotFoundError(f"{config_path}: missing")
    return {"weights_sha256": h.hexdigest(), "config_sha256": config_sha256(json.loads(config_path.read_text()))}


def module_fingerprint(model: torch.nn.Module) -> dict:
    """The same fingerprint for a model that lives only in memory (the Python API): its
    state dict by content. Costs a full pass over the weights; directories are memoised."""
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        t = tensor.detach().to("cpu").contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}\n".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return {"weights_sha256": h.hexdigest(), "config_sha256": config_sha256(model.config.to_dict())}


def default_memo_path(cache_dir: Path) -> Path:
    return cache_dir / MEMO_NAME

