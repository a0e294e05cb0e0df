"""LD-DPO in training: per-pair sums with the verbose tail down-weighted, for the reference
(from the cache's per-token values) and the policy (from its per-token forward output).

The formula is :func:`dpocache.losses.ld_pair_logps`; this module only gathers the per-token
values each side has in its own layout. The cache keeps plain per-token values, so it stays
independent of ``ld_alpha``: changing it reuses every cached value.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence

from .cache.store import CacheStore
from .data import TokenizedPair
from .logprobs import PairLogProbs
from .losses import ld_pair_logps


def ld_sums(chosen: Sequence[Tensor], rejected: Sequence[Tensor], ld_alpha: float) -> tuple[Tensor, Tensor]:
    """Per-pair lists of completion log-probs ``(Tc_i,)`` and ``(Tr_i,)`` -> LD-DPO sums, two ``(B,)``."""
    def padded(rows: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
        values = pad_sequence(list(rows), batch_first=True)  # (B, T)
        lengths = torch.tensor([len(r) for r in rows], device=values.device)
        mask = torch.arange(values.shape[1], device=values.device)[None, :] < lengths[:, None]
        return values, mask

    (c, cm), (r, rm) = padded(chosen), padded(rejected)
    return ld_pair_logps(c, cm, r, rm, ld_alpha)


def ld_reference(store: CacheStore, keys: Sequence[bytes], ld_alpha: float) -> tuple[Tensor, Tensor]:
    """LD-DPO reference sums ``(N,)`` each for ``keys``, from the cache's per-token values."""
    chosen, rejected = [], []
    for key in keys:
        c, r = store.token_logps(key)
        chosen.append(c.float())
        rejected.append(r.float())
    if not keys:
        return torch.zeros(0), torch.zeros(0)
    return ld_sums(chosen, rejected, ld_alpha)


def ld_policy(lp: PairLogProbs, pairs: Sequence[TokenizedPair], ld_alpha: float) -> tuple[Tensor, Tensor]:
    """LD-DPO policy sums ``(B,)`` each from one batch's forward output, in either layout:

    - shared prompt (``token_logps`` ``(M,)``): completion tokens pair after pair, chosen then
      rejected (``dpocache.prefix.split_per_token``'s order);
    - padded (``token_logps`` ``(2B, T)``, rows chosen then rejected, right-padded): row i's
      completion is at positions [prompt length, prompt length + completion length).
    """
    b = len(pairs)
    if lp.token_logps.dim() == 1:
        counts = torch.stack([lp.chosen_tokens, lp.rejected_tokens], 1).reshape(-1).tolist()
        parts = lp.token_logps.split(counts)
        return ld_sums(parts[0::2], parts[1::2], ld_alpha)
    chosen = [lp.token_logps[i, len(p.prompt_ids):len(p.prompt_ids) + len(p.chosen_ids)] for i, p in enumerate(pairs)]
    rejected = [lp.token_logps[b + i, len(p.prompt_ids):len(p.prompt_ids) + len(p.rejected_ids)]
                for i, p in enumerate(pairs)]
    return ld_sums(chosen, rejected, ld_alpha)
