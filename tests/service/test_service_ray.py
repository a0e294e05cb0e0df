"""Tests for dpocache.service.pool.ReferencePool on a local Ray with two CPU replicas (skipped where
Ray is not installed): the pool returns exactly what one in-process service does, in request
order, and still every result exactly once when a replica dies in the middle of a call."""

from __future__ import annotations

import pytest
import torch
from test_service import make_requests

from dpocache.service.reference_service import ReferenceService

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def _same(a, b) -> bool:
    return len(a) == len(b) and all(len(x) == len(y) and all(torch.allclose(u, v, atol=1e-6, rtol=0)
                                                             for u, v in zip(x, y)) for x, y in zip(a, b))


def test_pool_equals_one_service(local_ray, model_dir):
    from dpocache.service.pool import ReferencePool

    requests = make_requests(9, 4, seed=21)
    expected = ReferenceService.from_pretrained(model_dir, dtype="float32", device="cpu").score(requests)
    with ReferencePool(model_dir, num_replicas=2, dtype="float32", device="cpu") as pool:  # shut down on leaving
        assert _same(pool.score(requests), expected)
        stats = pool.stats()
        assert len(stats["replicas"]) == 2 and all(s["requests"] > 0 for s in stats["replicas"])  # both worked
        assert stats["requests"] == 9 and stats["forward_sequences"] == 36
        with pytest.raises(ValueError, match=r"^request 4, completion 1: empty completion$"):
            bad = make_requests(6, 2, seed=1)
            bad[4]["completion_ids"][1] = []
            pool.score(bad)
    pool.close()  # as shutdown, and a second time does nothing
    for call in (lambda: pool.score(requests), pool.stats):  # not an IndexError, not all-zero counters
        with pytest.raises(RuntimeError, match="was shut down"):
            call()


def test_replica_killed_mid_call_answers_everything_once(local_ray, model_dir, tmp_path):
    """The replica that takes the first share exits (os._exit) after receiving it; Ray restarts
    it and re-runs the share. The marker file is removed by the replica that dies, so it is
    gone afterwards only if a replica really died mid-call."""
    from dpocache.service.pool import ReferencePool

    requests = make_requests(8, 3, seed=22)
    expected = ReferenceService.from_pretrained(model_dir, dtype="float32", device="cpu").score(requests)
    marker = tmp_path / "exit-once"
    pool = ReferencePool(model_dir, num_replicas=2, dtype="float32", device="cpu", _exit_once=str(marker))
    try:
        marker.write_text("")
        got = pool.score(requests)
        assert not marker.exists()
        assert _same(got, expected)
        # Every request answered once: the replicas' counters (one restarted from zero) add up
        # to at most the requests asked, and the answers are complete and in order.
        assert pool.stats()["requests"] <= len(requests)
        # A replica dead for good (Ray's restarts spent): the one alive answers everything, and
        # the counters name the dead one (they raised Ray's ActorDiedError).
        ray.kill(pool.replicas[1], no_restart=True)
        assert _same(pool.score(requests), expected)
        stats = pool.stats()
        assert pool.died.keys() == {1} and "died" in stats["replicas"][1] and stats["requests"] > 0
        # none alive: one line, not Ray's multi-line error
        ray.kill(pool.replicas[0], no_restart=True)
        for call in (lambda: pool.score(requests), pool.stats):
            with pytest.raises(RuntimeError, match=r"^every replica of this ReferencePool died and Ray's restarts "
                                                   r"\(max_restarts=3\) are spent \(.+\); start a new one$"):
                call()
    finally:
        pool.shutdown()


def test_more_cpu_replicas_than_the_cluster_has_cpus_is_one_line(local_ray, model_dir):
    """Each CPU replica takes one CPU: a pool of 3 on the 2-CPU cluster left its third actor
    unscheduled and its constructor waiting for it for ever, saying nothing. (Run in a thread,
    so that a hang fails the test instead of the run.)"""
    import threading

    from dpocache.service.pool import ReferencePool

    outcome = []

    def start():
        try:
            ReferencePool(model_dir, num_replicas=3, dtype="float32", device="cpu")
        except ValueError as e:
            outcome.append(str(e))

    thread = threading.Thread(target=start, daemon=True)
    thread.start()
    thread.join(60)
    assert outcome == ["num_replicas=3: each replica takes one CPU and the Ray cluster has 2; ask for at most 2, "
                       "or give Ray more (ray.init(num_cpus=...))"]


def test_replicas_past_the_free_cpus_are_one_line_while_another_pool_holds_them(local_ray, model_dir, monkeypatch):
    """A pool of 1 holds one of the 2 CPUs: a pool of 2 beside it would have waited for ever
    for its second replica, saying nothing (the check counted the cluster's CPUs, not its free
    ones). Once the first is shut down, its CPU is free again for the second."""
    import threading

    from dpocache.service import pool as pool_mod

    monkeypatch.setattr(pool_mod, "FREED_WITHIN_S", 1.0)
    holder = pool_mod.ReferencePool(model_dir, num_replicas=1, dtype="float32", device="cpu")
    outcome = []

    def start():
        try:
            outcome.append(pool_mod.ReferencePool(model_dir, num_replicas=2, dtype="float32", device="cpu"))
        except ValueError as e:
            outcome.append(str(e))

    try:
        thread = threading.Thread(target=start, daemon=True)
        thread.start()
        thread.join(60)
        assert outcome == ["num_replicas=2: each replica takes one CPU and the Ray cluster has 1 of its 2 free (other "
                           "actors hold the rest); ask for at most 1, or give Ray more (ray.init(num_cpus=...))"]
    finally:
        holder.shutdown()
    second = pool_mod.ReferencePool(model_dir, num_replicas=2, dtype="float32", device="cpu")  # freed within 1 s
    second.shutdown()


def test_options_are_one_line_before_ray_or_a_replica_starts(model_dir, tmp_path, monkeypatch):
    """Each was an ActorDiedError of 15-22 lines from the replica, 10-18 s later."""
    from dpocache.service import pool as pool_mod

    monkeypatch.setattr(pool_mod, "_import_ray", lambda: pytest.fail("Ray was reached"))
    afile = tmp_path / "afile"
    afile.write_text("")
    for kwargs, line in ((dict(dtype="fp32"), "dtype must be one of auto"), (dict(temperature=0), "temperature must"),
                         (dict(layout="grouped"), "layout must be one of"),
                         (dict(cache_dir=afile / "sub"), "cache_dir "), (dict(num_replicas=0), "num_replicas must"),
                         (dict(reference="policy"), "reference must be one of initial, base")):
        with pytest.raises(ValueError, match=f"^{line}"):
            pool_mod.ReferencePool(model_dir, **kwargs)
