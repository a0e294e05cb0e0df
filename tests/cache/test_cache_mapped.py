"""The reference cache at scale: shards are mapped, not copied into each process, and each is
hashed once (its digest memoised by size, times and inode), except by ``cache verify``."""

from __future__ import annotations

import os

import pytest
import torch

from dpocache.cache import CacheStore, namespace_for_dir
from dpocache.cache import store as store_module
from dpocache.data.values import PairValues

PAIRS, TOKENS = 2000, 1500  # per-token values: 2 x 2000 x 1500 float32 = 23 MiB


def _anonymous_bytes() -> int:
    with open("/proc/self/smaps_rollup") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("Anonymous:"))


@pytest.fixture
def per_token_cache(tmp_path, model_dir):
    cache = tmp_path / "cache"
    namespace = namespace_for_dir(model_dir, torch.float32, cache)
    store = CacheStore(cache, namespace).open()
    writer = store.writer(shard_pairs=PAIRS // 2)
    keys = [i.to_bytes(16, "little") for i in range(PAIRS)]
    half = PAIRS // 2
    for start in (0, half):  # two shards
        counts = torch.full((half,), TOKENS, dtype=torch.int32)
        token_values = [torch.full((TOKENS,), -float(i % 7)) for i in range(start, start + half)]
        logps = torch.arange(start, start + half, dtype=torch.float32)
        writer.add(keys[start:start + half], PairValues(logps, -logps, counts, counts, token_values, token_values))
    writer.flush()
    assert len(list((cache / namespace.id).glob("shard-*"))) == 2
    return cache, namespace, keys


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps_rollup"), reason="needs Linux's smaps_rollup")
def test_opening_a_cache_maps_its_shards(per_token_cache):
    cache, namespace, keys = per_token_cache
    size = sum(p.stat().st_size for p in (cache / namespace.id).glob("shard-*"))
    assert size > 20 << 20
    before = _anonymous_bytes()
    store = CacheStore(cache, namespace).open()
    values = store.lookup(keys[-3:], per_token=True)
    grown = _anonymous_bytes() - before
    assert len(store) == PAIRS and not store.corrupt
    assert values.chosen_logps.tolist() == [float(PAIRS - 3), float(PAIRS - 2), float(PAIRS - 1)]
    assert float(values.chosen_token_logps[-1][0]) == -float((PAIRS - 1) % 7)
    assert grown < size // 4, f"opening {size} bytes of shards took {grown} bytes of private memory"


def test_a_shard_is_hashed_once_and_again_by_verify(per_token_cache, monkeypatch):
    cache, namespace, _ = per_token_cache
    hashed = []
    real = store_module.FingerprintMemo.sha256

    def counting_memo(self, path):
        before = self.hashed_bytes
        digest = real(self, path)
        hashed.append(self.hashed_bytes - before)
        return digest

    monkeypatch.setattr(store_module.FingerprintMemo, "sha256", counting_memo)
    CacheStore(cache, namespace).open()
    CacheStore(cache, namespace).open()
    assert len(hashed) == 4 and not any(hashed)  # the writer recorded both digests: no open reads a shard again
    verifying = CacheStore(cache, namespace)
    verifying.rehash = True
    calls = []
    monkeypatch.setattr(store_module, "file_sha256", lambda path: calls.append(path) or real_sha(path))
    verifying.open()
    assert len(calls) == 2 and len(verifying) == PAIRS


def real_sha(path):
    from dpocache.cache.fingerprint import file_sha256

    return file_sha256(path)


def test_a_shard_changed_in_place_is_hashed_again_and_refused(per_token_cache):
    cache, namespace, _ = per_token_cache
    CacheStore(cache, namespace).open()  # digests memoised
    shard = sorted((cache / namespace.id).glob("shard-*"))[0]
    raw = bytearray(shard.read_bytes())
    raw[-1] ^= 0x01  # one bit of the last per-token value: same size, still finite
    stat = shard.stat()
    shard.write_bytes(bytes(raw))
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # its mtime put back, as cp -p would
    store = CacheStore(cache, namespace).open()
    assert [bad.file for bad in store.corrupt] == [shard.name]
    assert "checksum mismatch" in store.corrupt[0].reason
