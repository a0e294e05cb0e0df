"""Tests for dpocache.cache through its Python API: namespaces and the fingerprint memo, the
store (shards, manifest, checksums), incremental builds and per-token values."""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import pytest
import torch

from dpocache.cache import CacheError, CacheStore, MissingReferenceError, build_missing, namespace_for_dir
from dpocache.cache.build import namespace_for_module
from dpocache.cache.fingerprint import FingerprintMemo, model_dir_fingerprint

ALLOWED_SUFFIXES = (".json", ".safetensors", ".corrupt", ".lock")  # .lock: the empty manifest lock file


class Loader:
    """A ``load_reference`` callable that counts its calls."""

    def __init__(self, reference):
        self.reference = reference
        self.calls = 0

    def __call__(self):
        self.calls += 1
        return self.reference


def _store(cache_dir, model_dir, dtype=torch.float32):
    return CacheStore(cache_dir, namespace_for_dir(model_dir, dtype, cache_dir)).open()


def _build(store, pairs, reference, **kwargs):
    loader = Loader(reference)
    kwargs.setdefault("max_tokens", 2048)
    summary = build_missing(store, pairs, loader, show_progress=False, **kwargs)
    return summary, loader.calls


# ------------------------------------------------------------------------------------ namespace


def test_namespace_depends_on_weights_and_dtype_only(tmp_path, model_dir, other_model_dir, data, reference):
    empty_root, used_root = tmp_path / "a", tmp_path / "b"
    ns = namespace_for_dir(model_dir, torch.float32, empty_root)
    # A cache root that already holds values (and its own memo) gives the same namespace.
    _build(_store(used_root, model_dir), data.pairs[:4], reference)
    assert namespace_for_dir(model_dir, torch.float32, used_root).id == ns.id
    # So does a copy of the weights elsewhere: the weights are identified by content.
    copy = tmp_path / "copy"
    shutil.copytree(model_dir, copy)
    assert namespace_for_dir(copy, torch.float32, empty_root).id == ns.id

    assert namespace_for_dir(model_dir, torch.bfloat16, empty_root).id != ns.id
    assert namespace_for_dir(other_model_dir, torch.float32, empty_root).id != ns.id
    config = json.loads((copy / "config.json").read_text())
    config["rms_norm_eps"] = config["rms_norm_eps"] * 10
    (copy / "config.json").write_text(json.dumps(config))
    assert namespace_for_dir(copy, torch.float32, empty_root).id != ns.id


def test_a_reference_in_another_dtype_than_the_namespace_is_refused_before_any_value(tmp_path, model_dir, data,
                                                                                      reference):
    """A store opened for float32 and a loader giving a bfloat16 reference (the Python API names
    the dtype twice) filed bf16 values under the float32 namespace."""
    from dpocache.models.reference import ReferenceModel

    store = _store(tmp_path / "c", model_dir, torch.float32)
    bf16 = ReferenceModel.from_pretrained(model_dir, "bfloat16", "cpu")
    with pytest.raises(ValueError, match="^the reference runs in bfloat16, but the store's namespace is for float32"):
        _build(store, data.pairs[:4], bf16)
    assert store.missing({p.key: p for p in data.pairs[:4]}) and not list(store.dir.glob("*.safetensors"))
    assert _build(store, data.pairs[:4], reference)[0].computed == 4  # the float32 one fills it


def test_namespace_for_module_follows_the_weights(tiny_models, tokenizer):
    from dpocache.models.tiny import build_model

    a = namespace_for_module(tiny_models["llama"], torch.float32)
    assert namespace_for_module(build_model("llama", tokenizer, seed=0), torch.float32).id == a.id
    assert namespace_for_module(build_model("llama", tokenizer, seed=1), torch.float32).id != a.id
    assert namespace_for_module(tiny_models["llama"], torch.bfloat16).id != a.id


