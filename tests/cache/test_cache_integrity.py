"""The cache admits only its own, well-formed values: shards are checked against their
namespace, the manifest names files (never paths) and is rebuilt when malformed, only regular
files are read, no NaN or inf is stored or verified as OK, files are written with the umask,
concurrent builds lose nothing, and the fingerprint memo is not fooled by a restored mtime.

Hostile files (a FIFO, a link to ``/dev/zero``) are opened by a real ``python -m dpocache``
process under a memory limit and a generous deadline, so that a regression fails the test
instead of hanging or exhausting the machine; nothing asserts on timing."""

from __future__ import annotations

import hashlib
import json
import os
import resource
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save, save_file
from train_fixtures import flags, run_json

from dpocache.cache import CacheError, CacheStore, build_missing, namespace_for_dir, verify
from dpocache.cache.build import build_distributed, open_namespace_dir
from dpocache.cache.fingerprint import FingerprintMemo, model_dir_fingerprint
from dpocache.cache.sequences import SequenceStore, sequence_key
from dpocache.cache.store import MANIFEST, Namespace, parse_manifest
from dpocache.distributed.process_group import DistEnv
from dpocache.models.reference import ReferenceModel

HOSTILE_DEADLINE_S = 300  # only a regression (a hang) comes near it


@pytest.fixture(scope="module")
def other_reference(other_model_dir):
    return ReferenceModel.from_pretrained(other_model_dir, "float32", device="cpu")


def _store(cache_dir, model_dir, repair=False):
    return CacheStore(cache_dir, namespace_for_dir(model_dir, torch.float32, Path(cache_dir))).open(repair=repair)


def _build(store, pairs, reference, **kwargs):
    kwargs.setdefault("max_tokens", 64)
    kwargs.setdefault("shard_pairs", 4)
    return build_missing(store, pairs, lambda: reference, show_progress=False, **kwargs)


def _shards(directory: Path) -> list[Path]:
    return sorted(directory.glob("shard-*.safetensors"))


def _manifest_files(store) -> set[str]:
    return {s["file"] for s in json.loads((store.dir / MANIFEST).read_text())["shards"]}


def _write_shard(directory: Path, tensors: dict, namespace_id: str) -> Path:
    """A shard as ``CacheStore.add_shard`` writes it (content-addressed name, namespace in its
    metadata), without its checks: how a buggy or hostile writer would leave one."""
    raw = save(tensors, metadata={"schema": "1", "namespace": namespace_id})
    path = directory / f"shard-{hashlib.sha256(raw).hexdigest()[:16]}.safetensors"
    path.write_bytes(raw)
    return path


def _cache_info(cache_dir: Path) -> subprocess.CompletedProcess:
    """``python -m dpocache cache info`` in its own process: at most 4 GiB of address space
    (a read of /dev/zero fails fast instead of taking the machine's memory), and a deadline
    far above its few seconds (a FIFO read would block forever)."""

    def limits():
        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))

    return subprocess.run([sys.executable, "-m", "dpocache", "cache", "info", "--cache-dir", str(cache_dir)],
                          capture_output=True, text=True, timeout=HOSTILE_DEADLINE_S, preexec_fn=limits)


