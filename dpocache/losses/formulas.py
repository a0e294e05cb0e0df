"""DPO-family preference losses: pure functions over per-sequence log-probs (their registry and
``preference_loss`` are ``losses.registry``).

Every loss reads the same six tensors, all of shape ``(B,)``:

- ``policy_chosen``, ``policy_rejected``: the policy's SUM of completion-token log-probs;
- ``ref_chosen``, ``ref_rejected``: the same sums under the reference (``None`` for the
  reference-free losses ``simpo``, ``orpo`` and ``sft``);
- ``chosen_tokens``, ``rejected_tokens``: the completion token counts, so length-normalised
  losses (``ipo``, ``sigmoid_norm``, ``dpo_norm``, ``simpo``, ``orpo``, ``sft``) can be served
  by the same cached sums as the sum losses.

and returns ``(losses, chosen_rewards, rejected_rewards)``, each ``(B,)``: per-example losses
(the caller takes the mean) and detached implicit rewards for logging.

The names and formulas follow TRL 1.x ``DPOTrainer`` ``loss_type`` (``sigmoid`` ... ``sft``,
``sigmoid_norm``), open-instruct (``dpo_norm``), TRL ``CPOTrainer`` (``simpo``) and TRL
``ORPOTrainer`` (``orpo``). Where this module departs from TRL the docstring of the loss says
so and why.

Use :func:`preference_loss` (it validates, upcasts and combines); the functions in
:data:`LOSSES` are the bare formulas. A new variant is a new function and one registry line.

On top of any loss, under TRL 1.16 ``DPOConfig``'s names: ``f_divergence_type`` /
``f_alpha_divergence_coef`` (f-DPO, :func:`f_divergence_scores`), ``use_weighting`` (WPO,
:func:`wpo_weights`) and ``ld_alpha`` (LD-DPO, :func:`ld_pair_logps`, applied by the caller to
the per-token values of policy and reference before the sums reach this module).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

LossOutput = tuple[Tensor, Tensor, Tensor]

# The one default every loss shares (TRL DPOConfig/CPOConfig/ORPOConfig all use 0.1).
DEFAULT_BETA = 0.1

# Largest average log-prob ORPO feeds to log(1 - p): at exactly 0 the odds are infinite and the
# gradient is NaN (TRL has that NaN); -1e-6 is a per-token probability of 0.999999.
_ORPO_MAX_AVG_LOGP = -1e-6

# |logit| beyond which EXO's loss is flat to float64 precision (exo_pair_loss).
_EXO_MAX_LOGIT = 1e4


# ---------------------------------------------------------------------------------------------
# Shared pieces
# ---------------------------------------------------------------------------------------------


def logratios(pc: Tensor, pr: Tensor, rc: Tensor, rr: Tensor) -> tuple[Tensor, Tensor]:
    """log pi/pi_ref of chosen and of rejected; all ``(B,)``."""
    return pc - rc, pr - rr


def sum_rewards(beta: float, pc: Tensor, pr: Tensor, rc: Tensor, rr: Tensor) -> tuple[Tensor, Tensor]:
    """DPO implicit rewards beta * log(pi/pi_ref) on sums (DPO eq. 5); TRL 1.x logs these for
    every ``loss_type``. ``(B,)`` each, detached."""
    return (beta * (pc - rc)).detach(), (beta * (pr - rr)).detach()


def _avg_rewards(beta: float, pc: Tensor, pr: Tensor, ct: Tensor, rt: Tensor) -> tuple[Tensor, Tensor]:
    """Reference-free rewards beta * average log-prob (SimPO eq. 4, TRL ORPO/CPO). ``(B,)``."""
    return (beta * pc / ct).detach(), (beta * pr / rt).detach()


def _smoothed_sigmoid(logits: Tensor, label_smoothing: float) -> Tensor:
    """Conservative-DPO BCE: the label is flipped with probability ``label_smoothing``
    (Mitchell 2023, "A note on DPO with noisy preferences"). ``logits`` already carries beta.
    ``(B,)`` in, ``(B,)`` out; equals -logsigmoid(logits) when label_smoothing is 0."""
    if not label_smoothing:  # also at an infinite logit (f-DPO), where 0 * logsigmoid(-inf) would be NaN
        return -F.logsigmoid(logits)
    return -F.logsigmoid(logits) * (1 - label_smoothing) - F.logsigmoid(-logits) * label_smoothing


def nll(pc: Tensor, ct: Tensor) -> Tensor:
    """Mean per-token NLL of each chosen completion, ``(B,)``: -(sum log-probs / tokens)."""
    return -(pc / ct)


# ---------------------------------------------------------------------------------------------
# Losses that need the reference. Argument order everywhere:
#   pc, pr = policy chosen / rejected summed log-probs, (B,)
#   rc, rr = reference chosen / rejected summed log-probs, (B,)
#   ct, rt = chosen / rejected completion token counts (float, >= 1), (B,)
# ---------------------------------------------------------------------------------------------


def sigmoid_loss(pc, pr, rc, rr, ct, rt, *, beta: float, label_smoothing: float) -> LossOutput:
    """DPO: Rafailov, Sharma, Mitchell, Ermon, Manning, Finn (2023), arXiv:2305.18290, eq. 7.

    loss = -log sigma(beta * ((pc - rc) - (pr - rr))), with optional conservative-DPO label
    smoothing (cDPO, Mitchell 2023). TRL 1.x's ``sigmoid`` has no label smoothing; at the
    default ``label_smoothing=0`` the two agree exactly.

    Args: pc, pr, rc, rr: summed log-probs ``(B,)``; ct, rt: token counts ``(B,)`` (unused).
    Needs the reference.
    """
    chosen_lr, rejected_lr = logratios(pc, pr, rc, rr)
    losses = _smoothed_sigmoid(beta * (chosen_lr - rejected_lr), label_smoothing)
    return (losses, *sum_rewards(beta, pc, pr, rc, rr))


def hinge_loss(pc, pr, rc, rr, ct, rt, *, beta: float) -> LossOutput:
    """Hinge-norm loss of RSO: Liu, Zhao, Joshi, Khalman, Saleh, Liu, Liu (2023), arXiv:2309.06657
    (sec. 3), the normalised-likelihood form of the SLiC calibration loss (Zhao et al. 2023,
    arXiv:2305.10425, eq. 1): relu(1 - beta * ((pc - rc) - (pr - rr))). beta acts as 1/margin.

    Args: pc, pr, rc, rr ``(B,)``; ct, rt ``(B,)`` unused. Needs the reference.
    """
    chosen_lr, rejected_lr = logratios(pc, pr, rc, rr)
    losses = torch.relu(1 - beta * (chosen_lr - rejected_lr))
    return (losses, *sum_rewards(beta, pc, pr, rc, rr))


def ipo_loss(pc, pr, rc, rr, ct, rt, *, beta: float) -> LossOutput:
    """IPO: Azar, Rowland, Piot, Guo, Calandriello, Valko, Munos (2023), arXiv:2310.12036,
    eq. 17, with beta as the paper's tau.

    loss = (h - 1/(2 beta))^2 with h = (pc - rc)/ct - (pr - rr)/rt. The per-token
    normalisation is TRL's (confirmed with the IPO authors): on sums the square grows with
    length and beta stops being comparable across data sets.

    Args: pc, pr, rc, rr ``(B,)``; ct, rt token counts ``(B,)``. Needs the reference.
    """
    chosen_lr, rejected_lr = logratios(pc, pr, rc, rr)
    h = chosen_lr / ct - rejected_lr / rt
    losses = (h - 1 / (2 * beta)) ** 2
    return (losses, *sum_rewards(beta, pc, pr, rc, rr))


def exo_pair_loss(pc, pr, rc, rr, ct, rt, *, beta: float, label_smoothing: float) -> LossOutput:
    """EXO (pairwise): Ji, Lu, Niu, Ke, Wang, Zhu, Tang, Huang (2024), arXiv:2402.00856, eq. 16.

    Reverse KL between the policy's pairwise preference q = softmax(beta * logratios) and the
    smoothed label p = (1 - eps, eps), eps = ``label_smoothing``:
    q_w (log q_w - log(1 - eps)) + q_l (log q_l - log eps).
    eps must lie in (0, 1): at 0 the second log is -inf (TRL 0.x silently swapped in 1e-3;
    here 1e-3, the paper's value, is the default and 0 is an error).

    Args: pc, pr, rc, rr ``(B,)``; ct, rt ``(B,)`` unused. Needs the reference.
    """
    chosen_lr, rejected_lr = logratios(pc, pr, rc, rr)
    # Beyond |logits| = 1e4 both terms are at their limits (sigma(-1e4) is 0 in float64), so the
    # clamp changes no value; it keeps an infinite logit (f-DPO's forward_kl) from 0 * inf = NaN.
    logits = (beta * (chosen_lr - rejected_lr)).clamp(-_EXO_MAX_LOGIT, _EXO_MAX_LOGIT)
    losses = torch.sigmoid(logits) * (F.logsigmoid(logits) - math.log1p(-label_smoothing)) + torch.sigmoid(
        -logits
    ) * (F.logsigmoid(-logits) - math.log(label_smoothing))
    return (losses, *sum_rewards(beta, pc, pr, rc, rr))


def nca_pair_loss(pc, pr, rc, rr, ct, rt, *, beta: float) -> LossOutput:
    """NCA (pairwise): Chen, He, Yuan, Cui, Su, Zhu (2024), arXiv:2402.05369, sec. 4, the
    preference-data (K=2) case TRL implements: -log sigma(r_w) - 1/2 log sigma(-r_w) - 1/2 log sigma(-r_l),
    r = beta * log(pi/pi_ref). Unlike DPO it pushes the chosen likelihood up in absolute terms.

    Args: pc, pr, rc, rr ``(B,)``; ct, rt ``(B,)`` unused. Needs the reference.
    """
    chosen_r, rejected_r = logratios(pc, pr, rc, rr)
    chosen_r, rejected_r = beta * chosen_r, beta * rejected_r
    losses = -F.logsigmoid(chosen_r) - 0.5 * F.logsigmoid(-chosen_r) - 0.5 * F.logsigmoid(-rejected_r)
    return (losses, *sum_rewards(beta, pc, pr, rc, rr))


def robust_loss(pc, pr, rc, rr, ct, rt, *, beta: float, label_smoothing: float) -> LossOutput:
    """Robust DPO: Chowdhury, Kini, Natarajan (2024), arXiv:2403.00409, sec. 3 (the unbiased
    estimator of the clean loss when labels flip with probability eps = ``label_smoothing``):
    ((1 - eps) * -log sigma(z) - eps * -log sigma(-z)) / (1 - 2 eps), z = beta * margin.
    eps must lie in [0, 0.5); at 0 this is ``sigmoid``.

    Args: pc, pr, rc, rr ``(B,)``; ct, rt ``(B,)`` unused. Needs the reference.
    """
    chosen_lr, rejected_lr = logratios(pc, pr, rc, rr)
    z = beta * (chosen_lr - rejected_lr)
    eps = label_smoothing
    if not eps:  # sigmoid's loss, also at an infinite z (f-DPO), where 0 * logsigmoid(-inf) would be NaN
        return (-F.logsigmoid(z), *sum_rewards(beta, pc, pr, rc, rr))
    losses = (-(1 - eps) * F.logsigmoid(z) + eps * F.logsigmoid(-z)) / (1 - 2 * eps)
    return (losses, *sum_rewards(beta, pc, pr, rc, rr))


def bco_pair_loss(pc, pr, rc, rr, ct, rt, *, beta: float, bco_delta: float) -> LossOutput:
    """BCO (pairwise): Jung, Han, Nam, On (2024), arXiv:2404.04656, the BCO loss with reward
    shift delta, applied to paired data:
    -log sigma(r_w - delta) - log sigma(-(r_l - delta)), r = beta * log(pi/pi_ref).

    delta is the reward shift: TRL 0.x kept a running mean of the batch rewards in the trainer,
    TRL 1.x dropped it (delta = 0). To keep this function pure delta is the explicit param
    ``bco_delta`` (default 0, TRL 1.x); a trainer that wants the paper's shift passes its
    running mean of (chosen and rejected) rewards.

    Args: pc, pr, rc, rr ``(B,)``; ct, rt ``(B,)`` unused. Needs the reference.
    """
    chosen_r, rejected_r = logratios(pc, pr, rc, rr)
    chosen_r, rejected_r = beta * chosen_r, beta * rejected_r
    losses = -F.logsigmoid(chosen_r - bco_delta) - F.logsigmoid(-(rejected_r - bco_delta))
    return (losses, *sum_rewards(beta, pc, pr, rc, rr))


def sppo_hard_loss(pc, pr, rc, rr, ct, rt, *, beta: float) -> LossOutput:
    """SPPO, hard-label version: Wu, Sun, Yuan, Ji, Yang, Gu (2024), arXiv:2405.00675, eq. 4.7
    of Algorithm 1 with P(winner) = 1 and P(loser) = 0 (as in TRL):
    (log(pi/pi_ref)_w - 1/(2 beta))^2 + (log(pi/pi_ref)_l + 1/(2 beta))^2.

    Args: pc, pr, rc, rr ``(B,)``; ct, rt ``(B,)`` unused. Needs the reference.
    """
    chosen_lr, rejected_lr = logratios(pc, pr, rc, rr)
    losses = (chosen_lr - 0.5 / beta) ** 2 + (rejected_lr + 0.5 / beta) ** 2
    return (losses, *sum_rewards(beta, pc, pr, rc, rr))


def _aot_bce(sorted_delta: Tensor, beta: float, label_smoothing: float) -> Tensor:
    """The AOT objective on batch-sorted margins, ``(B,)``: a smoothed logistic loss."""
    return _smoothed_sigmoid(beta * sorted_delta, label_smoothing)


def aot_loss(pc, pr, rc, rr, ct, rt, *, beta: float, label_smoothing: float) -> LossOutput:
    """AOT (paired): Melnyk, Mroueh, Belgodere, Rigotti, Nitsure, Yurochkin, Greenewald,
    Navratil, Ross (2024), arXiv:2406.05882, sec. 3 (paired AOT): first-order stochastic dominance of the
    policy's over the reference's log-ratio distribution, via sorting over the batch.

    delta_(i) = sort(pc - pr)_(i) - sort(rc - rr)_(i); loss as ``sigmoid`` on delta.
    Entry i of ``losses`` belongs to the i-th quantile, not to example i (the mean is what
    counts); the function is still a pure function of the batch.

    Args: pc, pr, rc, rr ``(B,)``; ct, rt ``(B,)`` unused. Needs the reference.
    """
    policy_sorted, _ = torch.sort(pc - pr, dim=0)  # (B,)
    ref_sorted, _ = torch.sort(rc - rr, dim=0)  # (B,)
    losses = _aot_bce(policy_sorted - ref_sorted, beta, label_smoothing)
    return (losses, *sum_rewards(beta, pc, pr, rc, rr))


def aot_unpaired_loss(pc, pr, rc, rr, ct, rt, *, beta: float, label_smoothing: float) -> LossOutput:
    """AOT (unpaired): Melnyk et al. (2024), arXiv:2406.05882, sec. 3 (unpaired AOT): the chosen log-ratio
    distribution should dominate the rejected one; chosen and rejected are sorted separately.

    delta_(i) = sort(pc - rc)_(i) - sort(pr - rr)_(i); loss as ``sigmoid`` on delta.
    As in ``aot``, entry i of ``losses`` is a quantile, not example i.

    Args: pc, pr, rc, rr ``(B,)``; ct, rt ``(B,)`` unused. Needs the reference.
    """
    chosen_lr, rejected_lr = logratios(pc, pr, rc, rr)
    chosen_sorted, _ = torch.sort(chosen_lr, dim=0)  # (B,)
    rejected_sorted, _ = torch.sort(rejected_lr, dim=0)  # (B,)
    losses = _aot_bce(chosen_sorted - rejected_sorted, beta, label_smoothing)
    return (losses, *sum_rewards(beta, pc, pr, rc, rr))


def apo_zero_loss(pc, pr, rc, rr, ct, rt, *, beta: float) -> LossOutput:
    """APO-zero: D'Oosterlinck, Xu, Develder, Demeester, Singh, Potts, Kiela, Mehri (2024),
    arXiv:2408.06266, eq. 7: (1 - sigma(r_w)) + sigma(r_l), r = beta * log(pi/pi_ref).
    Raises chosen and lowers rejected likelihood; for chosen outputs better than the model's.

    Args: pc, pr, rc, rr ``(B,)``; ct, rt ``(B,)`` unused. Needs the reference.
    """
    chosen_lr, rejected_lr = logratios(pc, pr, rc, rr)
    losses = (1 - torch.sigmoid(beta * chosen_lr)) + torch.sigmoid(beta * rejected_lr)
    return (losses, *sum_rewards(beta, pc, pr, rc, rr))


def apo_down_loss(pc, pr, rc, rr, ct, rt, *, beta: float) -> LossOutput:
    """APO-down: D'Oosterlinck et al. (2024), arXiv:2408.06266, eq. 8:
    sigma(r_w) + (1 - sigma(r_w - r_l)). Lowers both likelihoods, rejected more; for chosen
    outputs worse than the model's.

    Args: pc, pr, rc, rr ``(B,)``; ct, rt ``(B,)`` unused. Needs the reference.
    """
    chosen_lr, rejected_lr = logratios(pc, pr, rc, rr)
    losses = torch.sigmoid(beta * chosen_lr) + (1 - torch.sigmoid(beta * (chosen_lr - rejected_lr)))
    return (losses, *sum_rewards(beta, pc, pr, rc, rr))


def discopop_loss(pc, pr, rc, rr, ct, rt, *, beta: float, discopop_tau: float) -> LossOutput:
    """DiscoPOP (log-ratio modulated loss): Chris Lu, Holt, Fanconi, Chan, Foerster, van der
    Schaar, Lange (2024), arXiv:2406.08414, eq. 5.

    With z = beta * margin and m = sigma(z / tau): loss = (1 - m) * -log sigma(z) + m * exp(-z).
    m * exp(-z) is evaluated as exp(-z + log sigma(z / tau)): the same number, but TRL's
    product overflows to inf * 0 = NaN once z < -88 in float32.

    Args: pc, pr, rc, rr ``(B,)``; ct, rt ``(B,)`` unused. Needs the reference.
    """
    chosen_lr, rejected_lr = logratios(pc, pr, rc, rr)
    z = beta * (chosen_lr - rejected_lr)
    logistic = -F.logsigmoid(z) * torch.sigmoid(-z / discopop_tau)  # (1 - m) = sigma(-z/tau)
    exponential = torch.exp(-z + F.logsigmoid(z / discopop_tau))
    return (logistic + exponential, *sum_rewards(beta, pc, pr, rc, rr))


def sigmoid_norm_loss(pc, pr, rc, rr, ct, rt, *, beta: float) -> LossOutput:
    """Length-normalised DPO, TRL 1.x ``sigmoid_norm`` (DPO eq. 7, Rafailov et al. 2023,
    arXiv:2305.18290, on per-token log-ratios as in SimPO, Meng et al. 2024, arXiv:2405.14734):
    -log sigma(beta * ((pc - rc)/ct - (pr - rr)/rt)).

    Same loss as ``dpo_norm``; the rewards differ: TRL logs sum rewards beta*(pc - rc) for
    every loss type, and this keeps that.

    Args: pc, pr, rc, rr ``(B,)``; ct, rt token counts ``(B,)``. Needs the reference.
    """
    chosen_lr, rejected_lr = logratios(pc, pr, rc, rr)
    losses = -F.logsigmoid(beta * (chosen_lr / ct - rejected_lr / rt))
    return (losses, *sum_rewards(beta, pc, pr, rc, rr))


def dpo_norm_loss(pc, pr, rc, rr, ct, rt, *, beta: float, label_smoothing: float) -> LossOutput:
    """open-instruct ``dpo_norm`` (length-normalised DPO of Tulu 3, Lambert et al. 2024, arXiv:2411.15124):
    DPO eq. 7 (arXiv:2305.18290) on length-normalised log-probs, i.e. every sum divided by
    its token count for policy and reference alike, with cDPO label smoothing.

    Rewards are on the normalised values: beta * (pc/ct - rc/ct), beta * (pr/rt - rr/rt).

    Args: pc, pr, rc, rr ``(B,)``; ct, rt token counts ``(B,)``. Needs the reference.
    """
    pc, pr, rc, rr = pc / ct, pr / rt, rc / ct, rr / rt
    chosen_lr, rejected_lr = logratios(pc, pr, rc, rr)
    losses = _smoothed_sigmoid(beta * (chosen_lr - rejected_lr), label_smoothing)
    return (losses, *sum_rewards(beta, pc, pr, rc, rr))


# ---------------------------------------------------------------------------------------------
# Reference-free losses: rc, rr are accepted (and ignored) so every loss has one signature.
# ---------------------------------------------------------------------------------------------


def simpo_loss(pc, pr, rc, rr, ct, rt, *, beta: float, gamma: float, label_smoothing: float) -> LossOutput:
    """SimPO: Meng, Xia, Chen (2024), arXiv:2405.14734, eq. 6:
    -log sigma(beta * pc/ct - beta * pr/rt - gamma), with cDPO label smoothing as the SimPO
    trainer has it.

    ``gamma`` is the absolute target reward margin (TRL ``CPOConfig.simpo_gamma``, default 0.5,
    with beta 0.1). The paper's own trainer takes gamma/beta instead (``gamma_beta_ratio``)
    and uses beta ~2.0-2.5 with gamma/beta ~0.5: pass beta=2.0, gamma=1.0 for that regime.
    Rewards: beta * average log-prob (SimPO eq. 4).

    Args: pc, pr ``(B,)``; rc, rr ignored (may be None); ct, rt token counts ``(B,)``.
    Reference-free.
    """
    logits = beta * (pc / ct) - beta * (pr / rt) - gamma
    losses = _smoothed_sigmoid(logits, label_smoothing)
    return (losses, *_avg_rewards(beta, pc, pr, ct, rt))


def _log1mexp(x: Tensor) -> Tensor:
    """log(1 - exp(x)) for x < 0, accurate at both ends (Maechler 2012, "Accurately computing
    log(1 - exp(-|a|))"): expm1 near 0, log1p far from it. ``(B,)`` in and out."""
    return torch.where(x > -math.log(2.0), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def orpo_loss(pc, pr, rc, rr, ct, rt, *, beta: float, orpo_alpha: float) -> LossOutput:
    """ORPO: Hong, Lee, Thorne (2024), arXiv:2403.07691, eqs. 4-7 (odds, odds ratio, L_ORPO, L_OR).

    With average log-probs a = sum/tokens, log odds(y) = a - log(1 - exp(a)):
    loss = NLL_chosen - lambda * log sigma(log odds(y_w) - log odds(y_l)), lambda =
    ``orpo_alpha`` (TRL ``ORPOConfig.beta``, default 0.1), NLL = -(pc / ct).
    ``beta`` here only scales the logged rewards beta * a (TRL uses one beta for both; at the
    defaults the two agree).

    Departures from TRL: the NLL is per example (mean over examples of each one's per-token
    mean) where TRL takes one token-weighted mean over the batch; the average log-prob fed to
    log(1 - exp(a)) is capped at -1e-6, where TRL returns a NaN gradient at a = 0.

    Args: pc, pr ``(B,)``; rc, rr ignored (may be None); ct, rt token counts ``(B,)``.
    Reference-free.
    """
    avg_c = (pc / ct).clamp(max=_ORPO_MAX_AVG_LOGP)
    avg_r = (pr / rt).clamp(max=_ORPO_MAX_AVG_LOGP)
    log_odds = (avg_c - avg_r) - (_log1mexp(avg_c) - _log1mexp(avg_r))  # log of eq. 5's odds ratio
    losses = nll(pc, ct) - orpo_alpha * F.logsigmoid(log_odds)  # eqs. 6-7
    return (losses, *_avg_rewards(beta, pc, pr, ct, rt))


def sft_loss(pc, pr, rc, rr, ct, rt, *, beta: float) -> LossOutput:
    """SFT on the chosen completion, TRL 1.x ``sft``: the generation loss L_gen of MPO (Wang,
    Chen, Wang, et al. 2024, arXiv:2411.10442, sec. 3, L = w_p L_p + w_q L_q + w_g L_gen),
    -(pc / ct), the mean per-token NLL of each chosen completion.

    TRL computes one token-weighted mean over the whole batch and repeats it per example; here
    each example has its own mean (the batch mean is then over examples). Rewards: beta *
    average log-prob, as for the other reference-free losses (TRL 1.x logs sum rewards
    against the reference, which a reference-free loss may not have).

    Args: pc, pr ``(B,)``; rc, rr ignored (may be None); ct, rt token counts ``(B,)``.
    Reference-free.
    """
    return (nll(pc, ct), *_avg_rewards(beta, pc, pr, ct, rt))


# ---------------------------------------------------------------------------------------------
# Options that apply on top of a loss (TRL 1.x DPOConfig names): f-divergence, LD-DPO, WPO
# ---------------------------------------------------------------------------------------------

F_DIVERGENCES = ("reverse_kl", "forward_kl", "js_divergence", "alpha_divergence")

# Losses built on the chosen-minus-rejected score difference, the only ones f-DPO generalises
# (TRL 1.16's list). ``sft`` is in TRL's list because it ignores the scores; it reads the raw sums.
F_DIVERGENCE_LOSSES = frozenset({"sigmoid", "sigmoid_norm", "hinge", "ipo", "exo_pair", "robust", "discopop", "sft"})

# exp() argument cap of the alpha-divergence score in float32 (TRL's value): exp(80) ~ 5.5e34 is finite.
_ALPHA_EXP_MAX = 80.0


def f_divergence_scores(logratios: Tensor, f_divergence_type: str, f_alpha_divergence_coef: float) -> Tensor:
    """f-DPO scores f'(u) of the policy/reference ratio u = exp(logratios), ``(B,)`` -> ``(B,)``.

    f-DPO: Wang, Jiang, Yang, Liu, Chen (2023), arXiv:2309.16240: under an f-divergence
    constraint the implicit reward is beta * f'(pi/pi_ref), so DPO's log-ratio difference
    becomes f'(u_w) - f'(u_l) (the paper's f-DPO loss, with f'(u) from its list of divergences):

    - ``reverse_kl``: f'(u) = log u + 1; the + 1 cancels in the difference, so the score is the
      log-ratio (plain DPO).
    - ``forward_kl``: f'(u) = 1 - 1/u = 1 - exp(-logratio).
    - ``js_divergence``: f'(u) = log(2u / (1 + u)) = log 2 + logsigmoid(logratio).
    - ``alpha_divergence``: the paper's f'(u) = (1 - u^-a)/a. TRL's ``f_alpha_divergence_coef``
      c is written (u^(c-1) - 1)/(c - 1), which is the paper's formula at a = 1 - c: the two
      coincide at the default 0.5 and differ in meaning elsewhere. This keeps TRL's name and
      meaning so a TRL config carries over; c = 1 is the log u limit (reverse KL), as in TRL.
      The exponent is capped at 80 before exp() as TRL does, so a large ratio gives a large
      finite score, not inf.
    """
    if f_divergence_type == "reverse_kl":
        return logratios
    if f_divergence_type == "forward_kl":
        # Below -log(float max) (-88.7 nats in float32) exp(-logratio) overflows: the score is -inf
        # as exp makes it, but its gradient is 0, not 0 * inf = NaN, so a rejected pushed that far
        # gives the saturated loss its limits (loss and gradient 0), not a NaN.
        overflow = -logratios > math.log(torch.finfo(logratios.dtype).max)
        return (1 - torch.exp(-logratios.masked_fill(overflow, 0.0))).masked_fill(overflow, -math.inf)
    if f_divergence_type == "js_divergence":
        return math.log(2) + F.logsigmoid(logratios)
    if f_divergence_type == "alpha_divergence":
        c = f_alpha_divergence_coef
        if abs(c - 1.0) < 1e-6:
            return logratios
        return (torch.exp(((c - 1.0) * logratios).clamp(max=_ALPHA_EXP_MAX)) - 1.0) / (c - 1.0)
    raise ValueError(f"f_divergence_type must be one of {', '.join(F_DIVERGENCES)}, got {f_divergence_type!r}")


def ld_sequence_logps(token_logps: Tensor, mask: Tensor, shared_lens: Tensor, ld_alpha: float) -> Tensor:
    """LD-DPO sequence log-prob: the first ``shared_len`` completion tokens count fully, the
    rest ("verbose" tokens) are weighted by ``ld_alpha``.

    LD-DPO: Liu, Yang, Huang, Li, Yu, Zhang, Liu, Xu (2024), arXiv:2409.06411, sec. 4: the
    log-likelihood of a response is split at the length l_p of the shorter response of the pair
    (its "public length") into log p(y[:l_p]) + alpha * log p(y[l_p:]). The same split is
    applied to policy and reference (as TRL 1.16 does), so with ld_alpha = 1 this is the plain sum.

    Args:
        token_logps: per-token log-probs ``(B, T)``; positions outside ``mask`` are ignored.
        mask: completion mask ``(B, T)``, 1 on completion tokens (left-aligned or not: the k-th
            completion token is the k-th 1 of the row).
        shared_lens: tokens that count fully per row, ``(B,)``.
        ld_alpha: weight of the tokens beyond ``shared_lens``, in [0, 1].

    Returns: ``(B,)``.
    """
    if not 0 <= ld_alpha <= 1:
        raise ValueError(f"ld_alpha must be in [0, 1], got {ld_alpha}")
    mask = mask.to(token_logps.dtype)
    position = mask.cumsum(dim=1)  # k on the k-th completion token, (B, T)
    shared = mask * (position <= shared_lens.unsqueeze(1)).to(token_logps.dtype)
    tail = mask - shared
    return (token_logps * shared).sum(dim=1) + ld_alpha * (token_logps * tail).sum(dim=1)


def ld_pair_logps(chosen_logps: Tensor, chosen_mask: Tensor, rejected_logps: Tensor, rejected_mask: Tensor,
                  ld_alpha: float) -> tuple[Tensor, Tensor]:
    """LD-DPO sums of a batch of pairs: the public length of pair i is min(chosen tokens,
    rejected tokens) of that pair (:func:`ld_sequence_logps`). Call it once for the policy and
    once for the reference with the same masks; the results go to :func:`preference_loss`.

    Args: per-token log-probs and completion masks, ``(B, Tc)`` and ``(B, Tr)``. Returns two ``(B,)``.
    """
    shared = torch.minimum(chosen_mask.sum(dim=1), rejected_mask.sum(dim=1))  # (B,)
    return (ld_sequence_logps(chosen_logps, chosen_mask, shared, ld_alpha),
            ld_sequence_logps(rejected_logps, rejected_mask, shared, ld_alpha))


def wpo_token_logps(logits: Tensor, labels: Tensor) -> Tensor:
    """WPO's aligned per-token log-prob log p(y_t) - log sum_v p(v)^2, ``(..., V)``, ``(...)`` -> ``(...)``.

    WPO: Zhou, Agrawal, Zhang, Gui, Lu, Wen, Yang, Wang, Bian, Jiang, Mo (2024),
    arXiv:2406.11827, eq. 2 with the "sampled alignment" of sec. 3.2: dividing each token's
    probability by sum_v p(v)^2 (the probability of the token the policy would sample itself)
    makes an on-policy response weigh ~1 whatever its entropy. Detached: the weights are not trained.
    """
    logp = F.log_softmax(logits.detach().float(), dim=-1)
    return logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(2 * logp, dim=-1)


def wpo_weights(chosen_aligned: Tensor, rejected_aligned: Tensor, ct: Tensor, rt: Tensor) -> Tensor:
    """WPO pair weight (arXiv:2406.11827, eq. 2): w = exp(mean aligned log-prob of chosen) *
    exp(mean aligned log-prob of rejected), each ``(B,)`` (sums of :func:`wpo_token_logps`
    over the completion), divided by the token counts ``ct``, ``rt``. ``(B,)``, detached.

    Same formula as TRL 1.16's ``use_weighting`` (which cites the same eq. 2): the weight
    multiplies each example's loss and carries no gradient, and is not clamped (TRL 1.16 does
    not clamp it either), so a policy surer of a token than of its own samples weighs above 1.
    In training the aligned sums come from the policy's head (:mod:`dpocache.losses.wpo`).
    """
    return torch.exp(chosen_aligned.detach() / ct + rejected_aligned.detach() / rt)