def test_fingerprint_memo_rehashes_nothing_on_a_hit(tmp_path, model_dir):
    memo_file = tmp_path / "fingerprints.json"
    weights = model_dir / "model.safetensors"

    first = FingerprintMemo(memo_file)
    fp = model_dir_fingerprint(model_dir, first)
    assert first.hashed_bytes == weights.stat().st_size > 0
    second = FingerprintMemo(memo_file)  # a later process: the memo is read from disk
    assert model_dir_fingerprint(model_dir, second) == fp
    assert second.hashed_bytes == 0

    # A file whose mtime changed is hashed again (same content, same fingerprint).
    copy = tmp_path / "model"
    shutil.copytree(model_dir, copy)
    third = FingerprintMemo(memo_file)
    assert model_dir_fingerprint(copy, third) == fp and third.hashed_bytes > 0
    st = (copy / "model.safetensors").stat()
    os.utime(copy / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    fourth = FingerprintMemo(memo_file)
    assert model_dir_fingerprint(copy, fourth) == fp and fourth.hashed_bytes == st.st_size


def test_fingerprint_memo_that_cannot_be_written_still_fingerprints(tmp_path, model_dir):
    """A shared cache mounted read-only: verify and export only read it, so the memo's write
    failing must not stop them (here its directory is a file, which even root cannot write into);
    build and train, which write, stop there."""
    (tmp_path / "read-only").write_text("")
    memo = FingerprintMemo(tmp_path / "read-only" / "fingerprints.json", read_only=True)
    assert model_dir_fingerprint(model_dir, memo) == model_dir_fingerprint(model_dir, FingerprintMemo(None))
    # A command that writes the cache stops at this first write (tests/test_errors.py: a full disk).
    with pytest.raises(OSError):
        model_dir_fingerprint(model_dir, FingerprintMemo(tmp_path / "read-only" / "fingerprints.json"))


def _hub_snapshot(model_dir, hf_cache, lfs_names=True):
    """``model_dir`` laid out as ``huggingface_hub`` stores a download: blobs named by the SHA-256
    of an LFS file (the weights) and by the git SHA-1 of any other file, linked from a snapshot."""
    repo = hf_cache / "hub" / "models--org--tiny"
    snapshot = repo / "snapshots" / ("c" * 40)
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for f in sorted(model_dir.iterdir()):
        data = f.read_bytes()
        lfs = f.name.endswith(".safetensors") and lfs_names
        blob = hashlib.sha256(data).hexdigest() if lfs else hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
        (repo / "blobs" / blob).write_bytes(data)
        os.symlink(os.path.join("..", "..", "blobs", blob), snapshot / f.name)
    return snapshot


def test_hub_snapshot_weights_fingerprint_from_blob_names(tmp_path, model_dir):
    hashed = FingerprintMemo(None)
    expected = model_dir_fingerprint(model_dir, hashed)  # by content: every weight byte read
    assert hashed.hashed_bytes > 0

    snapshot = _hub_snapshot(model_dir, tmp_path / "hf")
    memo = FingerprintMemo(None)
    assert model_dir_fingerprint(snapshot, memo) == expected
    assert memo.hashed_bytes == 0  # the digests came from the blob names

    # A blob not named by a SHA-256 (a plain git file's SHA-1) is hashed, to the same value.
    sha1_named = _hub_snapshot(model_dir, tmp_path / "hf-sha1", lfs_names=False)
    memo = FingerprintMemo(None)
    assert model_dir_fingerprint(sha1_named, memo) == expected and memo.hashed_bytes == hashed.hashed_bytes
    # A link to a file named by 64 hex digits outside a hub cache's blobs/ is hashed too.
    loose = tmp_path / "loose"
    loose.mkdir()
    for f in model_dir.iterdir():
        target = tmp_path / (hashlib.sha256(f.name.encode()).hexdigest())  # a name that is not the content's hash
        target.write_bytes(f.read_bytes())
        os.symlink(target, loose / f.name)
    memo = FingerprintMemo(None)
    assert model_dir_fingerprint(loose, memo) == expected and memo.hashed_bytes == hashed.hashed_bytes


# ------------------------------------------------------------------------------------ builds


def test_build_is_incremental_and_keyed_by_content(tmp_path, model_dir, data, reference):
    pairs = data.pairs
    store = _store(tmp_path, model_dir)
    summary, calls = _build(store, pairs[:30], reference)
    assert (summary.computed, summary.reused, calls) == (30, 0, 1)
    assert summary.forward_passes >= 1 and summary.tokens == sum(p.unique_tokens for p in pairs[:30])

    # Reopened from disk: a complete cache loads no model and runs no forward.
    store = _store(tmp_path, model_dir)
    summary, calls = _build(store, list(reversed(pairs[:30])), reference)
    assert (summary.computed, summary.reused, summary.forward_passes, calls) == (0, 30, 0, 0)

    # Duplicates count once; only the new keys are computed.
    summary, _ = _build(store, pairs[25:] + pairs[25:30], reference)
    assert (summary.pairs, summary.unique, summary.computed, summary.reused) == (28, 23, 18, 5)

    values = _store(tmp_path, model_dir).lookup([p.key for p in pairs])
    assert values.chosen_tokens.tolist() == [len(p.chosen_ids) for p in pairs]
    assert values.rejected_tokens.tolist() == [len(p.rejected_ids) for p in pairs]
    assert (values.chosen_logps < 0).all() and (values.rejected_logps < 0).all()


def test_lookup_of_a_missing_key_names_how_many_and_how_to_build(tmp_path, model_dir, data, reference):
    store = _store(tmp_path, model_dir)
    _build(store, data.pairs[:5], reference)
    with pytest.raises(MissingReferenceError) as err:
        store.lookup([p.key for p in data.pairs[:8]])
    assert err.value.missing == 3
    assert "3 of 8" in str(err.value) and "cache build" in str(err.value)


def test_per_token_values_sum_to_the_stored_sums(tmp_path, model_dir, data, reference):
    pairs = data.pairs[:20]
    sums_only = _store(tmp_path, model_dir)
    _build(sums_only, pairs, reference)
    assert not any(sums_only.has(p.key, per_token=True) for p in pairs)
    # A per-token build on a sums-only cache recomputes every pair...
    summary, _ = _build(sums_only, pairs, reference, per_token=True)
    assert summary.computed == len(pairs)
    # ...and a sums-only build on it then has nothing to do.
    summary, _ = _build(sums_only, pairs, reference)
    assert summary.computed == 0

    store = _store(tmp_path, model_dir)
    values = store.lookup([p.key for p in pairs])
    for i, p in enumerate(pairs):
        assert store.has(p.key, per_token=True)
        chosen, rejected = store.token_logps(p.key)
        assert chosen.shape == (len(p.chosen_ids),) and rejected.shape == (len(p.rejected_ids),)
        # Equal up to fp32 summation order (the stored sum ran over the padded row).
        torch.testing.assert_close(chosen.double().sum(), values.chosen_logps[i].double(), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(rejected.double().sum(), values.rejected_logps[i].double(), rtol=1e-6, atol=1e-6)
        assert (chosen < 0).all() and (rejected < 0).all()


# ------------------------------------------------------------------------------------ the store


def _shards(store):
    return sorted(store.dir.glob("shard-*.safetensors"))


def test_store_files_are_json_and_safetensors_only(tmp_path, model_dir, data, reference):
    store = _store(tmp_path, model_dir)
    _build(store, data.pairs[:10], reference, shard_pairs=3, max_tokens=64)
    _build(store, data.pairs[:10], reference, per_token=True)
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert len(_shards(store)) >= 3 and (store.dir / "manifest.json").exists()
    for path in files:
        assert path.name.endswith(ALLOWED_SUFFIXES), path
        head = path.read_bytes()[:4]
        assert not head.startswith(b"\x80"), f"{path}: pickle"  # pickle protocol >= 2
        assert head != b"PK\x03\x04", f"{path}: zip (torch.save)"
    manifest = json.loads((store.dir / "manifest.json").read_text())
    assert manifest["namespace"]["dtype"] == "float32"
    assert {s["file"] for s in manifest["shards"]} == {p.name for p in _shards(store)}


def test_a_corrupt_shard_is_named_not_loaded_and_quarantined(tmp_path, model_dir, data, reference):
    pairs = data.pairs[:12]
    store = _store(tmp_path, model_dir)
    _build(store, pairs, reference, shard_pairs=4, max_tokens=64)
    shards = _shards(store)
    assert len(shards) >= 2
    bad = shards[0]
    raw = bytearray(bad.read_bytes())
    raw[-3] ^= 0xFF
    bad.write_bytes(bytes(raw))

    reopened = _store(tmp_path, model_dir)
    assert [c.file for c in reopened.corrupt] == [bad.name]
    assert "checksum" in reopened.corrupt[0].reason
    assert len(reopened) < len(pairs)

    quarantined = CacheStore(tmp_path, reopened.namespace).open(repair=True)
    assert not bad.exists() and bad.with_name(bad.name + ".corrupt").exists()
    summary, _ = _build(quarantined, pairs, reference)
    assert summary.computed == len(pairs) - len(reopened)
    assert _store(tmp_path, model_dir).corrupt == []


def test_a_builds_open_removes_temp_files_of_killed_writes(tmp_path, model_dir, data, reference):
    """A SIGKILL during a shard's write left ``.shard-*.tmp`` for ever: never read, never removed."""
    from dpocache.cache.store import STALE_TEMP_SECONDS

    store = _store(tmp_path, model_dir)
    _build(store, data.pairs[:4], reference, max_tokens=64)
    shard = _shards(store)[0]
    stale = store.dir / f".{shard.name}.0123456789ab.tmp"
    stale.write_bytes(shard.read_bytes()[:100])  # torn: what the kill left
    stale_dir = store.dir / ".prefs_ds.0123456789ab.tmp"  # a directory (atomic_output_dir's)
    stale_dir.mkdir()
    (stale_dir / "data.arrow").write_bytes(b"x")
    old = os.stat(stale).st_mtime - STALE_TEMP_SECONDS - 60
    for path in (stale, stale_dir):
        os.utime(path, (old, old))
    live = store.dir / ".manifest.json.ba9876543210.tmp"  # a write in progress in another process
    live.write_bytes(b"{")
    keep = store.dir / ".notes.tmp"  # not a name dpocache writes
    keep.write_bytes(b"mine")
    os.utime(keep, (old, old))

    _store(tmp_path, model_dir)  # a read-only open removes nothing
    assert stale.exists() and stale_dir.exists()
    reopened = CacheStore(tmp_path, store.namespace).open(repair=True)
    assert not stale.exists() and not stale_dir.exists()
    assert live.exists() and keep.exists()
    assert reopened.corrupt == [] and len(reopened) == 4


def test_shards_missing_from_the_manifest_are_adopted(tmp_path, model_dir, data, reference):
    """What a build killed between writing a shard and its manifest leaves behind."""
    pairs = data.pairs[:10]
    store = _store(tmp_path, model_dir)
    _build(store, pairs, reference, shard_pairs=3, max_tokens=64)
    before = store.lookup([p.key for p in pairs])
    (store.dir / "manifest.json").unlink()
    reopened = _store(tmp_path, model_dir)
    assert reopened.corrupt == [] and len(reopened) == len(pairs)
    after = reopened.lookup([p.key for p in pairs])
    assert torch.equal(before.chosen_logps, after.chosen_logps)
    assert not (store.dir / "manifest.json").exists()  # a plain open writes nothing (cache info is read-only)
    reopened.open(repair=True)
    assert (store.dir / "manifest.json").exists()  # a build's open rewrites it from the shards
    assert len(reopened) == len(pairs)


# ------------------------------------------------------------------------------------ mistakes in Python


def test_a_reference_of_other_weights_than_the_namespace_is_refused_before_any_value(tmp_path, model_dir,
                                                                                       other_model_dir, data):
    """A store opened for one model and a loader giving another (the Python API names the model
    twice) filed the other's values under the first's namespace, with no error."""
    from dpocache.models.reference import ReferenceModel

    store = _store(tmp_path / "c", model_dir)
    other = ReferenceModel.from_pretrained(other_model_dir, "float32", "cpu")
    with pytest.raises(ValueError, match=f"^the reference was loaded from {other_model_dir.resolve()}, but the "
                       "store's namespace .* is that of other weights"):
        _build(store, data.pairs[:4], other)
    assert not list(store.dir.glob("*.safetensors"))
    # A copy of the same weights elsewhere is the same model.
    shutil.copytree(model_dir, tmp_path / "copy")
    assert _build(store, data.pairs[:4], ReferenceModel.from_pretrained(tmp_path / "copy", "float32", "cpu"))[0] \
        .computed == 4


def test_a_store_read_before_open_says_so(tmp_path, model_dir, data, reference):
    _build(_store(tmp_path / "c", model_dir), data.pairs[:4], reference)
    unopened = CacheStore(tmp_path / "c", namespace_for_dir(model_dir, torch.float32, tmp_path / "c"))
    keys = [p.key for p in data.pairs[:4]]
    for method in (lambda: unopened.lookup(keys), lambda: unopened.missing(keys), lambda: unopened.has(keys[0])):
        with pytest.raises(CacheError, match=r"^CacheStore\.\w+: the store is not open; call store.open\(\) first"):
            method()
    # build_missing opens it: nothing is computed again, no reference loaded
    summary, calls = _build(unopened, data.pairs[:4], reference)
    assert (summary.computed, summary.reused, calls) == (0, 4, 0)


def test_keys_of_the_wrong_type_are_named(tmp_path, model_dir, data, reference):
    store = _store(tmp_path / "c", model_dir)
    _build(store, data.pairs[:4], reference)
    with pytest.raises(TypeError, match="got one bytes object"):
        store.lookup(data.pairs[0].key)  # one key, not a list of them: read as 16 missing pairs
    with pytest.raises(TypeError, match=r"each must be a pair's key \(16 bytes, TokenizedPair.key\), got StoredPair"):
        store.lookup(data.pairs[:2])  # pairs, not their keys
    with pytest.raises(TypeError, match="got str"):
        store.missing(["abc"])
    with pytest.raises(MissingReferenceError) as missing:
        store.lookup([p.key for p in data.pairs[2:8]])
    assert missing.value.positions == [2, 3, 4, 5]  # pairs 4..7 of the data, not built


def test_namespace_dtype_is_a_computed_dtype(tmp_path, model_dir):
    ns = namespace_for_dir(model_dir, torch.float32, tmp_path)
    assert namespace_for_dir(model_dir, "float32", tmp_path).id == ns.id
    with pytest.raises(ValueError, match="^dtype 'auto': a namespace is for the dtype its values are computed in"):
        namespace_for_dir(model_dir, "auto", tmp_path)
    with pytest.raises(ValueError, match="^dtype must be one of auto, float32, bfloat16, float16; got 'fp32'"):
        namespace_for_dir(model_dir, "fp32", tmp_path)
    with pytest.raises(ValueError, match="^dtype must be one of float32, bfloat16, float16; got torch.int64"):
        namespace_for_dir(model_dir, torch.int64, tmp_path)


def test_what_build_missing_is_given_is_checked(tmp_path, model_dir, tokenizer, reference):
    from transformers import AutoModelForCausalLM

    from dpocache.data.pairs import load_preference_data
    from dpocache.data.rows import write_jsonl

    store = _store(tmp_path / "c", model_dir)
    long = write_jsonl([{"prompt": "a " * 600, "chosen": " b", "rejected": " c"}], tmp_path / "long.jsonl")
    pairs = load_preference_data(long, tokenizer, show_progress=False).pairs  # no context given: not checked here
    context = reference.model.config.max_position_embeddings
    with pytest.raises(ValueError, match=rf"^pair 0: \d+ tokens, longer than the model's context \({context} "):
        build_missing(store, pairs, reference, show_progress=False)
    short = write_jsonl([{"prompt": "a", "chosen": " b", "rejected": " c"}], tmp_path / "short.jsonl")
    pairs = load_preference_data(short, tokenizer, show_progress=False).pairs
    with pytest.raises(ValueError, match=r"^pad_id 100000 is outside the model's vocabulary \(0\.\.511\)"):
        build_missing(store, pairs, reference, pad_id=100_000, show_progress=False)
    with pytest.raises(TypeError, match="^load_reference returned a LlamaForCausalLM, not a ReferenceModel"):
        build_missing(store, pairs, lambda: AutoModelForCausalLM.from_pretrained(model_dir), show_progress=False)
    assert not list(store.dir.glob("*.safetensors"))
    assert build_missing(store, pairs, reference, show_progress=False).computed == 1  # the model itself is taken


def test_a_reference_directory_that_is_not_there_is_one_line(tmp_path):
    from dpocache.models.reference import ReferenceModel
    from dpocache.runtime.preflight import UsageError

    with pytest.raises(UsageError, match=f"^path {tmp_path / 'nope'}: no such directory"):
        ReferenceModel.from_pretrained(tmp_path / "nope", "float32", "cpu")


def test_a_copied_cache_writes_its_memo_once_on_open(tmp_path, model_dir, data, reference, monkeypatch):
    """Every shard of a copy is hashed anew (its inodes are new); the memo was written whole once a
    shard (3,000 shards: 173 s to open, 2.2 s with one write)."""
    from dpocache.cache import fingerprint

    for start in range(0, 12, 2):  # a shard a build
        _build(_store(tmp_path / "c", model_dir), data.pairs[start:start + 2], reference)
    shutil.copytree(tmp_path / "c", tmp_path / "copy")
    writes = []
    real = fingerprint._write_memo
    monkeypatch.setattr(fingerprint, "_write_memo", lambda path, entries: (writes.append(path), real(path, entries)))
    store = _store(tmp_path / "copy", model_dir)
    assert len(store) == 12 and len(store.shards) == 6
    assert writes == [tmp_path / "copy" / "fingerprints.json"]


def test_a_memo_that_cannot_be_written_goes_to_the_users_own(tmp_path, model_dir, monkeypatch):
    """A team's read-only cache: its memo cannot take this user's hashes, which went nowhere (every
    start hashed the weights and every shard again)."""
    from dpocache.cache import fingerprint

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "mine"))
    shared = tmp_path / "shared" / "fingerprints.json"
    real = fingerprint._write_memo

    def read_only_shared(path, entries):
        if path == shared:
            raise PermissionError(13, "Permission denied", str(path))
        real(path, entries)

    monkeypatch.setattr(fingerprint, "_write_memo", read_only_shared)
    first = FingerprintMemo(shared, read_only=True)
    digest = model_dir_fingerprint(model_dir, first)
    assert first.hashed_bytes > 0 and (tmp_path / "mine" / "dpocache" / "fingerprints.json").exists()
    again = FingerprintMemo(shared, read_only=True)
    assert model_dir_fingerprint(model_dir, again) == digest and again.hashed_bytes == 0
    with pytest.raises(PermissionError):  # a command that writes the cache: its first write stops it
        FingerprintMemo(shared).remember(model_dir / "config.json", "0" * 64)


