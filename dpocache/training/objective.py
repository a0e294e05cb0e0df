"""What one micro-batch computes: the policy's log-probs in the run's layout, the preference loss
against the cached reference (LD-DPO's and WPO's modifiers applied), and its metrics."""

from __future__ import annotations

from dpocache.losses.formulas import wpo_weights
from dpocache.losses.ld_dpo import ld_values
from dpocache.losses.registry import preference_loss
from dpocache.losses.wpo import wpo_sums
from dpocache.scoring.layouts import layout_logprobs
from dpocache.scoring.logprobs import autocast, scorer_core
from dpocache.training.cached_reference import audit_step0
from dpocache.training.metrics import MetricWindow
from dpocache.training.prefetch import MicroBatch
from dpocache.training.state import Run


def batch_losses(run: Run, micro: MicroBatch, window: MetricWindow, prefix: str = "", check_cache: bool = False):
    """Policy forward on ``micro``'s pairs (``prefetch.prepare``: laid out on the host); returns
    the loss per example ``(B,)``, for MoE policies the router load-balancing loss (a scalar,
    else None), and the loss's inputs (pairs and the detached ``(B,)`` policy and reference
    sums); records the metrics. ``check_cache``: first compare the policy's log-probs with the
    cached ones (``audit_step0``)."""
    pairs = micro.pairs
    ld_alpha = run.cfg.loss.ld_alpha  # LD-DPO: sums recombined from per-token values, as the cache's were
    with autocast(run.dtype, run.env.device):
        pad_id = run.tokenizer.pad_token_id or 0
        lp, tokens = layout_logprobs(run.scorer, run.layout.used, pairs, pad_id, run.env.device,
                                     per_token=ld_alpha is not None, laid=micro.laid)
    # The loss's inputs; the logged log-probs stay the plain sums.
    loss_lp = ld_values(lp, ld_alpha) if ld_alpha is not None else lp
    ref = micro.ref.to(run.env.device) if micro.ref is not None else None
    ref_c = ref.chosen_logps if ref is not None else None
    ref_r = ref.rejected_logps if ref is not None else None
    pc, pr = loss_lp.chosen_logps, loss_lp.rejected_logps
    if check_cache:
        audit_step0(run, pairs, pc, pr, ref_c, ref_r)
    inputs = (pairs, pc.detach(), pr.detach(), ref_c, ref_r)  # the loss's inputs, for _stop_non_finite
    wpo = {}
    if run.cfg.loss.use_weighting:  # WPO: weights from the policy's plain per-token values (as TRL), not LD-DPO's
        cw, rw = wpo_sums(lp, scorer_core(run.scorer).log_sum_sq_probs)
        wpo = {"chosen_wpo_logps": cw, "rejected_wpo_logps": rw}
        window.add_mean(prefix + "wpo/weights", wpo_weights(cw, rw, lp.chosen_tokens.clamp(min=1),
                                                             lp.rejected_tokens.clamp(min=1)))
    losses, rc, rr = preference_loss(run.spec, pc, pr, ref_c, ref_r, lp.chosen_tokens, lp.rejected_tokens, **wpo)
    window.add_mean(prefix + "loss", losses)
    window.add_mean(prefix + "rewards/chosen", rc)
    window.add_mean(prefix + "rewards/rejected", rr)
    window.add_mean(prefix + "rewards/average", (rc + rr) / 2)
    # A tie (policy == reference) counts half: accuracy starts at chance, 0.5, not 0.
    window.add_mean(prefix + "rewards/accuracies", (rc > rr).float() + 0.5 * (rc == rr).float())
    window.add_mean(prefix + "rewards/margins", rc - rr)
    window.add_mean(prefix + "logps/chosen", lp.chosen_logps)
    window.add_mean(prefix + "logps/rejected", lp.rejected_logps)
    if _has_nll(run):
        window.add_mean(prefix + "sft_loss", -(lp.chosen_logps.detach() / lp.chosen_tokens.clamp(min=1)))
    window.add_total(prefix + "tokens", float(tokens))  # counted on the host, from the pairs
    aux = scorer_core(run.scorer).aux_loss
    if aux is not None:
        window.add(prefix + "aux_loss", aux.detach(), 1.0)
    return losses, aux, inputs


def _has_nll(run: Run) -> bool:
    names = {n for n, _ in run.spec.terms}
    return bool(names & {"sft", "orpo"}) or run.spec.params.get("rpo_alpha") is not None