def _open_as_user(uid: int, ns_dir: Path) -> dict:
    """Open ``ns_dir`` as ``cache info`` does, in a forked child running as ``uid`` with no
    group of ours (only "other" permissions apply). A fork, not a new interpreter: the
    interpreter itself may live where that user cannot reach it."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        try:
            os.close(read_end)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            store = open_namespace_dir(ns_dir)
            result = {"pairs": len(store), "corrupt": [str(c) for c in store.corrupt]}
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            result = {"error": repr(e)}
        os.write(write_end, json.dumps(result).encode())
        os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as f:
        raw = f.read()
    os.waitpid(pid, 0)
    return json.loads(raw)


# ------------------------------------------------------------------------------ namespaces


def test_a_shard_copied_from_another_namespace_is_refused_and_quarantined(tmp_path, model_dir, other_model_dir,
                                                                         data, reference, other_reference):
    mine, theirs = data.pairs[:8], data.pairs[8:16]
    store = _store(tmp_path, model_dir)
    _build(store, mine, reference)
    other = _store(tmp_path, other_model_dir)
    _build(other, theirs, other_reference, shard_pairs=100)
    (foreign,) = _shards(other.dir)
    shutil.copy(foreign, store.dir / foreign.name)

    reopened = _store(tmp_path, model_dir)
    assert [c.file for c in reopened.corrupt] == [foreign.name]
    assert "foreign" in reopened.corrupt[0].reason and other.namespace.id in reopened.corrupt[0].reason
    assert not any(p.key in reopened for p in theirs)  # the other model's values are not used
    assert all(p.key in reopened for p in mine)

    # A build's open quarantines it; what the namespace holds is untouched.
    _store(tmp_path, model_dir, repair=True)
    assert not (store.dir / foreign.name).exists() and (store.dir / (foreign.name + ".corrupt")).exists()
    assert _store(tmp_path, model_dir).corrupt == []
    summary = _build(_store(tmp_path, model_dir, repair=True), theirs, reference)
    assert summary.computed == len(theirs)  # computed by this namespace's own model


def _sequence_shard(directory: Path, tensors: dict, namespace_id: str) -> Path:
    """A look-aside shard as ``SequenceStore.flush`` names it, with any content."""
    raw = save(tensors, metadata={"namespace": namespace_id})
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"seq-{hashlib.sha256(raw).hexdigest()[:16]}.safetensors"
    path.write_bytes(raw)
    return path


def test_a_sequence_shard_from_another_namespace_or_malformed_is_refused(tmp_path):
    """The service's look-aside shards get the pair shards' checks: a shard copied from another
    model's directory holds that model's values, and a malformed or non-finite one is one bad
    file, not a crash of the service or a NaN served."""
    mine, theirs = Namespace("a" * 64, "c" * 64, "float32"), Namespace("b" * 64, "c" * 64, "float32")
    key, other_key = sequence_key([1, 2], [3, 4]), sequence_key([1, 2], [3, 5])
    elsewhere = SequenceStore(tmp_path, theirs)
    elsewhere.put(key, torch.tensor([-1.0, -2.0]))
    elsewhere.flush()
    store = SequenceStore(tmp_path, mine)
    (foreign,) = elsewhere.dir.glob("seq-*.safetensors")
    store.dir.mkdir(parents=True)
    shutil.copy(foreign, store.dir / foreign.name)
    keys = torch.frombuffer(bytearray(other_key), dtype=torch.uint8).reshape(1, 16)
    _sequence_shard(store.dir, {"keys": keys, "tokens": torch.tensor([5], dtype=torch.int32),
                                "token_logps": torch.tensor([-1.0, -2.0])}, mine.id)
    _sequence_shard(store.dir, {"keys": keys, "tokens": torch.tensor([2], dtype=torch.int32),
                                "token_logps": torch.tensor([float("nan"), -2.0])}, mine.id)
    store.refresh()
    assert store.get(key) is None and store.get(other_key) is None and len(store) == 0
    reasons = sorted(store.corrupt)
    assert len(reasons) == 3 and any("foreign" in r and theirs.id in r for r in reasons)
    assert any("non-finite" in r for r in reasons) and any("value per counted token" in r for r in reasons)


def test_a_non_finite_sequence_value_is_not_cached_and_costs_no_other_value(tmp_path):
    store = SequenceStore(tmp_path, Namespace("a" * 64, "c" * 64, "float32"))
    good, bad = sequence_key([1, 2], [3, 4]), sequence_key([1, 2], [3, 5])
    store.put(good, torch.tensor([-1.0, -2.0]))
    store.put(bad, torch.tensor([-1.0, float("nan")]))
    store.flush()
    assert store.get(bad) is None
    later = SequenceStore(tmp_path, store.namespace)
    later.refresh()
    assert later.corrupt == [] and torch.equal(later.get(good), torch.tensor([-1.0, -2.0])) and later.get(bad) is None


def test_cache_info_lists_look_aside_values_by_their_own_directory(tmp_path, cli, model_dir, data, reference):
    """``cache info`` shows what the reference service, ``dpocache score`` and
    ``CachedGRPOTrainer`` store (``sequences/``) beside the pair cache: a namespace holding only
    look-aside values, and one holding both, each kind in a line of its own with its sequences,
    shards and bytes on disk; a damaged look-aside shard is named and makes the exit status 1,
    and a damaged ``namespace.json`` costs no value (the directory's name is authoritative)."""
    hot = Namespace("a" * 64, "c" * 64, "bfloat16", model="./sft", temperature=0.7)
    alone = SequenceStore(tmp_path, hot)
    for n in range(3):
        alone.put(sequence_key([1, 2], [3, n]), torch.tensor([-1.0, -2.0]))
    alone.flush()
    alone.put(sequence_key([1, 2], [4]), torch.tensor([-3.0]))
    alone.flush()
    store = _store(tmp_path, model_dir)  # pairs and look-aside values under one namespace
    _build(store, data.pairs[:8], reference)
    both = SequenceStore(tmp_path, store.namespace)
    both.put(sequence_key([5], [6]), torch.tensor([-0.5]))
    both.flush()

    rc, out, _ = cli("cache", "info", "--cache-dir", tmp_path)
    lines = {line.split()[0]: line for line in out.splitlines()}
    assert rc == 0, out
    look_aside = lines[f"{hot.id}/sequences"]
    assert "sequences 4 (look-aside)" in look_aside and "shards 2" in look_aside
    assert "model ./sft" in look_aside and "dtype bfloat16" in look_aside and "temperature 0.7" in look_aside
    size = sum(f.stat().st_size for f in alone.dir.glob("seq-*.safetensors"))
    assert f"size {size} B" in look_aside or f"size {size / 1024:.1f} KiB" in look_aside, (size, look_aside)
    assert hot.id not in lines  # no pair line for a namespace without pairs
    assert "pairs 8" in lines[store.namespace.id]
    assert "sequences 1 (look-aside)" in lines[f"{store.namespace.id}/sequences"]

    (alone.dir / "namespace.json").write_text("{not json")
    (bad,) = [f for f in alone.dir.glob("seq-*.safetensors") if f.stat().st_size == min(
        g.stat().st_size for g in alone.dir.glob("seq-*.safetensors"))]
    bad.write_bytes(bad.read_bytes()[:-8] + b"\0" * 8)
    rc, out, _ = cli("cache", "info", "--cache-dir", tmp_path)
    lines = {line.split()[0]: line for line in out.splitlines()}
    assert rc == 1 and f"CORRUPT {alone.dir / bad.name}: checksum mismatch" in out, out
    assert "sequences 3 (look-aside)" in lines[f"{hot.id}/sequences"] and "shards 1" in lines[f"{hot.id}/sequences"]
    assert "(no sound namespace.json)" in lines[f"{hot.id}/sequences"]


def test_a_replaced_namespace_directory_is_refused(tmp_path, cli, model_dir, other_model_dir, data, reference,
                                                   other_reference):
    """The other model's whole directory, manifest included, under this namespace's name."""
    store = _store(tmp_path, model_dir)
    _build(store, data.pairs[:8], reference)
    other = _store(tmp_path, other_model_dir)
    _build(other, data.pairs[:8], other_reference)
    shutil.rmtree(store.dir)
    shutil.copytree(other.dir, store.dir)

    reopened = _store(tmp_path, model_dir)
    assert len(reopened) == 0
    assert {c.file for c in reopened.corrupt} == {MANIFEST} | {p.name for p in _shards(store.dir)}
    assert all("namespace" in c.reason for c in reopened.corrupt)

    rc, out, _ = cli("cache", "info", "--cache-dir", tmp_path)
    assert rc == 1 and out.count("CORRUPT") == len(reopened.corrupt) and "foreign shard" in out

    repaired = _store(tmp_path, model_dir, repair=True)
    assert len(repaired) == 0 and _manifest_files(repaired) == set()
    assert json.loads((store.dir / MANIFEST).read_text())["namespace_id"] == store.namespace.id
    assert _build(repaired, data.pairs[:8], reference).computed == 8


# ------------------------------------------------------------------------------ file names and file types


def test_a_path_in_the_manifest_touches_nothing_outside_the_cache(tmp_path, cli, model_dir, data, reference):
    cache = tmp_path / "cache"
    store = _store(cache, model_dir)
    _build(store, data.pairs[:8], reference)
    outside, absolute = tmp_path / "x", tmp_path / "elsewhere" / "y"
    absolute.parent.mkdir()
    outside.write_text("not the cache's")
    absolute.write_text("not the cache's either")
    manifest = json.loads((store.dir / MANIFEST).read_text())
    entry = manifest["shards"][0]
    manifest["shards"] += [{**entry, "file": "../../x"}, {**entry, "file": str(absolute)}]
    (store.dir / MANIFEST).write_text(json.dumps(manifest))

    repaired = _store(cache, model_dir, repair=True)  # what `cache build` and `train` do first
    assert outside.read_text() == "not the cache's" and absolute.read_text() == "not the cache's either"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "elsewhere", "x"]
    assert sorted(p.name for p in absolute.parent.iterdir()) == ["y"]
    assert len(repaired) == 8 and _manifest_files(repaired) == {p.name for p in _shards(store.dir)}

    (store.dir / MANIFEST).write_text(json.dumps(manifest))
    rc, out, _ = cli("cache", "info", "--cache-dir", cache)
    assert rc == 1 and "../../x" in out and "never a path" in out


