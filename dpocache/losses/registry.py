"""The loss registry and the loss specs: ``LOSSES`` (name → formula of ``losses.formulas``, with
its defaults), ``LossSpec`` (one loss or a weighted sum, with the params they share) and
``preference_loss``, which validates, upcasts, applies the f-DPO and WPO options and combines.
A new variant is a new function in ``formulas`` and one line here.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

import torch
from torch import Tensor

from dpocache.losses.formulas import (
    DEFAULT_BETA,
    F_DIVERGENCE_LOSSES,
    F_DIVERGENCES,
    LossOutput,
    aot_loss,
    aot_unpaired_loss,
    apo_down_loss,
    apo_zero_loss,
    bco_pair_loss,
    discopop_loss,
    dpo_norm_loss,
    exo_pair_loss,
    f_divergence_scores,
    hinge_loss,
    ipo_loss,
    logratios,
    nca_pair_loss,
    nll,
    orpo_loss,
    robust_loss,
    sft_loss,
    sigmoid_loss,
    sigmoid_norm_loss,
    simpo_loss,
    sppo_hard_loss,
    sum_rewards,
    wpo_weights,
)

# ---------------------------------------------------------------------------------------------
# Registry
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LossFn:
    """A registry entry: the pure loss function, whether it reads the reference log-probs, and
    the params it takes with their defaults (the only place those defaults live).

    Calling the entry fills in the defaults: ``LOSSES["ipo"](pc, pr, rc, rr, ct, rt, beta=0.5)``.
    It does not validate or upcast; :func:`preference_loss` does.
    """

    fn: Callable[..., LossOutput]
    needs_reference: bool
    defaults: Mapping[str, float]

    def __call__(self, pc, pr, rc, rr, ct, rt, **params: float) -> LossOutput:
        return self.fn(pc, pr, rc, rr, ct, rt, **{**self.defaults, **params})


def _ref(fn: Callable[..., LossOutput], **defaults: float) -> LossFn:
    return LossFn(fn, needs_reference=True, defaults=MappingProxyType({"beta": DEFAULT_BETA, **defaults}))


def _free(fn: Callable[..., LossOutput], **defaults: float) -> LossFn:
    return LossFn(fn, needs_reference=False, defaults=MappingProxyType({"beta": DEFAULT_BETA, **defaults}))


LOSSES: Mapping[str, LossFn] = MappingProxyType(
    {
        "sigmoid": _ref(sigmoid_loss, label_smoothing=0.0),
        "hinge": _ref(hinge_loss),
        "ipo": _ref(ipo_loss),
        "exo_pair": _ref(exo_pair_loss, label_smoothing=1e-3),
        "nca_pair": _ref(nca_pair_loss),
        "robust": _ref(robust_loss, label_smoothing=0.0),
        "bco_pair": _ref(bco_pair_loss, bco_delta=0.0),
        "sppo_hard": _ref(sppo_hard_loss),
        "aot": _ref(aot_loss, label_smoothing=0.0),
        "aot_unpaired": _ref(aot_unpaired_loss, label_smoothing=0.0),
        "apo_zero": _ref(apo_zero_loss),
        "apo_down": _ref(apo_down_loss),
        "discopop": _ref(discopop_loss, discopop_tau=0.05),
        "sigmoid_norm": _ref(sigmoid_norm_loss),
        "dpo_norm": _ref(dpo_norm_loss, label_smoothing=0.0),
        "simpo": _free(simpo_loss, gamma=0.5, label_smoothing=0.0),
        "orpo": _free(orpo_loss, orpo_alpha=0.1),
        "sft": _free(sft_loss),
    }
)

# Params that apply on top of any loss, with their defaults. rpo_alpha: RPO, Pang, Yuan, Cho,
# He, Sukhbaatar, Weston (2024), arXiv:2404.19733, sec. 2 (the DPO+NLL loss): + alpha * the
# length-normalised NLL of the chosen. The paper weights the DPO term instead; TRL 0.x (and
# this) weight the NLL term, so rpo_alpha = 1/paper_alpha up to the overall scale.
#
# f_divergence_type / f_alpha_divergence_coef: f-DPO (:func:`f_divergence_scores`). ld_alpha: LD-DPO; the
# caller combines per-token values with :func:`ld_pair_logps` before calling preference_loss
# (this module sees sums only). use_weighting: WPO; the caller passes the aligned sums
# (:func:`wpo_token_logps`, or in training dpocache.losses.wpo); the weight multiplies the weighted sum
# of the spec's losses (TRL weights each loss type's term: the same, the weights being linear),
# not rpo_alpha's NLL term, which TRL 1.16 does not have. Defaults as TRL 1.16's DPOConfig.
GLOBAL_DEFAULTS: Mapping[str, float | str | bool | None] = MappingProxyType(
    {
        "rpo_alpha": None,
        "f_divergence_type": "reverse_kl",
        "f_alpha_divergence_coef": 0.5,
        "ld_alpha": None,
        "use_weighting": False,
    }
)


def _known_params() -> list[str]:
    names = {p for entry in LOSSES.values() for p in entry.defaults} | set(GLOBAL_DEFAULTS)
    return sorted(names)


# ---------------------------------------------------------------------------------------------
# Loss specs: one loss or a weighted sum of several
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LossSpec:
    """A weighted sum of registry losses plus the params they share.

    ``terms`` is ``((name, weight), ...)``; ``params`` maps param name to value, and a loss reads
    the ones it declares (unset ones take that loss's default). ``str(spec)`` gives the
    canonical spec string, e.g. ``"sigmoid:1,sft:0.5"``.
    """

    terms: tuple[tuple[str, float], ...]
    params: Mapping[str, float | None] = field(default_factory=dict)

    def __str__(self) -> str:
        return ",".join(f"{name}:{weight:g}" for name, weight in self.terms)

    @property
    def needs_reference(self) -> bool:
        # A term of weight 0 contributes nothing, so it must not cost a reference pass.
        return any(LOSSES[name].needs_reference for name, weight in self.terms if weight > 0)


# Names users type for a method whose loss goes by another name here (TRL's ``loss_type``).
METHOD_NAMES = {"dpo": ("sigmoid", "DPO's loss, TRL's name for it")}
# Methods of the field that dpocache does not offer, and why.
NOT_OFFERED = {"kto": "KTO trains on unpaired completions, each labelled good or bad, and dpocache's losses take "
                      "preference pairs (TRL's KTOTrainer runs it); for pairs, bco_pair is BCO's paired form"}


def _check_name(name: str) -> str:
    if name not in LOSSES:
        if str(name).lower() in NOT_OFFERED:
            raise ValueError(f"loss {name!r} is not offered: {NOT_OFFERED[str(name).lower()]}")
        meant = METHOD_NAMES.get(str(name).lower())
        if meant is None:
            close = difflib.get_close_matches(str(name).lower().replace("-", "_"), LOSSES, n=1, cutoff=0.75)
            meant = (close[0], None) if close else None
        hint = f"did you mean {meant[0]!r}{f' ({meant[1]})' if meant[1] else ''}? " if meant else ""
        raise ValueError(f"unknown loss {name!r}; {hint}known losses: {', '.join(LOSSES)}")
    return name


def _check_weight(name: str, weight: float) -> float:
    weight = float(weight)
    # A negative weight turns minimisation into maximisation: almost surely a typo.
    if not math.isfinite(weight) or weight < 0:
        raise ValueError(f"loss weight for {name!r} must be a finite number >= 0, got {weight}")
    return weight


def _parse_string(spec: str) -> list[tuple[str, float]]:
    """``"sigmoid"``, ``"sigmoid,sft"`` or ``"sigmoid:1.0,sft:0.5"`` -> [(name, weight), ...]."""
    terms = []
    for part in spec.split(","):
        name, sep, weight = part.strip().partition(":")
        if not name.strip():
            raise ValueError(f"empty loss name in loss spec {spec!r}")
        try:
            value = float(weight) if sep else 1.0
        except ValueError:
            raise ValueError(f"loss weight {weight!r} in loss spec {spec!r} is not a number") from None
        terms.append((name.strip(), value))
    return terms


def _check_params(params: Mapping[str, float | None]) -> None:
    unknown = sorted(set(params) - set(_known_params()))
    if unknown:
        raise ValueError(f"unknown loss param(s) {unknown}; known params: {', '.join(_known_params())}")


def parse_loss_spec(
    spec: str | Sequence[str] | Sequence[tuple[str, float]] | LossSpec,
    weights: Sequence[float] | None = None,
    **params: float | None,
) -> LossSpec:
    """Build a :class:`LossSpec` from any of the accepted forms.

    Args:
        spec: a loss name (``"sigmoid"``), a spec string (``"sigmoid:1.0,sft:0.5"``; a missing
            weight is 1), a list of names (``["sigmoid", "sft"]``, weights from ``weights``),
            a list of ``(name, weight)`` pairs, or a ``LossSpec`` (its params are kept;
            ``params`` given here override them).
        weights: one weight per name when ``spec`` is a list of names; default all 1.
        **params: loss params (``beta``, ``label_smoothing``, ...); None means the default.

    Raises:
        ValueError: unknown loss or param, a repeated loss, a bad or mismatched weight.
    """
    if isinstance(spec, LossSpec):
        if weights is not None:
            raise ValueError("weights cannot be given with a LossSpec; it already has its weights")
        terms, params = list(spec.terms), {**spec.params, **params}
    elif isinstance(spec, str):
        terms = _parse_string(spec)
        if weights is not None:
            if any(":" in part for part in spec.split(",")):
                raise ValueError(f"loss spec {spec!r} has weights already; do not also pass weights")
            terms = _zip_weights([name for name, _ in terms], weights)
    else:
        items = list(spec)
        if items and all(isinstance(item, str) for item in items):
            terms = _zip_weights(items, weights) if weights is not None else [(n, 1.0) for n in items]
        elif items and all(isinstance(item, (tuple, list)) and len(item) == 2 for item in items):
            if weights is not None:
                raise ValueError("weights cannot be given with (name, weight) pairs")
            terms = [(str(name), weight) for name, weight in items]
        else:
            raise ValueError(f"loss spec must be a name, a spec string or a non-empty list, got {spec!r}")
    terms = [(_check_name(name), _check_weight(name, weight)) for name, weight in terms]
    names = [name for name, _ in terms]
    if len(set(names)) != len(names):
        raise ValueError(f"loss spec repeats a loss: {names}; give each loss once with its weight")
    _check_params(params)
    # None means "this loss's default", so a config can leave a param unset without knowing
    # each loss's default (exo_pair's label_smoothing is 1e-3, the others' 0).
    params = {k: v for k, v in params.items() if v is not None}
    return LossSpec(tuple(terms), MappingProxyType(params))


def _zip_weights(names: list[str], weights: Sequence[float]) -> list[tuple[str, float]]:
    weights = list(weights)
    if len(weights) != len(names):
        raise ValueError(f"{len(weights)} weights given for {len(names)} losses {names}")
    return list(zip(names, weights))


def needs_reference(name_or_spec: str | Sequence[str] | LossSpec) -> bool:
    """True when the loss (or any loss of the spec of weight > 0) reads reference log-probs."""
    return parse_loss_spec(name_or_spec).needs_reference


# ---------------------------------------------------------------------------------------------
# The entry point
# ---------------------------------------------------------------------------------------------


def check_loss_values(spec: LossSpec) -> None:
    """Reject param values the formulas cannot take, naming the loss."""
    if not any(weight > 0 for _, weight in spec.terms):  # "sigmoid:0": a loss of 0 at every step, nothing trains
        raise ValueError(f"{spec}: every term's weight is 0 or less; a term needs a weight > 0")
    for name, _ in spec.terms:
        p = {**LOSSES[name].defaults, **{k: v for k, v in spec.params.items() if k in LOSSES[name].defaults}}
        # An inf or NaN param (beta, gamma, orpo_alpha, bco_delta, ...) makes every loss NaN or
        # inf: refused here, not at the first step after the model and the reference pass.
        for key, value in p.items():
            if not math.isfinite(value):
                raise ValueError(f"{name}: {key} must be a finite number, got {value}")
        # IPO, SPPO and the SimPO ratio divide by beta; a non-positive beta flips every loss.
        if not p["beta"] > 0:
            raise ValueError(f"{name}: beta must be > 0, got {p['beta']}")
        # orpo_alpha weighs the odds-ratio term: a negative one maximises it (as a negative loss weight would).
        if name == "orpo" and not p["orpo_alpha"] >= 0:
            raise ValueError(f"orpo: orpo_alpha (the paper's lambda) must be >= 0, got {p['orpo_alpha']}")
        eps = p.get("label_smoothing")
        if name == "exo_pair" and not 0 < eps < 1:
            raise ValueError(f"exo_pair: label_smoothing (the paper's epsilon) must be in (0, 1), got {eps}")
        if name == "robust" and not 0 <= eps < 0.5:
            raise ValueError(f"robust: label_smoothing (the flip rate) must be in [0, 0.5), got {eps}")
        if eps is not None and name not in ("exo_pair", "robust") and not 0 <= eps <= 0.5:
            raise ValueError(f"{name}: label_smoothing must be in [0, 0.5], got {eps}")
        if name == "discopop" and not p["discopop_tau"] > 0:
            raise ValueError(f"discopop: discopop_tau must be > 0, got {p['discopop_tau']}")
    rpo_alpha = spec.params.get("rpo_alpha", GLOBAL_DEFAULTS["rpo_alpha"])
    if rpo_alpha is not None and not (math.isfinite(rpo_alpha) and rpo_alpha >= 0):
        raise ValueError(f"rpo_alpha must be None or a finite number >= 0, got {rpo_alpha}")
    _check_options(spec)


def check_params_read(spec: LossSpec) -> None:
    """Refuse a param that no loss of ``spec`` reads (``gamma`` with ``sigmoid``), naming the
    losses that do. For a run's config, where a param set and silently ignored would still be
    recorded as the run's; :func:`preference_loss` itself ignores such params, so one params
    dict can drive a sweep over losses."""
    names = [name for name, _ in spec.terms]
    read = {p for name in names for p in LOSSES[name].defaults} | set(GLOBAL_DEFAULTS)
    for key in sorted(set(spec.params) - read):
        readers = ", ".join(name for name, entry in LOSSES.items() if key in entry.defaults)
        unread = (f"the loss {names[0]!r} does not read it" if len(names) == 1
                  else f"none of the losses {', '.join(names)} reads it")
        raise ValueError(f"{key}={spec.params[key]} is set, but {unread} ({key} is a param of "
                         f"{readers}): remove it (--loss.{key} none on the command line, over a config file's), "
                         "or use one of those losses")
    coef = _option(spec, "f_alpha_divergence_coef")
    if _option(spec, "f_divergence_type") != "alpha_divergence" and coef != GLOBAL_DEFAULTS["f_alpha_divergence_coef"]:
        raise ValueError(f"f_alpha_divergence_coef={coef} is set, but f_divergence_type is "
                         f"{_option(spec, 'f_divergence_type')!r}; it applies only to 'alpha_divergence'")


def _option(spec: LossSpec, key: str):
    return spec.params.get(key, GLOBAL_DEFAULTS[key])


def _check_options(spec: LossSpec) -> None:
    """f-DPO, LD-DPO and WPO values, with TRL 1.16's restrictions on which losses take them."""
    names = [name for name, _ in spec.terms]
    f_type = _option(spec, "f_divergence_type")
    if f_type not in F_DIVERGENCES:
        raise ValueError(f"f_divergence_type must be one of {', '.join(F_DIVERGENCES)}, got {f_type!r}")
    if f_type != "reverse_kl" and not set(names) <= F_DIVERGENCE_LOSSES:
        raise ValueError(f"f_divergence_type={f_type!r} applies only to the losses "
                         f"{', '.join(sorted(F_DIVERGENCE_LOSSES))}; got {', '.join(names)}")
    coef = _option(spec, "f_alpha_divergence_coef")
    if not math.isfinite(coef):
        raise ValueError(f"f_alpha_divergence_coef must be a finite number, got {coef}")
    ld_alpha = _option(spec, "ld_alpha")
    if ld_alpha is not None and not 0 <= ld_alpha <= 1:
        raise ValueError(f"ld_alpha must be None or in [0, 1], got {ld_alpha}")
    # The aot losses sort over the batch: entry i is a quantile, not pair i, so a per-pair weight has no target.
    if _option(spec, "use_weighting") and set(names) & {"aot", "aot_unpaired"}:
        raise ValueError("use_weighting (WPO) does not apply to aot or aot_unpaired: their losses are batch quantiles")


def _prepare(spec: LossSpec, tensors: dict[str, Tensor | None],
             shape_checked: Mapping[str, Tensor] | None = None) -> list[Tensor | None]:
    """Check shapes and reference presence; upcast to at least float32; clamp counts to >= 1.
    Returns the tensors in the order given (the loss functions' argument order).
    ``shape_checked``: further inputs that must be ``(B,)`` too (WPO's sums), not returned.

    Upcast because a bf16 sum of ~300 log-probs has a resolution of 2 nats: the policy-minus-
    reference differences the losses are made of would be noise. Token counts are clamped at 1
    (as TRL does) so an empty completion divides by 1, not 0.
    """
    if spec.needs_reference and (tensors["ref_chosen"] is None or tensors["ref_rejected"] is None):
        needing = [name for name, weight in spec.terms if weight > 0 and LOSSES[name].needs_reference]
        raise ValueError(
            f"loss {', '.join(needing)} needs reference log-probs, but ref_chosen/ref_rejected is None; "
            f"reference-free losses: {', '.join(n for n, e in LOSSES.items() if not e.needs_reference)}"
        )
    present = {k: v for k, v in {**tensors, **(shape_checked or {})}.items() if v is not None}
    for key, value in present.items():
        if not isinstance(value, Tensor) or value.dim() != 1:
            shape = getattr(value, "shape", type(value).__name__)
            raise ValueError(f"{key} must be a 1-D tensor of shape (B,), got {shape}")
    sizes = {key: value.shape[0] for key, value in present.items()}
    if len(set(sizes.values())) != 1:
        raise ValueError(f"all inputs must have the same batch size B, got {sizes}")
    device = tensors["policy_chosen"].device
    elsewhere = {key: str(value.device) for key, value in present.items() if value.device != device}
    if elsewhere:  # torch's own error names no argument (the cache's lookup gives its values on the CPU)
        raise ValueError(f"all inputs must be on the policy's device ({device}), got {elsewhere}: move them there "
                         "(PairValues.to(device) for values from the cache)")
    dtype = torch.promote_types(tensors["policy_chosen"].dtype, torch.float32)
    out = {k: v.to(dtype) if v is not None else None for k, v in tensors.items()}
    for key in ("chosen_tokens", "rejected_tokens"):
        out[key] = out[key].clamp(min=1.0)
    return list(out.values())


def preference_loss(
    name: str | Sequence[str] | LossSpec,
    policy_chosen: Tensor,
    policy_rejected: Tensor,
    ref_chosen: Tensor | None,
    ref_rejected: Tensor | None,
    chosen_tokens: Tensor,
    rejected_tokens: Tensor,
    *,
    chosen_wpo_logps: Tensor | None = None,
    rejected_wpo_logps: Tensor | None = None,
    **params: float | str | bool | None,
) -> LossOutput:
    """Per-example preference losses and detached rewards for one batch.

    Args:
        name: a loss name (``"sigmoid"``), a spec string (``"sigmoid:1,sft:0.5"``), a list of
            names, or a :class:`LossSpec`. A spec gives the weighted sum of its losses; a
            term of weight 0 is not computed (nor does it need the reference).
        policy_chosen: policy summed completion log-probs of the chosen responses, ``(B,)``.
        policy_rejected: same for the rejected responses, ``(B,)``.
        ref_chosen: reference summed log-probs of chosen, ``(B,)``; None allowed only when
            every loss of the spec of weight > 0 is reference-free.
        ref_rejected: same for rejected, ``(B,)`` or None.
        chosen_tokens: completion token counts of chosen, ``(B,)``, int or float.
        rejected_tokens: completion token counts of rejected, ``(B,)``, int or float.
        **params: ``beta``, ``label_smoothing``, ``gamma`` (SimPO), ``orpo_alpha``,
            ``discopop_tau``, ``bco_delta``, ``rpo_alpha`` (adds rpo_alpha * -(pc/ct) to
            every example's loss, RPO arXiv:2404.19733). Each loss reads the ones it declares
            in :data:`LOSSES`; an unset (or None) one takes that loss's default. Params known
            to the registry but read by no loss of the spec are accepted and ignored, so one
            config can drive any loss. On top of any loss: ``f_divergence_type`` and
            ``f_alpha_divergence_coef`` (f-DPO), ``use_weighting`` (WPO, needs the two
            ``*_wpo_logps``) and ``ld_alpha`` (LD-DPO: validated here, applied by the caller to
            the policy and reference sums with :func:`ld_pair_logps`).
        chosen_wpo_logps, rejected_wpo_logps: ``(B,)`` sums over the completion of
            :func:`wpo_token_logps` of the policy; read only with ``use_weighting``.

    Returns:
        ``(losses, chosen_rewards, rejected_rewards)``, each ``(B,)`` in float32 (float64 if the
        inputs are): losses differentiable w.r.t. the policy inputs; rewards detached, those of
        the first loss in the spec of weight > 0.

    Raises:
        ValueError: unknown loss or param, bad param value, missing reference, bad shapes.
    """
    spec = parse_loss_spec(name, **params)
    check_loss_values(spec)
    wpo = {}
    if _option(spec, "use_weighting"):
        if chosen_wpo_logps is None or rejected_wpo_logps is None:
            raise ValueError("use_weighting (WPO) needs chosen_wpo_logps and rejected_wpo_logps, got None")
        # shape-checked with the rest: a (1,) or (B, 1) weight would broadcast, not fail
        wpo = {"chosen_wpo_logps": chosen_wpo_logps, "rejected_wpo_logps": rejected_wpo_logps}
    args = _prepare(
        spec,
        {
            "policy_chosen": policy_chosen,
            "policy_rejected": policy_rejected,
            "ref_chosen": ref_chosen,
            "ref_rejected": ref_rejected,
            "chosen_tokens": chosen_tokens,
            "rejected_tokens": rejected_tokens,
        },
        shape_checked=wpo,
    )
    pc, _, _, _, ct, rt = args
    scored = _f_divergence_args(spec, args)
    total, rewards = None, None
    for loss_name, weight in spec.terms:
        if weight == 0:  # not computed: it adds nothing, and its reference may not have been loaded
            continue
        entry = LOSSES[loss_name]
        own = {k: v for k, v in spec.params.items() if k in entry.defaults}
        f_scored = scored is not None and loss_name != "sft"  # sft reads the raw chosen sum
        losses, chosen_r, rejected_r = entry(*(scored if f_scored else args), **own)
        if f_scored:  # rewards stay beta * log(pi/pi_ref), as TRL logs them under every divergence
            chosen_r, rejected_r = sum_rewards({**entry.defaults, **own}["beta"], *args[:4])
        total = weight * losses if total is None else total + weight * losses
        if rewards is None:  # rewards are those of the first computed loss of the spec
            rewards = (chosen_r, rejected_r)
    if wpo:
        total = total * wpo_weights(chosen_wpo_logps.to(total.dtype), rejected_wpo_logps.to(total.dtype), ct, rt)
    rpo_alpha = spec.params.get("rpo_alpha", GLOBAL_DEFAULTS["rpo_alpha"])
    if rpo_alpha is not None:
        total = total + rpo_alpha * nll(pc, ct)  # RPO's DPO+NLL loss
    return total, rewards[0], rewards[1]


def _f_divergence_args(spec: LossSpec, args: list[Tensor | None]) -> list[Tensor | None] | None:
    """The loss arguments with the log-ratios replaced by f-DPO scores, or None under reverse KL.

    Passing (score_w, score_l, 0, 0) lets every loss function stay the formula on log-ratios:
    each one's log-ratio is then the score, as in TRL's ``delta_score``; ``ipo`` and
    ``sigmoid_norm`` divide the scores by the token counts, as TRL does.
    """
    f_type = _option(spec, "f_divergence_type")
    if f_type == "reverse_kl":
        return None
    pc, pr, rc, rr, ct, rt = args
    coef = _option(spec, "f_alpha_divergence_coef")
    chosen, rejected = (f_divergence_scores(lr, f_type, coef) for lr in logratios(pc, pr, rc, rr))
    return [chosen, rejected, torch.zeros_like(chosen), torch.zeros_like(rejected), ct, rt]
