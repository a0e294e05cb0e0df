"""WPO in training: the policy's per-pair sums of aligned log-probs, from one batch's forward.

WPO (Zhou et al. 2024, arXiv:2406.11827, eq. 2) weights each pair's loss by
``exp(mean_t a_t(chosen) + mean_t a_t(rejected))`` with the aligned log-prob
``a_t = log p(y_t) - log sum_v p(v)^2`` of the policy; the formula is
:func:`dpocache.losses.formulas.wpo_weights`. ``log sum_v p(v)^2`` needs the full-vocabulary logits, so
the policy's chunked head computes it on request (``CompletionLogProbs.sum_sq_probs``); this
module only sums ``a_t`` per sequence in the layout the batch ran. The weights come from the
policy alone: the reference's cached values are not involved, and the cache does not change.
"""

from __future__ import annotations

from torch import Tensor

from dpocache.data.values import PairValues, completion_sums


def wpo_sums(lp: PairValues, log_sum_sq_probs: Tensor) -> tuple[Tensor, Tensor]:
    """Sums over each completion of ``log p(y_t) - log sum_v p(v)^2``, two ``(B,)``, detached:
    the policy's plain sequence sums ``lp`` less the sums of ``log_sum_sq_probs``, which has the
    shape of the scorer's output in the layout the batch ran:

    - padded (``(2B, T)``, rows chosen then rejected, 0 off the completion): row sums;
    - shared prompt (``(M,)``): completion tokens pair after pair, chosen then rejected
      (``dpocache.scoring.shared.collate_shared``'s order).
    """
    b = lp.chosen_logps.shape[0]
    if log_sum_sq_probs.dim() == 2:
        sq = log_sum_sq_probs.sum(-1)  # (2B,)
        sq_chosen, sq_rejected = sq[:b], sq[b:]
    else:
        sq_chosen, sq_rejected = completion_sums(log_sum_sq_probs, lp.chosen_tokens, lp.rejected_tokens)
    return lp.chosen_logps.detach() - sq_chosen, lp.rejected_logps.detach() - sq_rejected
