"""``ReferencePool``: the reference service on several Ray actors (replicas in other processes or
on other GPUs), ``score`` spread over them by token count, a dead replica restarted and its work
retried (``pip install 'dpocache[ray]'``)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Sequence

import torch

from dpocache.config import whole_number, with_fields
from dpocache.distributed.process_group import split_by_weight
from dpocache.models.hub_ids import resolve_model_path
from dpocache.runtime.preflight import check_model_dir, check_writable_dir
from dpocache.service.reference_service import (
    ReferenceService,
    Request,
    ServiceOptions,
    check_loading,
    check_request,
    check_requests,
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


FREED_WITHIN_S = 10.0  # how long a replica's resources may wait to be freed by actors just killed


def request_tokens(request: Request) -> int:
    """A request's cost for splitting: the tokens of its group row."""
    try:
        return len(request["prompt_ids"]) + sum(len(c) for c in request["completion_ids"])
    except (TypeError, KeyError):
        return 0  # a malformed request: its replica's check names it


def _replica_resources(ray, num_replicas: int, device) -> dict:
    """One GPU a replica where the cluster has GPUs (and ``device`` does not say CPU), else one
    CPU; refused in one line unless that many are free now. Ray leaves an actor it has no room
    for unscheduled, with no error, so waiting for it would wait for ever, saying nothing."""
    total = ray.cluster_resources()
    on_cpu = device is not None and torch.device(device).type == "cpu"
    kind = "GPU" if total.get("GPU", 0) >= 1 and not on_cpu else "CPU"
    free, have = ray.available_resources(), total.get(kind, 0)
    deadline = time.monotonic() + FREED_WITHIN_S
    while have >= num_replicas > free.get(kind, 0) and time.monotonic() < deadline:
        time.sleep(0.1)  # a pool shut down just before frees its actors' resources a moment later
        free = ray.available_resources()
    if free.get(kind, 0) < num_replicas:
        held = have >= num_replicas  # enough in all, but other actors hold them
        has = f"{free.get(kind, 0):g} of its {have:g} free (other actors hold the rest)" if held else f"{have:g}"
        other = "; or device='cpu' for replicas on CPUs" if kind == "GPU" else ""
        raise ValueError(f"num_replicas={num_replicas}: each replica takes one {kind} and the Ray cluster has "
                         f"{has}; ask for at most {int(free.get(kind, 0) if held else have)}, or give Ray more "
                         f"(ray.init(num_{kind.lower()}s=...)){other}")
    return {"num_gpus": 1} if kind == "GPU" else {"num_cpus": 1}


