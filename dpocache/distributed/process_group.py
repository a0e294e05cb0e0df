"""torch.distributed set-up (under ``torchrun``) and the few collectives dpocache uses.

Without ``torchrun`` (no ``WORLD_SIZE`` in the environment) everything here is a no-op for a
world of one, so single-process code paths are the same code.

Only small tensors ever cross ranks here (metric sums, counters, flags): the reference cache
is shared through the file system, and the model through DDP/FSDP's own collectives.
"""

from __future__ import annotations

import datetime
import gc
import hashlib
import heapq
import os
import weakref
from dataclasses import dataclass
from typing import Callable, Sequence, TypeVar

import torch
import torch.distributed as dist

# Imported before any process group exists: its functions take ``group=group.WORLD`` as a
# default argument, evaluated at import (``torch.distributed.fsdp`` imports it). Imported after
# ``init_distributed`` they would hold the group for the life of the process (see ``destroy``).
import torch.distributed.nn  # noqa: F401
from torch.distributed.device_mesh import init_device_mesh

from dpocache.config import ConfigError, flag_name

T = TypeVar("T")

# The meshes ``device_mesh`` made, weakly: ``destroy`` cuts those still alive from the group.
_meshes: list[weakref.ref] = []


@dataclass(frozen=True)
class DistEnv:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    owns_group: bool = False  # this process group was created by init_distributed (destroy it at the end)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def init_distributed(device: str | None = None, backend: str | None = None) -> DistEnv:
    """Join the process group torchrun describes: nccl on CUDA, gloo on CPU, unless given.

    Each rank uses ``cuda:LOCAL_RANK`` when CUDA is used. Calling it again (the cache build
    inside training) returns the same environment without re-initialising.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda":
        dev = torch.device("cuda", local_rank if dev.index is None or world > 1 else dev.index)
        torch.cuda.set_device(dev)
    owns = False
    if world > 1 and not dist.is_initialized():
        if backend is not None:
            check_backend(backend, dev)
        backend = backend or ("nccl" if dev.type == "cuda" else "gloo")
        kwargs = {"device_id": dev} if backend == "nccl" else {}
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(minutes=30), **kwargs)
        owns = True
    return DistEnv(rank, world, local_rank, dev, owns)


def check_backend(backend: str, device: torch.device) -> None:
    """A backend named alone must be one torch knows, for this run's device type: torch answers
    a typo with an assertion and ``nccl`` on the CPU with a ValueError, a traceback on every rank.
    (A per-device list, ``cpu:gloo,cuda:nccl``, goes to torch as it is.)"""
    capability = dist.Backend.backend_capability  # {name: device types}, with any registered backend
    if ":" in backend or "," in backend:
        return
    flag, devices = flag_name("distributed.backend"), capability.get(backend.lower())
    if devices is None:
        raise ConfigError(f"{flag} {backend}: not a torch.distributed backend (one of {', '.join(capability)})")
    if device.type not in devices:
        raise ConfigError(f"{flag} {backend}: runs on {' or '.join(devices)} devices, and this run uses "
                          f"{device.type} (--device); use gloo on the CPU")


def barrier(env: DistEnv) -> None:
    if env.enabled:
        if env.device.type == "cuda":
            dist.barrier(device_ids=[env.device.index])
        else:
            dist.barrier()


def all_reduce_sum(env: DistEnv, tensor: torch.Tensor) -> torch.Tensor:
    """Sum across ranks (in place, returned). Small metric vectors only: never data-sized."""
    if env.enabled:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def all_reduce_max(env: DistEnv, tensor: torch.Tensor) -> torch.Tensor:
    if env.enabled:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor


def reduce_counts(env: DistEnv, counts: Sequence[float], op: str = "sum") -> list[float]:
    """A few numbers summed (or maxed) over ranks, as a Python list, on every rank."""
    t = torch.tensor(list(counts), dtype=torch.float64, device=env.device)
    t = all_reduce_sum(env, t) if op == "sum" else all_reduce_max(env, t)
    return t.cpu().tolist()


def differing_on_ranks(env: DistEnv, values: dict[str, object]) -> list[str]:
    """The names of ``values`` (a setting, a digest: anything whose ``repr`` is stable across
    processes) that are not equal on every rank, in one reduction; [] in one process. Each
    value crosses ranks as 62 bits of a hash of its ``repr``."""
    if not env.enabled:
        return []
    digests = [int.from_bytes(hashlib.blake2b(repr(v).encode(), digest_size=8).digest(), "little") >> 2
               for v in values.values()]
    t = torch.tensor(digests + [-d for d in digests], dtype=torch.int64, device=env.device)
    highest = all_reduce_max(env, t).tolist()  # max(d) and -min(d) of each value: equal when every rank agrees
    k = len(digests)
    return [name for name, top, bottom in zip(values, highest[:k], highest[k:]) if top != -bottom]


def broadcast_object(env: DistEnv, obj):
    """Rank 0's ``obj`` on every rank (small objects: a path, an error message)."""
    if not env.enabled:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, device=env.device if env.device.type == "cuda" else None)
    return box[0]


