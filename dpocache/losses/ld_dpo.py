"""LD-DPO in training: per-pair sums with the verbose tail down-weighted, for the reference
(from the cache's per-token values) and the policy (from its per-token forward output).

The formula is :func:`dpocache.losses.formulas.ld_pair_logps`; both sides hand their per-token values
in the same record (``dpocache.data.values.PairValues``), whatever the layout. The cache keeps
plain per-token values, so it stays independent of ``ld_alpha``: changing it reuses every
cached value.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence

from dpocache.data.values import PairValues
from dpocache.losses.formulas import ld_pair_logps


def ld_sums(chosen: Sequence[Tensor], rejected: Sequence[Tensor], ld_alpha: float) -> tuple[Tensor, Tensor]:
    """Per-pair lists of completion log-probs ``(Tc_i,)`` and ``(Tr_i,)`` -> LD-DPO sums, two ``(B,)``."""
    def padded(rows: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
        values = pad_sequence(list(rows), batch_first=True)  # (B, T)
        # Built on the values' device from their shapes: no host list copied over, which would
        # make the host wait for the device.
        mask = pad_sequence([torch.ones_like(r, dtype=torch.bool) for r in rows], batch_first=True)  # (B, T)
        return values, mask

    (c, cm), (r, rm) = padded(chosen), padded(rejected)
    return ld_pair_logps(c, cm, r, rm, ld_alpha)


def ld_values(values: PairValues, ld_alpha: float) -> PairValues:
    """``values`` (per-token fields given: the cache's, ``CacheStore.lookup(..., per_token=True)``,
    or the policy's, ``prefix.layout_logprobs(..., per_token=True)``) with their sums replaced by
    LD-DPO's ``(B,)``, the per-token fields dropped; the counts are kept."""
    if values.chosen_token_logps is None:
        raise ValueError("LD-DPO needs per-token log-probs")
    if len(values) == 0:
        return values.sums_only()
    chosen, rejected = ld_sums([t.float() for t in values.chosen_token_logps],
                               [t.float() for t in values.rejected_token_logps], ld_alpha)
    return PairValues(chosen, rejected, values.chosen_tokens, values.rejected_tokens)
