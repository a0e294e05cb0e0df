"""Tests for dpocache.data.values.PairValues: the one record a pair's values take from the reference
pass (``score_batch``) through ``ShardWriter.add`` and ``CacheStore.lookup`` to training, and
that shards written in the format before the record existed still load."""

from __future__ import annotations

import hashlib

import pytest
import torch
from safetensors.torch import save as save_safetensors

from dpocache.cache import CacheError, CacheStore, Namespace, namespace_for_module
from dpocache.cache.build import score_batch
from dpocache.cache.store import SCHEMA_VERSION
from dpocache.data.pairs import load_preference_data
from dpocache.data.values import PairValues
from dpocache.models.reference import ReferenceModel


@pytest.fixture(scope="module")
def pairs(tokenizer, make_rows):
    return load_preference_data(make_rows(6, seed=11), tokenizer, show_progress=False).pairs


def _values(n: int, per_token: bool = True, seed: int = 0) -> PairValues:
    g = torch.Generator().manual_seed(seed)
    counts_c = torch.randint(1, 6, (n,), generator=g, dtype=torch.int32)
    counts_r = torch.randint(1, 6, (n,), generator=g, dtype=torch.int32)
    cpt = [-torch.rand(int(c), generator=g) for c in counts_c]
    rpt = [-torch.rand(int(c), generator=g) for c in counts_r]
    sums_c = torch.stack([t.sum() for t in cpt])
    sums_r = torch.stack([t.sum() for t in rpt])
    return PairValues(sums_c, sums_r, counts_c, counts_r, cpt if per_token else None, rpt if per_token else None)


def _assert_same(a: PairValues, b: PairValues) -> None:
    for name in PairValues.pair_fields():
        assert torch.equal(getattr(a, name), getattr(b, name).to(getattr(a, name).dtype)), name
    for name in PairValues.token_fields():
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        if x is not None:
            assert len(x) == len(y) and all(torch.equal(s, t) for s, t in zip(x, y)), name


def _keys(n: int, salt: str = "") -> list[bytes]:
    return [hashlib.sha256(f"{salt}{i}".encode()).digest()[:16] for i in range(n)]


def test_select_cat_to_and_finite():
    v = _values(5)
    picked = v.select([3, 0])
    assert picked.chosen_logps.tolist() == [v.chosen_logps[3].item(), v.chosen_logps[0].item()]
    assert picked.rejected_token_logps[0] is v.rejected_token_logps[3]
    _assert_same(PairValues.cat([v.select([0, 1]), v.select([2, 3, 4])]), v)
    assert PairValues.cat([v, v.sums_only()]).chosen_token_logps is None  # a field is kept only if all have it
    _assert_same(v.to("cpu"), v)
    bad = v.select(range(5))
    bad.rejected_token_logps[2] = torch.tensor([0.0, float("nan")])
    assert bad.finite().tolist() == [True, True, False, True, True]
    assert len(v.select(v.finite())) == 5


def test_writer_and_lookup_take_and_give_the_record(tmp_path, tiny_models, pairs, tokenizer):
    """The reference pass's record goes into the writer as it is and comes back out of the store
    equal (sums and counts always, per-token values when asked for)."""
    model = tiny_models["llama"]
    reference = ReferenceModel(model, torch.float32, layout="padded")
    values = score_batch(reference, pairs, tokenizer.pad_token_id)
    assert isinstance(values, PairValues) and len(values) == len(pairs)
    assert values.chosen_tokens.tolist() == [len(p.chosen_ids) for p in pairs]
    store = CacheStore(tmp_path, namespace_for_module(model, torch.float32)).open()
    writer = store.writer(shard_pairs=4)  # two shards: lookup gathers across them
    writer.add([p.key for p in pairs[:4]], values.select(range(4)))
    writer.add([p.key for p in pairs[4:]], values.select(range(4, len(pairs))))
    writer.flush()
    assert len(store.shards) == 2
    keys = [p.key for p in reversed(pairs)]
    order = list(reversed(range(len(pairs))))
    _assert_same(CacheStore(tmp_path, store.namespace).open().lookup(keys, per_token=True), values.select(order))
    assert store.lookup(keys).chosen_token_logps is None  # per-token values only when asked for
    with pytest.raises(ValueError, match="6 keys for 4 pairs"):
        writer.add([p.key for p in pairs], values.select(range(4)))


def test_shard_in_the_format_before_the_record_still_loads(tmp_path):
    """A shard as the store wrote it before ``PairValues`` (tensor names, dtypes and metadata
    written out here by hand, not by ``ShardWriter``) loads, with and without per-token values."""
    namespace = Namespace("0" * 64, "1" * 64, "float32")
    store = CacheStore(tmp_path, namespace)
    store.dir.mkdir(parents=True)
    keys = _keys(3)
    sums = {"keys": torch.frombuffer(bytearray(b"".join(keys)), dtype=torch.uint8).reshape(3, 16),
            "chosen_logps": torch.tensor([-1.5, -2.0, -0.25]), "rejected_logps": torch.tensor([-3.0, -1.0, -4.5]),
            "chosen_tokens": torch.tensor([2, 1, 1], dtype=torch.int32),
            "rejected_tokens": torch.tensor([1, 2, 3], dtype=torch.int32)}
    pt_keys = torch.frombuffer(bytearray(b"".join(_keys(3, "pt"))), dtype=torch.uint8).reshape(3, 16)
    per_token = {**sums, "keys": pt_keys,
                 "chosen_token_logps": torch.tensor([-1.0, -0.5, -2.0, -0.25]),
                 "rejected_token_logps": torch.tensor([-3.0, -0.5, -0.5, -1.5, -1.5, -1.5])}
    for tensors in (sums, per_token):
        data = save_safetensors(tensors, metadata={"schema": str(SCHEMA_VERSION), "namespace": namespace.id})
        (store.dir / f"shard-{hashlib.sha256(data).hexdigest()[:16]}.safetensors").write_bytes(data)
    store.open()
    assert not store.corrupt and len(store) == 6
    got = store.lookup(keys)
    assert got.chosen_logps.tolist() == [-1.5, -2.0, -0.25] and got.rejected_tokens.tolist() == [1, 2, 3]
    assert got.chosen_logps.dtype == torch.float32 and got.chosen_tokens.dtype == torch.int32
    with_tokens = store.lookup(_keys(3, "pt")[::-1], per_token=True)
    assert [t.tolist() for t in with_tokens.chosen_token_logps] == [[-0.25], [-2.0], [-1.0, -0.5]]
    assert [t.tolist() for t in with_tokens.rejected_token_logps] == [[-1.5, -1.5, -1.5], [-0.5, -0.5], [-3.0]]
    with pytest.raises(CacheError, match="without per-token values"):
        store.lookup(keys, per_token=True)
