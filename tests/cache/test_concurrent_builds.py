"""Builds running at once on one cache namespace split the work (``dpocache.cache.concurrent_builds``):
each claims a chunk before scoring it, starts at its own slot's place, and skips what the others
have written."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from dpocache.cache import CacheStore, concurrent_builds, namespace_for_dir
from dpocache.cache.concurrent_builds import shared_build, start_fraction, start_index, starting_at
from dpocache.runtime.signals import StopRequest


class _Pair:
    def __init__(self, i: int):
        self.key = i.to_bytes(16, "big")


def _batches(n: int) -> list[list[_Pair]]:
    return [[_Pair(i)] for i in range(n)]


def test_each_new_slot_starts_in_the_middle_of_the_longest_stretch_not_started():
    assert [start_fraction(s) for s in range(8)] == [0, 1 / 2, 1 / 4, 3 / 4, 1 / 8, 5 / 8, 3 / 8, 7 / 8]
    assert starting_at(list(range(8)), 0) == list(range(8))
    assert starting_at(list(range(8)), 1) == [4, 5, 6, 7, 0, 1, 2, 3]
    assert starting_at(list(range(8)), 3) == [6, 7, 0, 1, 2, 3, 4, 5]
    assert starting_at([7], 1) == [7] and starting_at([], 5) == [] and start_index(0, 3) == 0


def test_a_slot_is_held_until_its_build_ends_and_then_free(tmp_path):
    with shared_build(tmp_path) as first:
        assert not first.others_running()
        with shared_build(tmp_path) as second, shared_build(tmp_path) as third:
            assert (first.slot, second.slot, third.slot) == (0, 1, 2)
            assert first.others_running() and third.others_running()
        with shared_build(tmp_path) as again:
            assert again.slot == 1  # the second's, free again
    with shared_build(tmp_path) as alone:
        assert alone.slot == 0 and not alone.others_running()


def test_a_directory_that_cannot_hold_the_claims_builds_as_if_alone(tmp_path):
    (tmp_path / "ns").write_text("a file where the namespace directory would be")
    with shared_build(tmp_path / "ns") as shared, shared_build(tmp_path, enabled=False) as rank:
        for build in (shared, rank):
            assert build.slot == 0 and not build.others_running()
            assert [len(c) for c in build.chunks(_batches(5))] == [5]  # one chunk, nothing claimed


def test_a_chunk_another_build_holds_comes_last_and_once_it_is_let_go(tmp_path, monkeypatch):
    """Eight batches in four chunks: the first build's claim on its first chunk sends the second
    (starting at the middle) round the other three first; the held chunk comes once released."""
    monkeypatch.setattr(concurrent_builds, "CHUNKS", 4)
    monkeypatch.setattr(concurrent_builds, "WAIT_POLL_S", 0.01)
    batches = _batches(8)
    firsts = lambda chunk: [batch[0].key[-1] for batch in chunk]  # noqa: E731
    with shared_build(tmp_path) as first, shared_build(tmp_path, StopRequest()) as second:
        mine = first.chunks(batches)
        assert firsts(next(mine)) == [0, 1]  # claimed while the first build scores it
        theirs = second.chunks(batches)
        assert [firsts(next(theirs)) for _ in range(3)] == [[4, 5], [6, 7], [2, 3]]
        mine.close()  # the first build is done with it: the claim goes
        assert firsts(next(theirs)) == [0, 1]
        assert next(theirs, None) is None


def test_a_stop_signal_ends_the_wait_for_a_held_chunk(tmp_path, monkeypatch):
    monkeypatch.setattr(concurrent_builds, "CHUNKS", 2)
    monkeypatch.setattr(concurrent_builds, "WAIT_POLL_S", 0.01)
    stop = StopRequest()
    with shared_build(tmp_path) as first, shared_build(tmp_path, stop) as second:
        mine = first.chunks(_batches(2))
        next(mine)
        theirs = second.chunks(_batches(2))
        assert len(next(theirs)) == 1  # the one chunk not held
        stop.signum = 15
        assert next(theirs, None) is None  # not a wait for ever
        mine.close()


def test_claims_this_process_cannot_open_are_gone_without(tmp_path, monkeypatch):
    """A .builds directory another user made (not writable here): each chunk comes at once,
    where waiting for a lock it can never take would stop the build for good."""
    monkeypatch.setattr(concurrent_builds, "CHUNKS", 4)
    monkeypatch.setattr(concurrent_builds, "WAIT_POLL_S", 0.01)
    real_open = os.open

    def refused(path, *args):
        if "claim-" in str(path):
            raise PermissionError(13, "Permission denied")
        return real_open(path, *args)

    monkeypatch.setattr(concurrent_builds.os, "open", refused)
    stop = StopRequest()
    timer = threading.Timer(5.0, lambda: setattr(stop, "signum", 15))  # ends a wait that would never end
    timer.start()
    try:
        with shared_build(tmp_path, stop) as shared:
            assert len(list(shared.chunks(_batches(8)))) == 4
    finally:
        timer.cancel()
    assert not stop


def test_the_claims_go_with_the_last_build(tmp_path):
    with shared_build(tmp_path) as first:
        with shared_build(tmp_path) as second:
            list(second.chunks(_batches(3)))
        assert list((tmp_path / ".builds").glob("claim-*")), "kept while another build runs"
        list(first.chunks(_batches(3)))
    assert not list((tmp_path / ".builds").glob("claim-*"))


class _Writer:
    flushes = 0

    def flush(self):
        self.flushes += 1


class _Store:
    def refresh(self):
        pass


def test_builds_on_a_cpu_share_its_threads_and_take_them_back(tmp_path):
    """Each build runs on its share of the threads it started with while others run (two builds
    each on every core's threads wait on each other), and on all of them again once alone."""
    before = torch.get_num_threads()
    writer, store = _Writer(), _Store()
    try:
        torch.set_num_threads(4)
        with shared_build(tmp_path, on_cpu=True) as first:
            first.exchange(writer, store)
            assert torch.get_num_threads() == 4 and writer.flushes == 0
            with shared_build(tmp_path, on_cpu=True), shared_build(tmp_path, on_cpu=True):
                first.exchange(writer, store)
                assert torch.get_num_threads() == 1 and writer.flushes == 1  # 4 // 3
            with shared_build(tmp_path, on_cpu=True) as second:
                second.exchange(writer, store)
                assert torch.get_num_threads() == 2
            first.exchange(writer, store)
            assert torch.get_num_threads() == 4  # alone again
            with shared_build(tmp_path, on_cpu=True):
                first.exchange(writer, store)
                assert torch.get_num_threads() == 2
        assert torch.get_num_threads() == 4, "the threads it started with, after the build"
        with shared_build(tmp_path) as on_gpu, shared_build(tmp_path):
            on_gpu.exchange(writer, store)
            assert torch.get_num_threads() == 4, "a build on a GPU leaves the CPU's threads alone"
    finally:
        torch.set_num_threads(before)


_BUILD_TOGETHER = """
import sys, time
from pathlib import Path
import torch
from dpocache.cache import CacheStore, build, build_missing, namespace_for_dir
from dpocache.models.loading import load_tokenizer
from dpocache.data.pairs import load_preference_data
from dpocache.models.reference import ReferenceModel
model, data, cache, me, other, rank = sys.argv[1:]
rank = rank == "rank"
pairs = load_preference_data(data, load_tokenizer(model), show_progress=False).pairs
reference = ReferenceModel.from_pretrained(model, "float32", device="cpu")
store = CacheStore(cache, namespace_for_dir(model, torch.float32, Path(cache))).open(repair=True)
real_score = build.score_batch
def slow_score(*args):  # each batch slower than a flush and a refresh: the two runs overlap throughout
    time.sleep(0.1)
    return real_score(*args)
build.score_batch = slow_score
Path(me).touch()  # both have loaded everything before either scores
deadline = time.monotonic() + 300
while not Path(other).exists():
    assert time.monotonic() < deadline, "the other build never started"
    time.sleep(0.01)
if rank:  # one rank of a distributed build of two whose share is every pair (no process group needed)
    from dpocache.cache.build import BuildOptions, score_missing
    from dpocache.runtime.signals import stop_signals
    with stop_signals() as stop:
        summary = score_missing(store, pairs, lambda: reference, stop,
                                BuildOptions(shard_pairs=2, max_tokens=64, show_progress=True),
                                update_manifest=False, siblings=1)
else:
    summary = build_missing(store, pairs, lambda: reference, shard_pairs=2, max_tokens=64, show_progress=True)
print("computed", summary.computed, "reused", summary.reused)
"""


@pytest.mark.slow
@pytest.mark.parametrize("second", ["one process", "rank"])
def test_two_builds_started_together_split_the_pairs(tmp_path, model_dir, pref_jsonl, data, second):
    """Two processes building the same 48 pairs into one cache at the same moment: the second
    says so, and together they compute each pair about once, where before each computed all 48.
    A rank of a torchrun build beside a build of one process likewise: the rank took no part in
    the claims (a torchrun build and one beside it computed 3,000 + 1,727 of 3,000 pairs)."""
    cache = tmp_path / "cache"
    ready = [tmp_path / "a.ready", tmp_path / "b.ready"]
    kinds = ["one process", second]
    procs = [subprocess.Popen([sys.executable, "-c", _BUILD_TOGETHER, str(model_dir), str(pref_jsonl), str(cache),
                               str(ready[i]), str(ready[1 - i]), "rank" if kinds[i] == "rank" else "-"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    outputs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outputs]
    counts = [tuple(map(int, re.fullmatch(r"computed (\d+) reused (\d+)", out.strip()).groups()))
              for out, _ in outputs]
    unique = len({p.key for p in data.pairs})
    assert all(computed + reused == unique for computed, reused in counts)
    computed = [c for c, _ in counts]
    # each pair once (a batch twice at most, where a build that started alone had not flushed yet
    # what the other reaches next), where each computed all 48 before
    assert min(computed) > 0 and sum(computed) <= unique + 3, counts
    said = "cache: another build of this cache is running: they split the pairs (each claims a chunk"
    # a rank counts one build beside it as its sibling rank: said by the build of one process alone
    assert sum(said in err for _, err in outputs) == 1 or (second == "rank" and said not in outputs[1][1])
    store = CacheStore(cache, namespace_for_dir(model_dir, torch.float32, Path(cache))).open()
    assert all(p.key in store for p in data.pairs)