def destroy(env: DistEnv) -> None:
    """Leave the process group, if ``init_distributed`` created it (a caller's own group is
    left alone), and end it: its threads are joined here, not at interpreter exit.

    ``destroy_process_group`` only forgets the group; the group ends (gloo joins its worker
    threads) when its last reference goes. A group that outlives it ends at interpreter exit,
    or never: a gloo worker that then drops a finished collective's tensors needs the GIL, which
    a finalizing interpreter answers by ending the thread, and that unwinds through C++ code
    that may not throw: "terminate called without an active exception", SIGABRT, after all the
    work is done. So no reference may outlive it (``release_group_references``)."""
    if env.enabled and env.owns_group and dist.is_initialized():
        release_group_references()
        dist.destroy_process_group()


def device_mesh(env: DistEnv):
    """A 1-D ``DeviceMesh`` over every rank (FSDP2's), remembered so that ``destroy`` can cut
    it from the process group."""
    mesh = init_device_mesh(env.device.type, (env.world_size,))
    _meshes.append(weakref.ref(mesh))
    return mesh


def release_group_references() -> None:
    """Cut every mesh of ``device_mesh`` still alive from its process groups. A ``DeviceMesh``
    holds them (``_pg_registry``; its submeshes share their root's), and outlives the models
    sharded over it in DTensor's caches (sharding propagation, redistribution plans, mesh
    topology), which torch keeps for the life of the process."""
    gc.collect()  # a model or mesh in a reference cycle (a flattened submesh and its root) goes now
    for ref in _meshes:
        mesh = ref()
        if mesh is not None:
            # torch 2.13's attribute (tests/test_distributed.py checks the threads end); where a
            # torch release lacks it, nothing is cut (and destroy ends the group as before).
            registry = getattr(mesh, "_pg_registry", None)
            if registry is not None:
                registry.clear()
    _meshes.clear()


def split_by_weight(items: Sequence[T], world_size: int, weight: Callable[[T], float],
                    tiebreak: Callable[[T], object] = lambda item: 0) -> list[list[T]]:
    """Split ``items`` into ``world_size`` parts of near-equal total weight.

    Greedy longest-processing-time: heaviest item first, each to the part with the smallest
    load so far (ties to the lower rank). Its makespan is within 4/3 of optimal (Graham 1969).
    Deterministic given the items, so every rank computes the same split without talking to
    the others; ``tiebreak`` orders equal weights (give a unique key, e.g. the example key,
    so the result does not depend on the input order either).
    """
    parts: list[list[T]] = [[] for _ in range(world_size)]
    heap = [(0.0, r) for r in range(world_size)]  # (load, rank)
    for item in sorted(items, key=lambda x: (-weight(x), tiebreak(x))):
        load, r = heapq.heappop(heap)
        parts[r].append(item)
        heapq.heappush(heap, (load + weight(item), r))
    return parts