def test_links_and_fifos_in_the_namespace_are_refused_without_reading_them(tmp_path, model_dir, data, reference):
    cache = tmp_path / "cache"
    store = _store(cache, model_dir)
    _build(store, data.pairs[:8], reference)
    zero_link = store.dir / "shard-00000000000000aa.safetensors"
    zero_link.symlink_to("/dev/zero")
    fifo = store.dir / "shard-00000000000000bb.safetensors"
    os.mkfifo(fifo)
    real_manifest = store.dir / MANIFEST
    real_manifest.rename(store.dir / "saved.json")
    os.mkfifo(real_manifest)

    proc = _cache_info(cache)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert any(zero_link.name in line and "symbolic link" in line for line in lines), proc.stdout
    assert any(fifo.name in line and "FIFO" in line for line in lines), proc.stdout
    assert any(MANIFEST in line and "FIFO" in line for line in lines), proc.stdout
    assert "pairs 8 " in proc.stdout  # the real shards still load

    repaired = _store(cache, model_dir, repair=True)
    assert len(repaired) == 8 and stat.S_ISREG(os.lstat(real_manifest).st_mode)
    assert os.path.islink(zero_link.with_name(zero_link.name + ".corrupt"))  # the link renamed, not its target
    assert _store(cache, model_dir).corrupt == []


