"""WPO in training: the policy's per-pair sums of aligned log-probs, from one batch's forward.

WPO (Zhou et al. 2024, arXiv:2406.11827, eq. 2) weights each pair's loss by
``exp(mean_t a_t(chosen) + mean_t a_t(rejected))`` with the aligned log-prob
``a_t = log p(y_t) - log sum_v p(v)^2`` of the policy; the formula is
:func:`dpocache.losses.wpo_weights`. ``log sum_v p(v)^2`` needs the full-vocabulary logits, so
the policy's chunked head computes it on request (``CompletionLogProbs.sum_sq_probs``); this
module only sums ``a_t`` per sequence in the layout the batch ran. The weights come from the
policy alone: the reference's cached values are not involved, and the cache does not change.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .logprobs import PairLogProbs


def wpo_sums(lp: PairLogProbs, log_sum_sq_probs: Tensor) -> tuple[Tensor, Tensor]:
    """Sums over each completion of ``log p(y_t) - log sum_v p(v)^2``, two ``(B,)``, detached.

    ``log_sum_sq_probs`` has the shape of ``lp.token_logps``:

    - padded (``(2B, T)``, rows chosen then rejected, 0 off the completion): row sums;
    - shared prompt (``(M,)``): completion tokens pair after pair, chosen then rejected
      (``dpocache.prefix.collate_shared``'s order).
    """
    aligned = lp.token_logps.detach() - log_sum_sq_probs  # 0 off the completion in the padded layout
    b = lp.chosen_logps.shape[0]
    if aligned.dim() == 2:
        sums = aligned.sum(-1)  # (2B,)
        return sums[:b], sums[b:]
    counts = torch.stack([lp.chosen_tokens, lp.rejected_tokens], 1).reshape(-1)  # (2B,) c0, r0, c1, r1, ...
    segment = torch.arange(2 * b, device=aligned.device)
    owner = (segment % 2) * b + segment // 2  # segment 2i -> row i (chosen), 2i+1 -> row B + i (rejected)
    index = owner.repeat_interleave(counts.to(aligned.device))  # (M,)
    sums = torch.zeros(2 * b, dtype=aligned.dtype, device=aligned.device).index_add(0, index, aligned)
    return sums[:b], sums[b:]
