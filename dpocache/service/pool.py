"""``ReferencePool``: the reference service on several Ray actors (replicas in other processes or
on other GPUs), ``score`` spread over them by token count, a dead replica restarted and its work
retried (``pip install 'dpocache[ray]'``)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

import torch

from dpocache.config import with_fields
from dpocache.distributed.process_group import split_by_weight
from dpocache.models.hub_ids import resolve_model_path
from dpocache.runtime.preflight import check_model_dir
from dpocache.service.reference_service import (
    ReferenceService,
    Request,
    ServiceOptions,
    check_request,
    forward_output,
    forward_requests,
    scored_rows,
    summed_stats,
)


def _import_ray():
    try:
        import ray
    except ImportError:
        raise ImportError("ReferencePool needs Ray: pip install 'dpocache[ray]'") from None
    return ray


class _Replica:
    """One Ray actor: a ``ReferenceService`` of its own (one GPU where the cluster has them)."""

    def __init__(self, path: str, loading: dict, options: ServiceOptions, exit_once: str | None = None):
        self.service = ReferenceService.from_pretrained(path, **loading, options=options)
        self.exit_once = exit_once

    def ready(self) -> tuple[int, int, int | None, frozenset[int]]:
        """(process id, vocabulary size, context length, BOS and EOS ids)."""
        return os.getpid(), self.service.vocab_size, self.service.context, self.service.special_ids

    def score(self, requests: list[Request]) -> list[list[torch.Tensor]]:
        if self.exit_once:
            try:
                os.remove(self.exit_once)  # succeeds once: tests kill a replica mid-call this way
            except FileNotFoundError:
                pass
            else:
                os._exit(1)
        return self.service.score(requests)

    def stats(self) -> dict:
        return self.service.stats()


def request_tokens(request: Request) -> int:
    """A request's cost for splitting: the tokens of its group row."""
    try:
        return len(request["prompt_ids"]) + sum(len(c) for c in request["completion_ids"])
    except (TypeError, KeyError):
        return 0  # a malformed request: its replica's check names it


class ReferencePool:
    """``num_replicas`` ``ReferenceService``s as Ray actors; ``score`` splits each call by tokens.

    Connects to the running cluster when ``ray.init(...)`` was called first, else starts a
    local one. Each replica takes one GPU if the cluster has one per replica, else one CPU. A
    replica that dies is restarted by Ray (``max_restarts``) and its task re-run
    (``max_task_retries``); if Ray gives up, the pool sends the share to another replica.
    Either way every request is answered exactly once, in request order.

    Each replica loads ``path`` as ``ReferenceService.from_pretrained(path, dtype, device,
    reference, options)`` does; ``options`` (a ``ServiceOptions``, or its fields as keywords)
    travels to every replica as one record.
    """

    def __init__(self, path: str | Path, num_replicas: int = 2, max_restarts: int = 3, max_task_retries: int = 3,
                 dtype: str | torch.dtype = "auto", device: str | torch.device | None = None,
                 reference: str = "initial", options: ServiceOptions | None = None, _exit_once: str | None = None,
                 **fields):
        options = with_fields(ServiceOptions, options, fields)
        loading = {"dtype": dtype, "device": device, "reference": reference}
        check_model_dir(resolve_model_path(str(path)), "path", tokenizer=False)  # not in every replica
        ray = _import_ray()
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be at least 1; got {num_replicas}")
        if not ray.is_initialized():
            ray.init(include_dashboard=False, log_to_driver=False)
        self._ray = ray
        self.temperature = options.temperature_or_one  # what each replica divides the logits by
        cluster = ray.cluster_resources()
        gpus, cpus = cluster.get("GPU", 0), cluster.get("CPU", 0)
        resources = {"num_gpus": 1} if gpus >= num_replicas else {"num_cpus": 1}
        if "num_cpus" in resources and cpus < num_replicas:
            # Ray leaves an actor it has no room for unscheduled, with no error: ready() below
            # would wait for it for ever, saying nothing.
            raise ValueError(f"num_replicas={num_replicas}: each replica takes one CPU and the Ray cluster has "
                             f"{cpus:g}; ask for at most {int(cpus)}, or give Ray more (ray.init(num_cpus=...))")
        actor = ray.remote(_Replica).options(max_restarts=max_restarts, max_task_retries=max_task_retries, **resources)
        self.replicas = [actor.remote(str(path), loading, options, _exit_once) for _ in range(num_replicas)]
        _, self.vocab_size, self.context, self.special_ids = ray.get([r.ready.remote() for r in self.replicas])[0]

    def _replicas(self) -> list:
        if not self.replicas:
            raise RuntimeError("this ReferencePool was shut down; start a new one")
        return self.replicas

    def score(self, requests: Sequence[Request]) -> list[list[torch.Tensor]]:
        """As ``ReferenceService.score``, over the replicas."""
        ray = self._ray
        n = len(self._replicas())
        for i, r in enumerate(requests):  # here, so that an error names the caller's request index
            check_request(i, r, self.vocab_size, self.context)
        shares = [sorted(s) for s in split_by_weight(list(range(len(requests))), n, tiebreak=lambda i: i,
                                                     weight=lambda i: request_tokens(requests[i])) if s]
        submit = lambda r, s: self.replicas[r].score.remote([requests[i] for i in shares[s]])  # noqa: E731
        # ref -> (replica, share, tries); share s starts on replica s
        pending = {submit(s, s): (s, s, 0) for s in range(len(shares))}
        results: list = [None] * len(requests)
        while pending:
            (ref,), _ = ray.wait(list(pending), num_returns=1)
            r, s, tries = pending.pop(ref)
            try:
                values = ray.get(ref)
            except ray.exceptions.RayActorError:
                # Ray's own restarts and task retries are spent: the share goes to the next replica.
                if tries + 1 >= n:
                    raise
                pending[submit((r + 1) % n, s)] = ((r + 1) % n, s, tries + 1)
                continue
            for i, v in zip(shares[s], values):
                results[i] = v
        return results

    def forward(self, input_ids: torch.Tensor, max_req_tokens: int, pad_id: int,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """As ``ReferenceService.forward``, over the replicas."""
        requests, rows = forward_requests(input_ids, max_req_tokens, pad_id, attention_mask, self.special_ids)
        return forward_output(scored_rows(self.score, requests, rows), rows, input_ids, max_req_tokens)

    def stats(self) -> dict:
        """Summed counters, with each replica's under ``replicas`` (a restarted replica's start
        from zero)."""
        parts = self._ray.get([r.stats.remote() for r in self._replicas()])
        return {**summed_stats(parts), "replicas": parts}

    def shutdown(self) -> None:
        for r in self.replicas:
            self._ray.kill(r)
        self.replicas = []
