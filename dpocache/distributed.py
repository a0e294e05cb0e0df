"""torch.distributed set-up (under ``torchrun``) and the few collectives dpocache uses.

Without ``torchrun`` (no ``WORLD_SIZE`` in the environment) everything here is a no-op for a
world of one, so single-process code paths are the same code.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistEnv:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def init_distributed(device: str | None = None, backend: str | None = None) -> DistEnv:
    """Join the process group torchrun describes (gloo on CPU, nccl on CUDA, unless given)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda":
        dev = torch.device("cuda", local_rank)
        torch.cuda.set_device(dev)
    if world > 1 and not dist.is_initialized():
        backend = backend or ("nccl" if dev.type == "cuda" else "gloo")
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(minutes=30))
    return DistEnv(rank, world, local_rank, dev)


def barrier(env: DistEnv) -> None:
    if env.enabled:
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


def broadcast_object(env: DistEnv, obj):
    if not env.enabled:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def destroy(env: DistEnv) -> None:
    if env.enabled and dist.is_initialized():
        dist.destroy_process_group()