def test_a_shard_header_size_is_bounded_before_parsing(tmp_path, model_dir, data, reference):
    store = _store(tmp_path, model_dir)
    _build(store, data.pairs[:4], reference)
    raw = (2**40).to_bytes(8, "little") + b"{}"  # claims a 1 TiB header
    bad = store.dir / f"shard-{hashlib.sha256(raw).hexdigest()[:16]}.safetensors"
    bad.write_bytes(raw)
    reopened = _store(tmp_path, model_dir)
    assert [c.file for c in reopened.corrupt] == [bad.name] and "header of" in reopened.corrupt[0].reason
    assert len(reopened) == 4


# ------------------------------------------------------------------------------ malformed manifests


def _malformed(manifest: dict, case: str) -> bytes:
    if case == "list":
        return b"[]"
    if case == "shards-object":
        return json.dumps({**manifest, "shards": {"a": 1}}).encode()
    if case == "entry-without-file":
        return json.dumps({**manifest, "shards": [{k: v for k, v in s.items() if k != "file"}
                                                  for s in manifest["shards"]]}).encode()
    if case == "not-utf8":
        return json.dumps(manifest).encode().replace(b'"model"', b'"mod\xffel"')
    if case == "unknown-field":
        return json.dumps({**manifest, "namespace": {**manifest["namespace"], "added_later": 1}}).encode()
    raise AssertionError(case)


