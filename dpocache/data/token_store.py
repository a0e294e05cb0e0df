"""The token store: a data set's tokenized pairs on disk, keyed by everything that changes their
ids, written once and memory-mapped by every later run and every process.

A store is a directory ``<cache dir>/tokens/<key>/`` of ``.npy`` arrays (``TokenColumns``: every
pair's ids in one int32 array, its bounds, source rows and lines, keys and truncation flags), the
rows skipped as invalid (``skipped.jsonl``) and ``meta.json`` (what was stored, the files'
checksums). Numpy's ``.npy`` rather than Arrow: the columns are flat integer arrays that
``np.load(mmap_mode="r")`` maps without a copy and reads by slice; nothing here needs Arrow's
nested types, and measured on 20,000 pairs it opens, reads and writes faster without pyarrow's
memory in the process (docs/benchmarks/scale-cpu-2core-20261125.md).

The key (``store_key``) covers the data file's bytes and suffix (a source of several files: each
one's name and bytes, in reading order), the tokenizer (its full definition, chat template and
special tokens), the length limits, the column mapping, the versions of transformers and
tokenizers, and ``RULES``, the version of dpocache's tokenization rules. It leaves out what is
checked after loading (the model's vocabulary and context) and ``--skip-invalid`` (the store
lists the invalid rows; a run without the flag refuses the first).

Written atomically: into ``.tmp-<key>-<pid>/``, each file synced, then renamed into place; a
process killed on the way leaves a temporary directory that nothing reads and the next build of
that key removes. While it tokenizes, a build keeps each finished chunk of rows in
``.partial-<key>/`` (``TokenizedChunks``): a build stopped by a signal or a crash loses at most
the chunk it was in, and the next build of the key tokenizes only the rest. One process builds a
key at a time (a lock file beside the store): the ranks of a job on one machine, or of several
machines on a shared file system, wait for the first and then map what it wrote. An edited data
file has a new key and gets a new store; the old one stays until ``dpocache cache`` housekeeping
removes it.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import shutil
import sys
import time
import zipfile
from contextlib import contextmanager
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from dpocache.data.columns import TokenColumns

RULES = 1  # dpocache's tokenization rules: raise when a rule change changes the ids
STORE_DIR = "tokens"
PARTIAL_PREFIX = ".partial-"  # a build's tokenized chunks (TokenizedChunks), beside the stores
_READ_CHUNK = 1 << 22


@dataclass
class StoredTokens:
    """What a store holds: the columns, the rows skipped as invalid (``(where, field, reason)``,
    ``where`` being the line or row number after the source's name, in a source of several
    files ``[file number, line or row]``), how rows are located (``"line"`` or ``"row"``), and a
    source of several files' ``files``: each one's name and first row, in reading order."""

    columns: TokenColumns
    skipped: list[tuple[str, str | None, str]] = field(default_factory=list)
    location_kind: str = "line"
    path: Path | None = None  # the store's directory; None for columns held in memory
    files: list[tuple[str, int]] = field(default_factory=list)


def _digest_file(h, path: Path) -> None:
    with open(path, "rb") as f:
        while chunk := f.read(_READ_CHUNK):
            h.update(chunk)


def source_digest(path: Path, files: list[Path] | None = None) -> str:
    """BLAKE2b of the data's bytes: a file's, a directory's files with their relative names, or
    those of ``files`` (a source of several data files) with their names."""
    h = hashlib.blake2b(digest_size=16)
    if files is not None:
        for file in files:
            h.update(file.name.encode() + b"\0")
            _digest_file(h, file)
    elif path.is_dir():
        for file in sorted(p for p in path.rglob("*") if p.is_file()):
            h.update(str(file.relative_to(path)).encode() + b"\0")
            _digest_file(h, file)
    else:
        _digest_file(h, path)
    return h.hexdigest()


def tokenizer_digest(tokenizer) -> str | None:
    """BLAKE2b of what in ``tokenizer`` can change ids: the fast tokenizer's full definition
    (vocabulary, merges, normalizer, pre-tokenizer, added tokens), its chat template and special
    tokens. None for a tokenizer without a fast backend (no definition to hash: not stored)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    h = hashlib.blake2b(digest_size=16)
    h.update(backend.to_str().encode())
    extras = [type(tokenizer).__name__, getattr(tokenizer, "chat_template", None),
              sorted((k, str(v)) for k, v in tokenizer.special_tokens_map.items()),
              tokenizer.eos_token_id, getattr(tokenizer, "split_special_tokens", False)]
    h.update(json.dumps(extras, sort_keys=True, default=str).encode())
    return h.hexdigest()