def test_pairs_tokenized_elsewhere_are_cached_and_read_as_loaded_ones(tmp_path, model_dir, data, reference):
    """docs/data.md: pairs tokenized by other code (open-instruct's) as ``TokenizedPair``s with
    ``example_key``: the same keys, so the same cached values, as the pairs dpocache tokenized."""
    from dpocache.data import TokenizedPair, example_key
    from dpocache.scoring import policy_logps
    from dpocache.scoring.logprobs import CompletionLogProbs

    own = [TokenizedPair(i, tuple(p.prompt_ids), tuple(p.chosen_ids), tuple(p.rejected_ids),
                         key=example_key(p.prompt_ids, p.chosen_ids, p.rejected_ids))
           for i, p in enumerate(data.pairs[:6])]
    store = _store(tmp_path / "c", model_dir)
    assert _build(store, own, reference)[0].computed == 6
    assert _build(store, data.pairs[:6], reference)[0].reused == 6  # the same keys
    values = store.lookup([p.key for p in own])
    mine = policy_logps(CompletionLogProbs(reference.model), own, pad_id=0)
    torch.testing.assert_close(mine.chosen_logps, values.chosen_logps, rtol=0, atol=1e-4)


def test_a_namespace_of_a_directory_that_is_not_there_is_one_line(tmp_path):
    with pytest.raises(FileNotFoundError, match=f"^{tmp_path / 'nope'}: no such directory"):
        namespace_for_dir(tmp_path / "nope", torch.float32, tmp_path)