@pytest.mark.parametrize("case", ["list", "shards-object", "entry-without-file", "not-utf8", "unknown-field"])
def test_a_malformed_manifest_is_rebuilt_from_the_shards(tmp_path, cli, model_dir, pref_jsonl, data, reference, case):
    cache = tmp_path / "cache"
    store = _store(cache, model_dir)
    _build(store, data.pairs, reference, shard_pairs=16, max_tokens=4096)
    manifest = json.loads((store.dir / MANIFEST).read_text())
    (store.dir / MANIFEST).write_bytes(_malformed(manifest, case))

    listed = open_namespace_dir(store.dir)  # `cache info`
    assert len(listed) == len(data.pairs) and [c.file for c in listed.corrupt] == [MANIFEST]
    rc, out, err = cli("cache", "info", "--cache-dir", cache)
    assert rc == 1 and "CORRUPT" in out and "manifest.json" in out and "Traceback" not in out + err

    rc, out, err = cli("cache", "build", "--model", model_dir, "--data", pref_jsonl, "--cache-dir", cache,
                       "--dtype", "float32", "--device", "cpu", "--json")
    assert rc == 0, err
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["computed"] == 0 and summary["reused"] == len(data.pairs)
    entries, namespace, problem = parse_manifest((store.dir / MANIFEST).read_bytes(), store.dir.name)
    assert problem is None and namespace == store.namespace and set(entries) == {p.name for p in _shards(store.dir)}
    assert _store(cache, model_dir).corrupt == []


def test_train_runs_on_a_cache_whose_manifest_is_malformed(tmp_path, cli, model_dir, pref_jsonl):
    cache = tmp_path / "cache"

    def train(out):
        return cli("train", *flags(model_dir, pref_jsonl, tmp_path / out, cache, "--max-steps", "1"))

    rc, _, err = train("first")
    assert rc == 0, err
    (manifest,) = cache.glob("*/manifest.json")
    manifest.write_text("[]")
    rc, _, err = train("second")
    assert rc == 0 and "Traceback" not in err and "manifest.json" in err, err
    assert run_json(tmp_path / "second")["reference"]["computed"] == 0


# ------------------------------------------------------------------------------ NaN and inf