def store_key(source: Path, tokenizer, settings: dict[str, Any], files: list[Path] | None = None) -> str | None:
    """The store's name for ``source`` tokenized by ``tokenizer`` under ``settings`` (the length
    limits and column mapping); None where the tokenizer cannot be keyed. ``files``: the data
    files ``source`` names (a pattern, or a folder of them: ``dpocache.data.sources``)."""
    tok = tokenizer_digest(tokenizer)
    if tok is None:
        return None
    suffix = (files[0] if files else source).suffix.lower()
    inputs = {"rules": RULES, "data": source_digest(source, files), "suffix": suffix, "tokenizer": tok,
              "transformers": version("transformers"), "tokenizers": version("tokenizers"), **settings}
    return hashlib.blake2b(json.dumps(inputs, sort_keys=True).encode(), digest_size=16).hexdigest()


# --------------------------------------------------------------------------------------------
# Writing and reading


def _checksum(path: Path) -> str:
    h = hashlib.blake2b(digest_size=16)
    _digest_file(h, path)
    return h.hexdigest()


def _save_array(path: Path, array: np.ndarray) -> None:
    with open(path, "wb") as f:
        try:
            np.save(f, array, allow_pickle=False)
        except OSError as e:
            if e.errno is not None:
                raise
            # numpy's short write ("67471 requested and 35808 written") says neither why nor where:
            # a full disk, said as the OS says it, so that it is one line naming the file.
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path)) from e
        f.flush()
        os.fsync(f.fileno())