class ReferencePool:
    """``num_replicas`` ``ReferenceService``s as Ray actors; ``score`` splits each call by tokens.

    Connects to the running cluster when ``ray.init(...)`` was called first, else starts a
    local one. Each replica takes one GPU where the cluster has GPUs (``device='cpu'``: one CPU),
    else one CPU; fewer free than ``num_replicas`` is refused in one line. A
    replica that dies is restarted by Ray (``max_restarts``) and its task re-run
    (``max_task_retries``); if Ray gives up, the pool sends the share to another replica.
    Either way every request is answered exactly once, in request order.

    Each replica loads ``path`` (``model_dir``: a Hub id resolved to its local directory) as
    ``ReferenceService.from_pretrained(path, dtype, device, reference, options)`` does;
    ``options`` (a ``ServiceOptions``, or its fields as keywords) travels to every replica as
    one record.
    """

    def __init__(self, path: str | Path, num_replicas: int = 2, max_restarts: int = 3, max_task_retries: int = 3,
                 dtype: str | torch.dtype = "auto", device: str | torch.device | None = None,
                 reference: str = "initial", options: ServiceOptions | None = None, _exit_once: str | None = None,
                 **fields):
        options = with_fields(ServiceOptions, options, fields)  # each field checked here, not in each replica
        check_loading(dtype, reference)
        loading = {"dtype": dtype, "device": device, "reference": reference}
        # what each replica loads
        self.model_dir = Path(resolve_model_path(str(path), "ReferencePool: path")).expanduser()
        check_model_dir(self.model_dir, "path", tokenizer=False)
        if options.cache_dir is not None:
            check_writable_dir(options.cache_dir, "cache_dir")
        if not whole_number(num_replicas, 1):
            raise ValueError(f"num_replicas must be a whole number of at least 1; got {num_replicas!r}")
        ray = _import_ray()
        if not ray.is_initialized():
            ray.init(include_dashboard=False, log_to_driver=False)
        self._ray = ray
        self.temperature = options.temperature_or_one  # what each replica divides the logits by
        resources = _replica_resources(ray, num_replicas, device)
        actor = ray.remote(_Replica).options(max_restarts=max_restarts, max_task_retries=max_task_retries, **resources)
        self.replicas = [actor.remote(str(path), loading, options, _exit_once) for _ in range(num_replicas)]
        self.max_restarts = max_restarts
        self.died: dict[int, str] = {}  # replica index -> the first line of Ray's error: out of restarts
        _, self.vocab_size, self.context, self.special_ids = ray.get([r.ready.remote() for r in self.replicas])[0]

    def _live(self) -> list[int]:
        """The indices of the replicas still alive; refused in one line where none is."""
        if not self.replicas:
            raise RuntimeError("this ReferencePool was shut down; start a new one")
        live = [i for i in range(len(self.replicas)) if i not in self.died]
        if not live:
            reason = next(iter(self.died.values()))
            raise RuntimeError(f"every replica of this ReferencePool died and Ray's restarts (max_restarts="
                               f"{self.max_restarts}) are spent ({reason}); start a new one")
        return live

    def _died(self, replica: int, error: BaseException) -> None:
        """Ray gave up on this replica: its actor is dead for good, not one task of it lost."""
        if isinstance(error, self._ray.exceptions.ActorDiedError):
            self.died.setdefault(replica, str(error).strip().splitlines()[0] if str(error).strip() else
                                 type(error).__name__)

    def score(self, requests: Sequence[Request]) -> list[list[torch.Tensor]]:
        """As ``ReferenceService.score``, over the replicas alive."""
        ray = self._ray
        live = self._live()
        requests = check_requests(requests)
        for i, r in enumerate(requests):  # here, so that an error names the caller's request index
            check_request(i, r, self.vocab_size, self.context)
        shares = [sorted(s) for s in split_by_weight(list(range(len(requests))), len(live), tiebreak=lambda i: i,
                                                     weight=lambda i: request_tokens(requests[i])) if s]
        submit = lambda r, s: self.replicas[r].score.remote([requests[i] for i in shares[s]])  # noqa: E731
        # ref -> (replica, share, tries); share s starts on the s-th replica alive
        pending = {submit(live[s], s): (live[s], s, 0) for s in range(len(shares))}
        results: list = [None] * len(requests)
        while pending:
            (ref,), _ = ray.wait(list(pending), num_returns=1)
            r, s, tries = pending.pop(ref)
            try:
                values = ray.get(ref)
            except ray.exceptions.RayActorError as e:
                # Ray's own restarts and task retries are spent: the share goes to the next replica alive.
                self._died(r, e)
                live = self._live()  # one line where none is left
                if tries + 1 >= len(self.replicas):
                    raise RuntimeError(f"requests {shares[s][0]}..{shares[s][-1]} failed on every replica of this "
                                       f"ReferencePool: {str(e).strip().splitlines()[0]}") from e
                later = [i for i in live if i > r] or live
                pending[submit(later[0], s)] = (later[0], s, tries + 1)
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
        """Summed counters of the replicas alive, with each replica's under ``replicas`` (a
        restarted replica's start from zero; one that died for good is ``{"died": reason}``)."""
        ray = self._ray
        asked = {i: self.replicas[i].stats.remote() for i in self._live()}
        parts: list[dict] = []
        for i in range(len(self.replicas)):
            if i in asked:
                try:
                    parts.append(ray.get(asked[i]))
                    continue
                except ray.exceptions.RayActorError as e:
                    self._died(i, e)
            parts.append({"died": self.died.get(i, "unavailable")})
        return {**summed_stats([p for p in parts if "died" not in p]), "replicas": parts}

    def shutdown(self) -> None:
        """Ends the replicas (Ray itself, started by the first pool where none ran, stays up for
        later pools: ``ray.shutdown()`` ends it); later calls are refused in one line. ``close``
        is the same (``ReferenceService``'s name), and ``with ReferencePool(...) as pool:`` ends
        them on leaving."""
        for r in self.replicas:
            self._ray.kill(r)
        self.replicas = []

    close = shutdown

    def __enter__(self) -> "ReferencePool":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