def _nan_model(src: Path, dst: Path, token_id: int) -> Path:
    """A copy of ``src`` whose embedding row of ``token_id`` is NaN: every pair holding that
    token gets NaN log-probs, every other pair finite ones."""
    shutil.copytree(src, dst)
    weights = load_file(dst / "model.safetensors")
    name = next(k for k in weights if k.endswith("embed_tokens.weight"))
    weights[name][token_id] = float("nan")
    save_file(weights, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def _some_pairs_token(pairs) -> int:
    """A token id that some pairs hold and others do not."""
    counts: dict[int, int] = {}
    for p in pairs:
        for t in set(p.prompt_ids) | set(p.chosen_ids) | set(p.rejected_ids):
            counts[t] = counts.get(t, 0) + 1
    return min((c, t) for t, c in counts.items() if len(pairs) // 4 <= c <= len(pairs) // 2)[1]


_READ_PROBE_MEMO = """
import sys
from dpocache.cache.probes import ProbeMemo
print(ProbeMemo(sys.argv[1]).get("any key"))
"""


def test_a_fifo_or_link_under_the_probe_memo_name_is_not_read(tmp_path):
    """``probes.json`` is read as the other cache files are: a FIFO (a read would block
    forever), or a link to one, costs a probe, not a hang; a link to a regular file is read as
    that file (a ``cp -rs`` copy of a cache)."""
    os.mkfifo(tmp_path / "elsewhere.fifo")
    (tmp_path / "elsewhere.json").write_text(json.dumps({"any key": True}))
    for kind, read in (("fifo", "None"), ("link to a fifo", "None"), ("link to a file", "True")):
        cache = tmp_path / kind.replace(" ", "-")
        cache.mkdir()
        if kind == "fifo":
            os.mkfifo(cache / "probes.json")
        else:
            (cache / "probes.json").symlink_to(tmp_path / ("elsewhere.fifo" if kind.endswith("fifo") else
                                                           "elsewhere.json"))
        done = subprocess.run([sys.executable, "-c", _READ_PROBE_MEMO, str(cache)], capture_output=True, text=True,
                              timeout=HOSTILE_DEADLINE_S)
        assert done.returncode == 0 and done.stdout.strip() == read, (kind, done.stderr)


def test_a_build_stores_no_non_finite_value_and_names_the_pairs(tmp_path, model_dir, data):
    pairs = data.pairs
    token = _some_pairs_token(pairs)
    poisoned = {p.key for p in pairs if token in set(p.prompt_ids) | set(p.chosen_ids) | set(p.rejected_ids)}
    nan_dir = _nan_model(model_dir, tmp_path / "nan-model", token)
    nan_reference = ReferenceModel.from_pretrained(nan_dir, "float32", device="cpu")
    store = _store(tmp_path / "cache", nan_dir)
    with pytest.raises(CacheError) as err:
        _build(store, pairs, nan_reference, per_token=True)
    message = str(err.value)
    assert "NaN or inf" in message and f"for {len(poisoned)} of {len(pairs)} pairs" in message and "\n" not in message
    first = next(p for p in pairs if p.key in poisoned)
    assert f"row {first.index} (key {first.key.hex()[:12]})" in message

    reopened = _store(tmp_path / "cache", nan_dir)
    assert reopened.corrupt == []
    assert {p.key for p in pairs if p.key in reopened} == {p.key for p in pairs} - poisoned
    for shard in _shards(reopened.dir):
        assert all(torch.isfinite(t).all() for t in load_file(shard).values() if t.is_floating_point())


def test_verify_fails_on_a_stored_nan(tmp_path, cli, model_dir, pref_jsonl, data, reference):
    cache = tmp_path / "cache"
    store = _store(cache, model_dir)
    _build(store, data.pairs, reference, shard_pairs=100, max_tokens=4096)
    (shard,) = _shards(store.dir)
    tensors = load_file(shard)
    tensors["chosen_logps"][:] = float("nan")
    shard.unlink()
    nan_shard = _write_shard(store.dir, tensors, store.namespace.id)
    (store.dir / MANIFEST).unlink()

    rc, out, _ = cli("cache", "verify", "--model", model_dir, "--data", pref_jsonl, "--cache-dir", cache,
                     "--dtype", "float32", "--device", "cpu", "--samples", 8)
    assert rc == 1 and "FAILED" in out and nan_shard.name in out and "non-finite" in out


def test_verify_fails_when_the_recomputation_is_nan(tmp_path, model_dir, data, reference):
    """A stored value checked against a model that now gives NaN: NaN - x is no "diff 0"."""
    store = _store(tmp_path / "cache", model_dir)
    _build(store, data.pairs, reference, max_tokens=4096)
    nan_dir = _nan_model(model_dir, tmp_path / "nan-model", _some_pairs_token(data.pairs))
    nan_reference = ReferenceModel.from_pretrained(nan_dir, "float32", device="cpu")
    report = verify(store, data.pairs, nan_reference, samples=len(data.pairs))
    assert not report.ok and report.max_abs_diff == float("inf")
    assert report.mismatches and all("not finite" in m for m in report.mismatches)
    assert verify(store, data.pairs, reference, samples=len(data.pairs)).ok


# ------------------------------------------------------------------------------ shared caches


def test_files_follow_the_umask_and_another_user_can_read_the_cache(model_dir, data, reference):
    # Not tmp_path: pytest makes its temp root 0700, which no other user may enter.
    root = Path(tempfile.mkdtemp(prefix="dpocache-shared-"))
    old_umask = os.umask(0o022)
    try:
        root.chmod(0o755)
        cache = root / "cache"
        store = _store(cache, model_dir)
        _build(store, data.pairs[:8], reference)
        files = [p for p in cache.rglob("*") if p.is_file()]
        assert len(files) >= 3  # shards, manifest, fingerprint memo
        for path in files:
            assert stat.S_IMODE(path.stat().st_mode) == 0o644, path
        for path in [cache, *(p for p in cache.rglob("*") if p.is_dir())]:
            assert stat.S_IMODE(path.stat().st_mode) == 0o755, path
        if os.geteuid() != 0:
            pytest.skip("reading as another user needs root")
        assert _open_as_user(65534, store.dir) == {"pairs": 8, "corrupt": []}
    finally:
        os.umask(old_umask)
        shutil.rmtree(root, ignore_errors=True)


# ------------------------------------------------------------------------------ concurrent builds


def test_a_build_that_opened_before_another_wrote_keeps_its_shards_in_the_manifest(tmp_path, model_dir, data,
                                                                                   reference):
    """Two builds interleaved deterministically: both open the empty namespace, then each writes."""
    first, second = _store(tmp_path, model_dir), _store(tmp_path, model_dir)
    _build(first, data.pairs[:12], reference)
    _build(second, data.pairs[12:24], reference)
    on_disk = {p.name for p in _shards(first.dir)}
    assert _manifest_files(second) == on_disk
    assert len(_store(tmp_path, model_dir)) == 24


def test_a_second_build_skips_what_a_concurrent_one_has_written(tmp_path, model_dir, data, reference):
    late = _store(tmp_path, model_dir)  # opened before the other build wrote anything
    assert _build(_store(tmp_path, model_dir), data.pairs[:12], reference).computed == 12
    summary = _build(late, data.pairs[:12], reference, shard_pairs=1)
    # Before its first chunk it reads the other build's shards (concurrent_builds): it finds every pair there.
    assert summary.computed == 0 and summary.reused == 12
    assert _manifest_files(late) == {p.name for p in _shards(late.dir)}


def test_pairs_a_concurrent_build_wrote_count_as_reused_in_the_build_summary(tmp_path, model_dir, data, reference):
    """``build_distributed`` (what ``cache build`` and ``train`` run) counts them too: its
    summary's computed + reused is every pair, as ``build_missing``'s is."""
    pairs = data.pairs[:12]

    def load_after_another_build():  # the other build finishes while this one loads its model
        _build(_store(tmp_path, model_dir), pairs, reference)
        return reference

    summary = build_distributed(CacheStore(tmp_path, namespace_for_dir(model_dir, torch.float32, tmp_path)), pairs,
                                load_after_another_build, DistEnv(), max_tokens=64, shard_pairs=1,
                                show_progress=False)
    assert summary.computed == 0 and summary.reused == 12


_RENDEZVOUS_BUILD = """
import sys, time
from pathlib import Path
import torch
from dpocache.cache import CacheStore, build_missing, namespace_for_dir
from dpocache.models.loading import load_tokenizer
from dpocache.data.pairs import load_preference_data
from dpocache.models.reference import ReferenceModel
model, data, cache, lo, hi, me, other = sys.argv[1:]
pairs = load_preference_data(data, load_tokenizer(model), show_progress=False).pairs[int(lo):int(hi)]
store = CacheStore(cache, namespace_for_dir(model, torch.float32, Path(cache))).open(repair=True)
# Both processes have opened the empty namespace before either writes: the overlap that lost
# manifest entries, made certain rather than left to the scheduler.
Path(me).touch()
deadline = time.monotonic() + 300
while not Path(other).exists():
    assert time.monotonic() < deadline, "the other build never started"
    time.sleep(0.01)
build_missing(store, pairs, lambda: ReferenceModel.from_pretrained(model, "float32", device="cpu"),
              shard_pairs=2, max_tokens=64, show_progress=False)
"""


def test_two_concurrent_build_processes_leave_a_complete_manifest(tmp_path, model_dir, pref_jsonl, data):
    cache = tmp_path / "cache"
    ready = [tmp_path / "a.ready", tmp_path / "b.ready"]
    ranges = [(0, 20), (12, 32)]
    procs = [subprocess.Popen([sys.executable, "-c", _RENDEZVOUS_BUILD, str(model_dir), str(pref_jsonl), str(cache),
                               str(lo), str(hi), str(ready[i]), str(ready[1 - i])], stderr=subprocess.PIPE, text=True)
             for i, (lo, hi) in enumerate(ranges)]
    errors = [p.communicate(timeout=HOSTILE_DEADLINE_S)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], errors
    store = _store(cache, model_dir)
    assert _manifest_files(store) == {p.name for p in _shards(store.dir)}
    assert store.corrupt == [] and all(p.key in store for p in data.pairs[:32])


# ------------------------------------------------------------------------------ fingerprints


def test_an_in_place_weight_edit_with_its_mtime_restored_is_rehashed(tmp_path, model_dir):
    copy = tmp_path / "model"
    shutil.copytree(model_dir, copy)
    weights = copy / "model.safetensors"
    memo_file = tmp_path / "fingerprints.json"
    before = model_dir_fingerprint(copy, FingerprintMemo(memo_file))
    namespace = namespace_for_dir(copy, torch.float32, tmp_path)
    recorded = os.stat(weights)

    with open(weights, "r+b") as f:  # same inode, same size: one weight's last byte changes
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0x01]))
    # `touch -r`: the mtime put back. File systems stamp the ctime from a coarse clock, so the
    # restore is repeated until the ctime has moved (it always does; only how soon varies).
    for _ in range(10**6):
        os.utime(weights, ns=(recorded.st_atime_ns, recorded.st_mtime_ns))
        if os.stat(weights).st_ctime_ns != recorded.st_ctime_ns:
            break
    now = os.stat(weights)
    assert (now.st_size, now.st_mtime_ns, now.st_ino) == (recorded.st_size, recorded.st_mtime_ns, recorded.st_ino)

    memo = FingerprintMemo(memo_file)  # a later process
    assert model_dir_fingerprint(copy, memo) != before and memo.hashed_bytes == now.st_size
    assert namespace_for_dir(copy, torch.float32, tmp_path).id != namespace.id
    hit = FingerprintMemo(memo_file)
    model_dir_fingerprint(copy, hit)
    assert hit.hashed_bytes == 0  # and the new stamp is a hit again


def test_a_tree_of_links_to_a_cache_is_read_as_the_cache(tmp_path, model_dir, data, reference):
    """``cp -rs`` (DVC and git-annex make the same): every shard a link to the real one. Each was
    refused as "a symbolic link" and renamed aside, then the linked manifest.lock stopped the
    run with a traceback (ELOOP)."""
    cache = tmp_path / "cache"
    _build(_store(cache, model_dir), data.pairs[:8], reference)
    linked = tmp_path / "linked"
    subprocess.run(["cp", "-rs", str(cache), str(linked)], check=True)
    store = _store(linked, model_dir)
    assert any(p.is_symlink() for p in store.dir.glob("shard-*"))
    proc = _cache_info(linked)
    assert proc.returncode == 0 and "CORRUPT" not in proc.stdout and "pairs 8 " in proc.stdout, proc.stdout
    summary = _build(store, data.pairs[:12], reference)
    assert (summary.computed, summary.reused, summary.corrupt_shards) == (4, 8, [])
    assert not list(store.dir.glob("*.corrupt")) and len(_store(cache, model_dir)) == 8  # the real cache untouched