def _write(directory: Path, tokens: StoredTokens, source: str, settings: dict[str, Any] | None = None) -> None:
    directory.mkdir(parents=True)
    checksums = {}
    for name in TokenColumns.NAMES:
        path = directory / f"{name}.npy"
        _save_array(path, getattr(tokens.columns, name))
        checksums[path.name] = _checksum(path)
    with open(directory / "skipped.jsonl", "w", encoding="utf-8") as f:
        for where, field_name, reason in tokens.skipped:
            f.write(json.dumps({"where": where, "field": field_name, "reason": reason}) + "\n")
        f.flush()
        os.fsync(f.fileno())
    checksums["skipped.jsonl"] = _checksum(directory / "skipped.jsonl")
    # source, settings and created: for the eye (``cache info``); the key alone identifies the store
    meta = {"rules": RULES, "source": source, "settings": settings or {}, "created": time.strftime("%Y-%m-%d %H:%M"),
            "pairs": len(tokens.columns), "tokens": int(len(tokens.columns.ids)),
            "skipped": len(tokens.skipped), "location_kind": tokens.location_kind, "files": tokens.files,
            "checksums": checksums}
    with open(directory / "meta.json", "w", encoding="utf-8") as f:  # last: a directory with it is complete
        json.dump(meta, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


class TokenizedChunks:
    """The chunks of rows one build of a store has tokenized so far, on disk as each ends: in
    ``directory`` (``.partial-<key>/``), chunk ``start`` of ``count`` rows as ``chunk-<start>-
    <count>.npz`` (its ``TokenColumns``) and ``.json`` (its rows found unfit, written last: a
    chunk without it is not read). The key covers what changes a chunk's ids, so a later build
    of the key takes them as they are. Removed once the store is written. Where a chunk cannot
    be written (a full disk) the build goes on without keeping the rest."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.saving = True
        self.rows_kept = 0  # rows of the chunks on disk whole: loaded, or saved by this build

    def _path(self, start: int, count: int, suffix: str) -> Path:
        return self.directory / f"chunk-{start:010d}-{count}{suffix}"

    def load(self, start: int, count: int) -> tuple[TokenColumns, list[tuple[str, str | None, str]]] | None:
        """Chunk ``start`` of ``count`` rows as an earlier build kept it: its columns and its rows
        found unfit (``(location, field, reason)``); None where there is none whole."""
        try:
            text = self._path(start, count, ".json").read_text(encoding="utf-8")
            unfit = [(location, field_name, reason) for location, field_name, reason in json.loads(text)]
            with np.load(self._path(start, count, ".npz"), allow_pickle=False) as arrays:
                columns = TokenColumns(**{name: arrays[name] for name in TokenColumns.NAMES})
        except (OSError, ValueError, KeyError, TypeError, EOFError, zipfile.BadZipFile):  # none, or not whole
            return None
        if len(columns) + len(unfit) != count:
            return None
        self.rows_kept += count
        return columns, unfit

    def save(self, start: int, count: int, columns: TokenColumns, unfit: list[tuple[str, str | None, str]]) -> None:
        """Keep chunk ``start`` of ``count`` rows: each file written whole, then renamed."""
        if not self.saving:
            return
        arrays = {name: getattr(columns, name) for name in TokenColumns.NAMES}
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            _write_whole(self._path(start, count, ".npz"), lambda f: np.savez(f, **arrays))
            _write_whole(self._path(start, count, ".json"), lambda f: f.write(json.dumps(unfit).encode()))
        except OSError:  # the store's own write, next, names a full or read-only disk in one line
            self.saving = False
            return
        self.rows_kept += count

    def remove(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)


def _write_whole(path: Path, write: Callable) -> None:
    """``write(file)`` into a temporary file beside ``path``, synced, then renamed to ``path``."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class StoreError(RuntimeError):
    """A store that fails its checks: it is removed and built again."""


def open_store(directory: Path, verify: bool = True) -> StoredTokens:
    """Map a store's arrays read-only after checking its files against ``meta.json`` (their
    checksums only with ``verify``: the process that has just written them knows them). A file
    missing, unreadable or not as recorded is a ``StoreError``."""
    try:
        return _open_checked(directory, verify)
    except (OSError, ValueError, KeyError) as e:
        raise StoreError(f"{directory}: unreadable ({e})") from None


def _open_checked(directory: Path, verify: bool) -> StoredTokens:
    meta = json.loads((directory / "meta.json").read_text(encoding="utf-8"))
    if meta.get("rules") != RULES:
        raise StoreError(f"{directory}: written under tokenization rules {meta.get('rules')}, not {RULES}")
    for name, expected in meta["checksums"].items() if verify else ():
        if _checksum(directory / name) != expected:
            raise StoreError(f"{directory}: {name} does not match its checksum")
    arrays = {name: np.load(directory / f"{name}.npy", mmap_mode="r", allow_pickle=False)
              for name in TokenColumns.NAMES}
    columns = TokenColumns(**arrays)
    if len(columns) != meta["pairs"] or len(columns.ids) != meta["tokens"]:
        raise StoreError(f"{directory}: {len(columns)} pairs and {len(columns.ids)} tokens, meta.json says "
                         f"{meta['pairs']} and {meta['tokens']}")
    with open(directory / "skipped.jsonl", encoding="utf-8") as f:
        skipped = [(r["where"], r["field"], r["reason"]) for r in map(json.loads, f)]
    files = [(name, first) for name, first in meta.get("files", [])]
    return StoredTokens(columns, skipped, meta["location_kind"], directory, files)


@contextmanager
def _building(lock, store: Path, show_progress: bool) -> Iterator[None]:
    """Hold the build lock of ``store`` (the open file ``lock``); say so when another process
    holds it first."""
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        if show_progress:
            print(f"tokens: waiting for another process tokenizing the data (another rank of this job, or another "
                  f"command): {store}", file=sys.stderr)
        fcntl.flock(lock, fcntl.LOCK_EX)
    try:
        yield
    finally:
        fcntl.flock(lock, fcntl.LOCK_UN)


def open_or_build(cache_dir: Path, key: str, source: str, build: Callable[[TokenizedChunks | None], StoredTokens],
                  show_progress: bool = True, read_only: bool = False,
                  settings: dict[str, Any] | None = None) -> StoredTokens:
    """The store ``key`` under ``cache_dir``, built with ``build(chunks)`` and written first if
    there is none (or none that passes its checks); ``chunks``: where the build keeps what it has
    tokenized as it goes (``TokenizedChunks``), None where the cache cannot hold it. A
    ``build`` that raises writes no store (its finished chunks stay for the next build). A cache
    directory that cannot hold the store (full, read-only) raises the ``OSError``, as the cache's
    own writes do, unless ``read_only`` (a command that only reads the cache) or the directory is
    one this user may not write: then it costs a line and the store, the tokens kept in memory.
    ``source`` and ``settings`` (the key's length limits and columns) are recorded in the store's
    ``meta.json`` for ``cache info``."""
    root = Path(cache_dir) / STORE_DIR
    final = root / key
    if (final / "meta.json").exists():
        try:
            return open_store(final)
        except StoreError as e:
            print(f"tokens: {e}; tokenizing again", file=sys.stderr)
    try:
        root.mkdir(parents=True, exist_ok=True)
        lock = open(root / f".{key}.lock", "a")
    except OSError as e:
        # A token store is a convenience, never a value: where this user cannot write one (a
        # team's tokens/ made by a colleague, the cache read-only), the data is tokenized in memory.
        if not read_only and e.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise
        print(f"tokens: no token store in {root} ({e.strerror or e}); the data is tokenized in memory, "
              "again at every start", file=sys.stderr)
        return build(None)
    with lock, _building(lock, root / key, show_progress):
        return _build_locked(root, key, source, build, read_only, settings, show_progress)


def _build_locked(root: Path, key: str, source: str, build: Callable[[TokenizedChunks | None], StoredTokens],
                  read_only: bool, settings: dict[str, Any] | None = None,
                  show_progress: bool = False) -> StoredTokens:
    final = root / key
    if (final / "meta.json").exists():
        try:
            return open_store(final)  # written by the process that held the lock
        except StoreError:
            pass
    # A store of this key that failed its checks has said why itself.
    damaged = (final / "meta.json").exists()
    why = _why_tokenized_again(root, key, source, settings or {}) if show_progress and not damaged else None
    if why:
        print(f"tokens: {why}", file=sys.stderr)
    for stale in [*root.glob(f".tmp-{key}-*"), final]:  # killed builds and a store that failed its checks
        shutil.rmtree(stale, ignore_errors=True)
    chunks = TokenizedChunks(root / f"{PARTIAL_PREFIX}{key}")
    tokens = build(chunks)
    tmp = root / f".tmp-{key}-{os.getpid()}"
    try:
        _write(tmp, tokens, source, settings)
        os.rename(tmp, final)
        _sync_dir(root)
        chunks.remove()
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        chunks.remove()  # the tokens are whole in memory; a full disk gets its space back
        if not read_only:
            raise
        print(f"tokens: the token store could not be written in {root} ({e.strerror or e}); the data stays in "
              "memory", file=sys.stderr)
        return tokens
    return open_store(final, verify=False)  # mapped: the builder, too, keeps no private copy


def _why_tokenized_again(root: Path, key: str, source: str, settings: dict[str, Any]) -> str | None:
    """Why ``source``, which has another store here already, is tokenized again: its length
    limits or columns differ from every such store's (named), or else the file or the tokenizer
    differs from that store's (the key covers both); None where no other store of it is here
    (a store of this ``key`` that failed its checks has said so itself)."""
    earlier = [store["meta"] for store in token_stores(root.parent)
               if store["path"].name != key and store["meta"] and store["meta"].get("source") == source
               and store["meta"].get("settings")]
    if not earlier:
        return None

    def differences(seen: dict) -> list[str]:
        return [f"{name} {settings.get(name)} (the cache has {seen.get(name)})" for name in sorted(settings)
                if settings.get(name) != seen.get(name)]

    changed = min((differences(meta["settings"]) for meta in earlier), key=len)  # against the closest store
    if changed:
        return f"{source} is tokenized again for {', '.join(changed)}; the other store stays"
    return (f"{source} is tokenized again: the file, or the tokenizer, is not the one its other store here was "
            "made from (that store stays, for runs of those)")


def token_stores(cache_dir: Path) -> list[dict]:
    """The stores under ``cache_dir``: each one's path, size in bytes and ``meta.json`` (None for a
    temporary directory a killed build left)."""
    root = Path(cache_dir) / STORE_DIR
    if not root.is_dir():
        return []
    out = []
    for path in sorted(p for p in root.iterdir() if p.is_dir()):
        try:
            meta = json.loads((path / "meta.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            meta = None
        out.append({"path": path, "meta": meta, "bytes": sum(f.stat().st_size for f in path.iterdir())})
    return out


def _sync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
