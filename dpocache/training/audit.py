"""The step-0 audit: the first training forward checks the cache at no extra cost.

When the policy starts from the reference's weights, its first micro-batch's log-probs *are*
reference log-probs, computed again by the same code path. Comparing them with the cached
values of that batch catches what the namespace key cannot see (a weight file edited in place
with its mtime restored, a damaged or foreign value that passed every checksum) before a
single optimizer step uses a wrong value.

Tolerance on a sequence's summed log-prob ``v`` (``audit_tolerance``): the cache and training
run the same function on the same weights, but in different batches (other lengths, other
padding, the shared-prompt or padded layout), so the kernels sum in another order:

    float32   1e-4 + 1e-5 * |v|     (measured drift on the tiny models: below 1e-5)
    float16   0.05 + 5e-3 * |v|
    bfloat16  0.25 + 2e-2 * |v|     (8 mantissa bits; the same bound ``cache verify`` allows)

A stale cache is off by whole nats; these bounds are far below that and far above rounding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist

from dpocache.data.pairs import TokenizedPair
from dpocache.distributed.process_group import DistEnv

WORST_SHOWN = 3  # sequences named in the error

_TOLERANCES = {"float32": (1e-4, 1e-5), "float16": (0.05, 5e-3), "bfloat16": (0.25, 2e-2)}


class ReferenceAuditFailed(RuntimeError):
    """The cached reference values disagree with the initial policy's own log-probs."""


def audit_tolerance(dtype: str, value: float) -> float:
    absolute, relative = _TOLERANCES.get(dtype, _TOLERANCES["bfloat16"])
    return absolute + relative * abs(value)


def tolerance_text(dtype: str) -> str:
    absolute, relative = _TOLERANCES.get(dtype, _TOLERANCES["bfloat16"])
    return f"{absolute:g} + {relative:g} x |value| ({dtype}, on a sequence's summed log-prob)"


@dataclass
class Drift:
    """One sequence's comparison."""

    row: int  # the pair's row in the data
    side: str  # chosen | rejected
    cached: float
    policy: float

    @property
    def drift(self) -> float:
        return abs(self.cached - self.policy) if math.isfinite(self.cached) else math.inf

    def __str__(self) -> str:
        return (f"row {self.row} {self.side}: cached {self.cached:.4f}, policy {self.policy:.4f} "
                f"(drift {self.drift:.3g})")


def compare(pairs: Sequence[TokenizedPair], policy_c: torch.Tensor, policy_r: torch.Tensor, cached_c: torch.Tensor,
            cached_r: torch.Tensor, dtype: str) -> dict:
    """This rank's comparison of ``(B,)`` policy and cached sums: the largest drift, how many
    sequences exceed the tolerance and the worst of them (largest drift / tolerance first).
    A policy value that is not finite is left to the loss's own check (it is the policy's)."""
    rows = []
    for side, pol, ref in (("chosen", policy_c, cached_c), ("rejected", policy_r, cached_r)):
        for p, a, b in zip(pairs, pol.detach().float().cpu().tolist(), ref.detach().float().cpu().tolist()):
            if math.isfinite(a):
                rows.append(Drift(p.index, side, b, a))
    ratio = [d.drift / audit_tolerance(dtype, d.cached if math.isfinite(d.cached) else 0.0) for d in rows]
    order = sorted(range(len(rows)), key=lambda i: -ratio[i])
    bad = [i for i in order if ratio[i] > 1.0]
    return {
        "sequences": len(rows), "over": len(bad), "max_abs_drift": max((d.drift for d in rows), default=0.0),
        "max_drift_over_tolerance": ratio[order[0]] if rows else 0.0,
        "worst": [(ratio[i], str(rows[i])) for i in bad[:WORST_SHOWN]],
    }


def gather(env: DistEnv, local: dict) -> dict:
    """Every rank's ``compare`` merged (the same result on every rank, so all stop or none)."""
    parts = [local]
    if env.enabled:
        parts = [None] * env.world_size
        dist.all_gather_object(parts, local)
    worst = sorted((w for p in parts for w in p["worst"]), key=lambda w: -w[0])
    return {
        "sequences": sum(p["sequences"] for p in parts), "over": sum(p["over"] for p in parts),
        "max_abs_drift": max(p["max_abs_drift"] for p in parts),
        "max_drift_over_tolerance": max(p["max_drift_over_tolerance"] for p in parts),
        "worst": [text for _, text in worst[:WORST_SHOWN]], "ranks": len(parts),
    }


def failure_message(result: dict, namespace_dir: str, rebuild: str) -> str:
    return (f"step-0 audit: the cached reference values in {namespace_dir} disagree with the initial policy's own "
            f"log-probs ({result['over']} of {result['sequences']} sequences beyond the tolerance; worst: "
            f"{'; '.join(result['worst'])}): the cache is stale or damaged and training would use wrong values. "
            f"Rebuild it: {rebuild}")
