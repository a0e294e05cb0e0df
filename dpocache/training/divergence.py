"""Divergence that training must stop on: a loss that is not finite (and where it came from),
and runs that go wrong without ever producing a NaN.

- ``nan_source``: a non-finite loss comes from the cached reference values of the batch (a
  damaged or non-finite cache), from the policy's log-probs (the policy diverged), or from the
  loss itself (finite inputs, e.g. an overflow in the loss's own arithmetic).
- ``ProgressMonitor``: after each optimizer step, the gradient norm and the norm of the trainable
  weights (the latter queued on the device and read with the next step's one host wait, or
  before a log, checkpoint or eval). A gradient norm of exactly 0 for ``ZERO_GRAD_STEPS``
  consecutive steps means nothing is learned any more (saturated or underflowing loss, detached
  graph); trainable weights whose norm is not finite, or more than ``WEIGHT_GROWTH`` times their
  norm at the start of the run, are growing without bound (an update far too large). Under
  float16 loss scaling a step whose gradients overflow is skipped
  (``policy.build_grad_scaler``); ``OVERFLOW_STEPS`` skipped in a row (the scale halved as many
  times, from 65536 to below 1/256) means the gradients overflow float16 whatever the scale. The
  norms are the same on every rank (DDP replicas are identical; FSDP norms are reduced over the
  shards), so all ranks stop at the same step.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

ZERO_GRAD_STEPS = 20
WEIGHT_GROWTH = 100.0
OVERFLOW_STEPS = 24

CACHE, POLICY, LOSS = 0, 1, 2  # positions in the flags ``nan_flags`` returns


def nan_flags(policy_c: torch.Tensor, policy_r: torch.Tensor, ref_c: torch.Tensor | None,
              ref_r: torch.Tensor | None) -> list[float]:
    """``[cache, policy, loss]``: 1.0 where that source holds a non-finite value of the batch's
    ``(B,)`` sums (``loss``: neither does, the loss's own arithmetic overflowed)."""
    cache = ref_c is not None and not bool(torch.isfinite(ref_c).all() and torch.isfinite(ref_r).all())
    policy = not bool(torch.isfinite(policy_c.detach()).all() and torch.isfinite(policy_r.detach()).all())
    return [float(cache), float(policy), float(not cache and not policy)]


def nan_rows(pairs: Sequence, values: Sequence[torch.Tensor | None]) -> list[int]:
    """Data rows of ``pairs`` whose value in any of ``values`` (each ``(B,)``) is not finite."""
    bad = torch.zeros(len(pairs), dtype=torch.bool)
    for v in values:
        if v is not None:
            bad |= ~torch.isfinite(v.detach().float().cpu())
    return [pairs[i].index for i in bad.nonzero().flatten().tolist()]


def describe_nan(flags: Sequence[float], cache_dir: str | None, rows: list[int]) -> str:
    """Where the NaN came from, in words, from the flags of every rank (max-reduced)."""
    shown = f" (rows {', '.join(map(str, rows[:5]))}{', ...' if len(rows) > 5 else ''})" if rows else ""
    parts = []
    if flags[CACHE]:
        parts.append(f"the cached reference values are not finite{shown if not flags[POLICY] else ''}: the cache in "
                     f"{cache_dir} is damaged (check it with dpocache cache verify, or delete it to rebuild)")
    if flags[POLICY]:
        parts.append(f"the policy's log-probs are not finite{shown}: the policy diverged")
    if flags[LOSS] and not parts:
        parts.append("the policy's log-probs and the cached reference values are finite: the loss overflowed")
    return "; ".join(parts)


class ProgressMonitor:
    """Watches the gradient and weight norms after each optimizer step (see the module doc).

    The gradient norm is read on the host by the step anyway (``check``). The weights' norm is
    not: ``measure`` queues it on the device after the update, and it is read with the next
    step's one wait (``pending``, then ``judge``), or at once by ``settle`` before anything is
    saved or evaluated. A reading on the host of its own would make every step wait for its
    optimizer update, and the host could not queue the next step's work behind it."""

    def __init__(self, params: Sequence[torch.Tensor], zero_grad_steps: int | None = None,
                 weight_growth: float | None = None):
        self.params = list(params)
        self.zero_grad_steps = zero_grad_steps if zero_grad_steps is not None else ZERO_GRAD_STEPS
        self.weight_growth = weight_growth if weight_growth is not None else WEIGHT_GROWTH
        self.initial_norm = float(self._weight_norm())
        self.zero_streak = 0
        self.overflow_streak = 0
        self.measured_step: int | None = None  # the step whose weights' norm is ``pending``
        self.pending: torch.Tensor | None = None  # (1,) float64 on the device, not yet read

    def _weight_norm(self) -> torch.Tensor:
        norm = torch.nn.utils.get_total_norm([p.detach() for p in self.params])
        if hasattr(norm, "full_tensor"):  # FSDP2: a DTensor over every rank's shard
            norm = norm.full_tensor()
        return norm

    def check(self, grad_norm: float, skipped: bool = False) -> str | None:
        """Why the run diverged by this step's gradient norm, or None. ``skipped``: the loss
        scaler skipped the step for gradients that overflowed float16."""
        self.overflow_streak = self.overflow_streak + 1 if skipped else 0
        if self.overflow_streak >= OVERFLOW_STEPS:
            return (f"the float16 gradients overflowed at {self.overflow_streak} consecutive steps, each skipped with "
                    "the loss scale halved: train in bfloat16 or float32 (--dtype)")
        self.zero_streak = self.zero_streak + 1 if grad_norm == 0.0 else 0
        if self.zero_streak >= self.zero_grad_steps:
            return (f"the gradient norm has been exactly 0 for {self.zero_streak} consecutive steps: nothing is "
                    "learned (a saturated or underflowing loss, or no trainable parameter reaches the loss)")
        return None

    def measure(self, step: int) -> None:
        """Queue the norm of the weights ``step``'s update left, on the device (no wait)."""
        self.measured_step, self.pending = step, self._weight_norm().detach().double().reshape(1)

    def judge(self, norm: float) -> str | None:
        """Why the weights' norm ``norm`` (``pending``, read on the host) means the run
        diverged, or None; the reading is consumed."""
        self.pending = None
        if not math.isfinite(norm) or norm > self.weight_growth * max(self.initial_norm, 1e-12):
            ratio = norm / max(self.initial_norm, 1e-12)
            return (f"the trainable weights' norm is {norm:.4g}, {ratio:.3g} times its {self.initial_norm:.4g} at the "
                    f"start (the limit is {self.weight_growth:g} times): they are growing without bound")
        return None

    def settle(self) -> str | None:
        """``judge`` the pending norm now (one wait for the device); None if none is pending."""
        return None if self.pending is None else self.judge(float(self.pending))
