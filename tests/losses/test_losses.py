"""Tests for dpocache.losses.formulas.

Hand-worked tests recompute every expected value with scalar `math` (never the torch formula
under test) on one B=2 batch; property tests run every loss at the shapes production passes
(B=64, float32 and bfloat16).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from dpocache.losses.registry import LOSSES, LossSpec, needs_reference, parse_loss_spec, preference_loss

TOL = 1e-6
BETA = 0.1  # the documented default

# One B=2 batch, float64 so the comparison measures the formula, not float32 rounding.
PC = [-10.0, -20.0]  # policy chosen sums
PR = [-12.0, -18.0]  # policy rejected sums
RC = [-11.0, -19.0]  # reference chosen sums
RR = [-11.5, -19.5]  # reference rejected sums
CT = [5, 8]  # chosen token counts
RT = [4, 10]  # rejected token counts
# Derived by hand: chosen logratio [1.0, -1.0], rejected logratio [-0.5, 1.5], margin [1.5, -2.5].


def _t(values, dtype=torch.float64, grad=False):
    return torch.tensor(values, dtype=dtype, requires_grad=grad)


def _batch():
    return _t(PC, grad=True), _t(PR, grad=True), _t(RC), _t(RR), torch.tensor(CT), torch.tensor(RT)


def _run(name, **params):
    return preference_loss(name, *_batch(), **params)


def sig(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def logsig(x: float) -> float:
    # log sigma(x) = -log(1 + e^-x), written for the moderate |x| of these tests
    return -math.log1p(math.exp(-x))


def _close(tensor, expected):
    assert tensor.shape == (len(expected),)
    for got, want in zip(tensor.tolist(), expected):
        assert abs(got - want) < TOL, (tensor.tolist(), expected)


def _sum_rewards(beta=BETA):
    return [beta * (PC[i] - RC[i]) for i in range(2)], [beta * (PR[i] - RR[i]) for i in range(2)]


def _avg_rewards(beta=BETA):
    return [beta * PC[i] / CT[i] for i in range(2)], [beta * PR[i] / RT[i] for i in range(2)]


def _margin(i):
    return (PC[i] - RC[i]) - (PR[i] - RR[i])


# ---------------------------------------------------------------------------------------------
# Hand-worked numbers, one test per loss
# ---------------------------------------------------------------------------------------------


def test_sigmoid_hand_worked():
    # margins 1.5 and -2.5
    losses, cr, rr = _run("sigmoid")
    _close(losses, [-logsig(0.1 * 1.5), -logsig(0.1 * -2.5)])
    _close(cr, [0.1, -0.1])
    _close(rr, [-0.05, 0.15])


def test_sigmoid_label_smoothing_hand_worked():
    losses, _, _ = _run("sigmoid", label_smoothing=0.2, beta=0.5)
    expected = [-0.8 * logsig(0.5 * m) - 0.2 * logsig(-0.5 * m) for m in (1.5, -2.5)]
    _close(losses, expected)


def test_hinge_hand_worked():
    losses, cr, rr = _run("hinge", beta=1.0)
    # relu(1 - 1.5) = 0 ; relu(1 + 2.5) = 3.5
    _close(losses, [0.0, 3.5])
    _close(cr, _sum_rewards(1.0)[0])
    _close(rr, _sum_rewards(1.0)[1])


def test_ipo_hand_worked():
    # per-token logratios: chosen 1/5, -1/8 ; rejected -0.5/4, 1.5/10
    h = [1 / 5 - (-0.5 / 4), -1 / 8 - 1.5 / 10]
    losses, cr, _ = _run("ipo")
    _close(losses, [(x - 1 / (2 * 0.1)) ** 2 for x in h])
    _close(cr, _sum_rewards()[0])


def test_exo_pair_hand_worked():
    eps = 1e-3  # the default
    expected = []
    for m in (1.5, -2.5):
        z = 0.1 * m
        expected.append(sig(z) * (logsig(z) - math.log(1 - eps)) + sig(-z) * (logsig(-z) - math.log(eps)))
    losses, _, _ = _run("exo_pair")
    _close(losses, expected)
    losses, _, _ = _run("exo_pair", label_smoothing=0.1)
    z = 0.15
    _close(losses[:1], [sig(z) * (logsig(z) - math.log(0.9)) + sig(-z) * (logsig(-z) - math.log(0.1))])


def test_nca_pair_hand_worked():
    expected = []
    for i in range(2):
        rw, rl = 0.1 * (PC[i] - RC[i]), 0.1 * (PR[i] - RR[i])
        expected.append(-logsig(rw) - 0.5 * logsig(-rw) - 0.5 * logsig(-rl))
    losses, _, _ = _run("nca_pair")
    _close(losses, expected)


def test_robust_hand_worked():
    eps = 0.1
    expected = [(-(1 - eps) * logsig(0.1 * m) + eps * logsig(-0.1 * m)) / (1 - 2 * eps) for m in (1.5, -2.5)]
    losses, _, _ = _run("robust", label_smoothing=eps)
    _close(losses, expected)
    # eps = 0 is plain DPO
    _close(_run("robust")[0], [-logsig(0.15), -logsig(-0.25)])


def test_bco_pair_hand_worked():
    for delta in (0.0, 0.03):
        expected = []
        for i in range(2):
            rw, rl = 0.1 * (PC[i] - RC[i]), 0.1 * (PR[i] - RR[i])
            expected.append(-logsig(rw - delta) - logsig(-(rl - delta)))
        _close(_run("bco_pair", bco_delta=delta)[0], expected)


def test_sppo_hard_hand_worked():
    # (a - 5)^2 + (b + 5)^2 with a = [1, -1], b = [-0.5, 1.5]
    _close(_run("sppo_hard")[0], [(1 - 5) ** 2 + (-0.5 + 5) ** 2, (-1 - 5) ** 2 + (1.5 + 5) ** 2])


def test_aot_hand_worked():
    # policy pc - pr = [2, -2] -> sorted [-2, 2]; ref rc - rr = [0.5, 0.5] -> sorted [0.5, 0.5]
    delta = [-2.5, 1.5]
    losses, cr, _ = _run("aot")
    _close(losses, [-logsig(0.1 * d) for d in delta])
    _close(cr, _sum_rewards()[0])  # rewards stay per example, unsorted
    ls = 0.1
    _close(_run("aot", label_smoothing=ls)[0], [-(1 - ls) * logsig(0.1 * d) - ls * logsig(-0.1 * d) for d in delta])


def test_aot_unpaired_hand_worked():
    # chosen logratios [1, -1] -> [-1, 1]; rejected [-0.5, 1.5] -> [-0.5, 1.5]
    delta = [-1 - (-0.5), 1 - 1.5]
    _close(_run("aot_unpaired")[0], [-logsig(0.1 * d) for d in delta])


def test_apo_zero_hand_worked():
    expected = [(1 - sig(0.1 * (PC[i] - RC[i]))) + sig(0.1 * (PR[i] - RR[i])) for i in range(2)]
    _close(_run("apo_zero")[0], expected)


def test_apo_down_hand_worked():
    expected = [sig(0.1 * (PC[i] - RC[i])) + (1 - sig(0.1 * _margin(i))) for i in range(2)]
    _close(_run("apo_down")[0], expected)


def test_discopop_hand_worked():
    for tau in (0.05, 1.0):
        expected = []
        for m in (1.5, -2.5):
            z = 0.1 * m
            mod = sig(z / tau)
            expected.append(-logsig(z) * (1 - mod) + math.exp(-z) * mod)
        kwargs = {} if tau == 0.05 else {"discopop_tau": tau}
        _close(_run("discopop", **kwargs)[0], expected)


def test_sigmoid_norm_hand_worked():
    h = [(PC[i] - RC[i]) / CT[i] - (PR[i] - RR[i]) / RT[i] for i in range(2)]
    losses, cr, rr = _run("sigmoid_norm", beta=2.0)
    _close(losses, [-logsig(2.0 * x) for x in h])
    _close(cr, _sum_rewards(2.0)[0])  # TRL logs sum rewards
    _close(rr, _sum_rewards(2.0)[1])


def test_dpo_norm_hand_worked():
    h = [(PC[i] / CT[i] - PR[i] / RT[i]) - (RC[i] / CT[i] - RR[i] / RT[i]) for i in range(2)]
    losses, cr, rr = _run("dpo_norm", beta=2.0)
    _close(losses, [-logsig(2.0 * x) for x in h])
    _close(cr, [2.0 * (PC[i] / CT[i] - RC[i] / CT[i]) for i in range(2)])
    _close(rr, [2.0 * (PR[i] / RT[i] - RR[i] / RT[i]) for i in range(2)])
    ls = 0.1
    _close(_run("dpo_norm", beta=2.0, label_smoothing=ls)[0],
           [-(1 - ls) * logsig(2 * x) - ls * logsig(-2 * x) for x in h])


def test_simpo_hand_worked():
    # avg logps: chosen [-2, -2.5], rejected [-3, -1.8]
    logits = [0.1 * (-2) - 0.1 * (-3) - 0.5, 0.1 * (-2.5) - 0.1 * (-1.8) - 0.5]
    losses, cr, rr = preference_loss("simpo", _t(PC), _t(PR), None, None, torch.tensor(CT), torch.tensor(RT))
    _close(losses, [-logsig(x) for x in logits])
    _close(cr, _avg_rewards()[0])
    _close(rr, _avg_rewards()[1])
    # paper regime with label smoothing
    logits = [2.0 * (-2) - 2.0 * (-3) - 1.0, 2.0 * (-2.5) - 2.0 * (-1.8) - 1.0]
    got = _run("simpo", beta=2.0, gamma=1.0, label_smoothing=0.1)[0]
    _close(got, [-0.9 * logsig(x) - 0.1 * logsig(-x) for x in logits])


def test_orpo_hand_worked():
    expected = []
    for i in range(2):
        a_c, a_r = PC[i] / CT[i], PR[i] / RT[i]
        log_odds = (a_c - a_r) - (math.log(1 - math.exp(a_c)) - math.log(1 - math.exp(a_r)))
        expected.append(-a_c - 0.1 * logsig(log_odds))
    losses, cr, _ = preference_loss("orpo", _t(PC), _t(PR), None, None, torch.tensor(CT), torch.tensor(RT))
    _close(losses, expected)
    _close(cr, _avg_rewards()[0])
    # orpo_alpha is lambda; beta only scales rewards
    a_c, a_r = -2.0, -3.0
    log_odds = (a_c - a_r) - (math.log(1 - math.exp(a_c)) - math.log(1 - math.exp(a_r)))
    losses, cr, _ = _run("orpo", orpo_alpha=0.5, beta=1.0)
    _close(losses[:1], [-a_c - 0.5 * logsig(log_odds)])
    _close(cr, _avg_rewards(1.0)[0])


def test_sft_hand_worked():
    losses, cr, _ = preference_loss("sft", _t(PC), _t(PR), None, None, torch.tensor(CT), torch.tensor(RT))
    _close(losses, [10 / 5, 20 / 8])
    _close(cr, _avg_rewards()[0])


def test_every_registered_loss_has_a_hand_worked_test():
    tested = {name[len("test_") : -len("_hand_worked")] for name in globals() if name.endswith("_hand_worked")}
    assert set(LOSSES) <= tested, set(LOSSES) - tested


# ---------------------------------------------------------------------------------------------
# Property tests at production shapes
# ---------------------------------------------------------------------------------------------

B = 64


def _random_batch(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    ct = torch.randint(1, 512, (B,), generator=g)
    rt = torch.randint(1, 512, (B,), generator=g)
    # summed log-probs: a per-token mean in [-3, -0.05] times the length
    pc = -(torch.rand(B, generator=g) * 2.95 + 0.05) * ct
    pr = -(torch.rand(B, generator=g) * 2.95 + 0.05) * rt
    rc = pc + torch.randn(B, generator=g) * 5
    rr = pr + torch.randn(B, generator=g) * 5
    pc, pr = pc.to(dtype).requires_grad_(), pr.to(dtype).requires_grad_()
    return pc, pr, rc.to(dtype), rr.to(dtype), ct, rt


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(LOSSES))
def test_properties_at_production_shapes(name, dtype):
    pc, pr, rc, rr, ct, rt = _random_batch(dtype)
    if not needs_reference(name):
        rc = rr = None
    losses, chosen_r, rejected_r = preference_loss(name, pc, pr, rc, rr, ct, rt)
    for out in (losses, chosen_r, rejected_r):
        assert out.shape == (B,)
        assert torch.isfinite(out).all()
    assert not chosen_r.requires_grad and not rejected_r.requires_grad
    assert losses.requires_grad
    losses.mean().backward()
    assert pc.grad is not None and pc.grad.dtype == dtype and torch.isfinite(pc.grad).all()
    if name != "sft":  # sft reads only the chosen completion
        assert pr.grad is not None and torch.isfinite(pr.grad).all()
        assert (pc.grad != 0).any() or name == "hinge"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sigmoid_equals_minus_logsigmoid_of_beta_margin(dtype):
    pc, pr, rc, rr, ct, rt = _random_batch(dtype, seed=1)
    losses, _, _ = preference_loss("sigmoid", pc, pr, rc, rr, ct, rt, beta=0.3, label_smoothing=0.0)
    margin = (pc.float() - rc.float()) - (pr.float() - rr.float())
    torch.testing.assert_close(losses, -F.logsigmoid(0.3 * margin).detach(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sigmoid_is_log2_when_policy_equals_reference(dtype):
    pc, pr, _, _, ct, rt = _random_batch(dtype, seed=2)
    losses, cr, rr = preference_loss("sigmoid", pc, pr, pc.detach(), pr.detach(), ct, rt)
    torch.testing.assert_close(losses, torch.full((B,), math.log(2.0)), rtol=0, atol=1e-6)
    assert (cr == 0).all() and (rr == 0).all()


def test_bf16_inputs_are_computed_in_float32():
    pc, pr, rc, rr, ct, rt = _random_batch(torch.bfloat16)
    losses, cr, _ = preference_loss("sigmoid", pc, pr, rc, rr, ct, rt)
    assert losses.dtype == torch.float32 and cr.dtype == torch.float32


def test_orpo_is_finite_when_the_chosen_is_certain():
    # average log-prob exactly 0: TRL's log1p(-exp(0)) = -inf gives a NaN gradient
    pc = torch.tensor([0.0, -3.0], requires_grad=True)
    pr = torch.tensor([-4.0, -1e-9], requires_grad=True)
    losses, _, _ = preference_loss("orpo", pc, pr, None, None, torch.tensor([3, 3]), torch.tensor([2, 2]))
    losses.sum().backward()
    assert torch.isfinite(losses).all() and torch.isfinite(pc.grad).all() and torch.isfinite(pr.grad).all()


def test_discopop_does_not_overflow_on_large_negative_margins():
    pc = torch.tensor([-5000.0, 0.0], requires_grad=True)
    pr = torch.tensor([0.0, -5000.0], requires_grad=True)
    zeros = torch.zeros(2)
    losses, _, _ = preference_loss("discopop", pc, pr, zeros, zeros, torch.ones(2), torch.ones(2), beta=1.0)
    losses.sum().backward()
    assert torch.isfinite(losses).all() and torch.isfinite(pc.grad).all()
    assert abs(losses[0].item() - 5000.0) < 1e-2  # -log sigma(-5000) ~= 5000, the modulation ~= 0


def test_token_counts_int_or_float_and_zero_clamped_to_one():
    pc, pr, rc, rr, ct, rt = _batch()
    a = preference_loss("ipo", pc, pr, rc, rr, ct, rt)[0]
    b = preference_loss("ipo", pc, pr, rc, rr, ct.double(), rt.float())[0]
    torch.testing.assert_close(a, b)
    zero = preference_loss("sft", pc, pr, None, None, torch.tensor([0, 0]), rt)[0]
    one = preference_loss("sft", pc, pr, None, None, torch.tensor([1, 1]), rt)[0]
    torch.testing.assert_close(zero, one)


# ---------------------------------------------------------------------------------------------
# Reference requirements
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_reference_none(name):
    pc, pr, _, _, ct, rt = _batch()
    if LOSSES[name].needs_reference:
        with pytest.raises(ValueError, match=name):
            preference_loss(name, pc, pr, None, None, ct, rt)
    else:
        losses, _, _ = preference_loss(name, pc, pr, None, None, ct, rt)
        assert losses.shape == (2,)


def test_needs_reference():
    assert {n for n in LOSSES if not needs_reference(n)} == {"simpo", "orpo", "sft"}
    assert needs_reference("sigmoid:1,sft:0.5")
    assert not needs_reference("simpo:1,sft:0.5")
    assert needs_reference(["sft", "ipo"])
    assert needs_reference(parse_loss_spec("sft,sigmoid"))


def test_reference_free_loss_ignores_a_given_reference():
    pc, pr, rc, rr, ct, rt = _batch()
    with_ref = preference_loss("simpo", pc, pr, rc, rr, ct, rt)[0]
    without = preference_loss("simpo", pc, pr, None, None, ct, rt)[0]
    torch.testing.assert_close(with_ref, without)


# ---------------------------------------------------------------------------------------------
# Combinations, RPO and specs
# ---------------------------------------------------------------------------------------------


def test_combination_is_weighted_sum_with_first_loss_rewards():
    sig_l, sig_cr, sig_rr = _run("sigmoid")
    sft_l, _, _ = _run("sft")
    for spec in ("sigmoid:1,sft:0.5", " sigmoid : 1.0 , sft : 0.5 ", ["sigmoid", "sft"],
                 [("sigmoid", 1), ("sft", 0.5)]):
        weights = [1.0, 0.5] if spec == ["sigmoid", "sft"] else None
        spec_obj = parse_loss_spec(spec, weights) if weights else spec
        losses, cr, rr = preference_loss(spec_obj, *_batch())
        torch.testing.assert_close(losses, sig_l + 0.5 * sft_l)
        torch.testing.assert_close(cr, sig_cr)
        torch.testing.assert_close(rr, sig_rr)
    # hand-worked: sigmoid + 0.5 * sft for example 0
    losses = _run("sigmoid:1,sft:0.5")[0]
    _close(losses[:1], [-logsig(0.15) + 0.5 * 10 / 5])
    # rewards follow the first loss of the spec
    _, cr, _ = _run("sft:0.5,sigmoid:1")
    _close(cr, _avg_rewards()[0])


def test_a_zero_weight_term_needs_no_reference_and_is_not_computed():
    # "sigmoid:0,simpo:1" made train build the reference cache for a term that adds nothing.
    assert not needs_reference("sigmoid:0,simpo:1")
    assert not parse_loss_spec([("ipo", 0), ("sft", 1)]).needs_reference
    pc, pr, _, _, ct, rt = _batch()
    losses, cr, rr = preference_loss("sigmoid:0,simpo:1", pc, pr, None, None, ct, rt)
    # SimPO (eq. 6) by hand at beta 0.1, gamma 0.5; rewards beta * average log-prob, SimPO's own
    logits = [BETA * p / c - BETA * q / r - 0.5 for p, q, c, r in zip(PC, PR, CT, RT)]
    _close(losses, [-logsig(z) for z in logits])
    _close(cr, [BETA * p / c for p, c in zip(PC, CT)])
    _close(rr, [BETA * q / r for q, r in zip(PR, RT)])


def test_combination_params_reach_each_loss():
    losses = _run("sigmoid,discopop", beta=0.5, discopop_tau=1.0, label_smoothing=0.1)[0]
    z, tau = 0.5 * 1.5, 1.0
    expected = (-0.9 * logsig(z) - 0.1 * logsig(-z)) + (-logsig(z) * (1 - sig(z / tau)) + math.exp(-z) * sig(z / tau))
    _close(losses[:1], [expected])


def test_rpo_alpha_adds_the_nll():
    base = _run("sigmoid")[0]
    losses = _run("sigmoid", rpo_alpha=0.5)[0]
    _close(losses, [base[0].item() + 0.5 * 10 / 5, base[1].item() + 0.5 * 20 / 8])
    # to any loss, including combinations
    base = _run("ipo:2,sft:1")[0]
    torch.testing.assert_close(_run("ipo:2,sft:1", rpo_alpha=1.0)[0],
                               base + torch.tensor([2.0, 2.5], dtype=base.dtype))


def test_parse_loss_spec_forms():
    assert parse_loss_spec("sigmoid").terms == (("sigmoid", 1.0),)
    assert parse_loss_spec("sigmoid:1.0,sft:0.5").terms == (("sigmoid", 1.0), ("sft", 0.5))
    assert parse_loss_spec("sigmoid,sft").terms == (("sigmoid", 1.0), ("sft", 1.0))
    assert parse_loss_spec(["sigmoid", "sft"], [1.0, 0.5]).terms == (("sigmoid", 1.0), ("sft", 0.5))
    assert parse_loss_spec("sigmoid,sft", [1.0, 0.5]).terms == (("sigmoid", 1.0), ("sft", 0.5))
    spec = parse_loss_spec("sigmoid:1,sft:0.5", beta=0.2)
    assert isinstance(spec, LossSpec) and str(spec) == "sigmoid:1,sft:0.5" and spec.params["beta"] == 0.2
    assert parse_loss_spec(spec, beta=0.3).params["beta"] == 0.3


def test_spec_params_are_used_and_call_params_override():
    spec = parse_loss_spec("sigmoid", beta=0.5)
    _close(preference_loss(spec, *_batch())[0][:1], [-logsig(0.5 * 1.5)])
    _close(preference_loss(spec, *_batch(), beta=1.0)[0][:1], [-logsig(1.0 * 1.5)])


def test_registry_entries_carry_their_defaults():
    assert all(entry.defaults["beta"] == 0.1 for entry in LOSSES.values())
    assert LOSSES["discopop"].defaults["discopop_tau"] == 0.05
    assert LOSSES["exo_pair"].defaults["label_smoothing"] == 1e-3
    assert LOSSES["simpo"].defaults["gamma"] == 0.5
    assert LOSSES["orpo"].defaults["orpo_alpha"] == 0.1
    for name, entry in LOSSES.items():
        doc = entry.fn.__doc__ or ""
        assert "arXiv" in doc and "(B,)" in doc, name
    # calling an entry directly fills the defaults
    pc, pr, rc, rr, ct, rt = _batch()
    losses, _, _ = LOSSES["sigmoid"](pc, pr, rc, rr, ct.double(), rt.double())
    _close(losses, [-logsig(0.15), -logsig(-0.25)])


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------


def test_unknown_loss_lists_known_ones():
    with pytest.raises(ValueError, match=r"unknown loss 'dpo'; did you mean 'sigmoid' \(DPO's loss, TRL's name for "
                                         r"it\)\? known losses: sigmoid, .*simpo"):
        _run("dpo")
    with pytest.raises(ValueError, match="unknown loss 'sftt'; did you mean 'sft'"):
        parse_loss_spec("sigmoid:1,sftt:0.5")
    with pytest.raises(ValueError, match="unknown loss 'DPO-norm'; did you mean 'dpo_norm'"):
        parse_loss_spec("DPO-norm")
    with pytest.raises(ValueError, match=r"^loss 'kto' is not offered: KTO trains on unpaired completions"):
        parse_loss_spec("kto")  # a method of the field that takes other data: said why, not "unknown"
    with pytest.raises(ValueError, match="unknown loss 'zzz'; known losses: sigmoid"):  # nothing close: no guess
        parse_loss_spec("zzz")
    with pytest.raises(ValueError, match="unknown loss"):
        needs_reference("nope")


def test_unknown_param_is_named():
    with pytest.raises(ValueError, match=r"unknown loss param\(s\) \['betta'\].*beta"):
        _run("sigmoid", betta=0.1)


@pytest.mark.parametrize(
    "spec, kwargs, match",
    [
        ("sigmoid:abc", {}, "not a number"),
        ("sigmoid:-1", {}, ">= 0"),
        ("sigmoid:nan", {}, "finite"),
        ("sigmoid,sigmoid", {}, "repeats"),
        ("sigmoid,", {}, "empty loss name"),
        ("sigmoid:1,sft:1", {"weights": [1, 2]}, "weights already"),
        (["sigmoid", "sft"], {"weights": [1.0]}, "1 weights given for 2 losses"),
        ([], {}, "non-empty"),
    ],
)
def test_bad_specs(spec, kwargs, match):
    with pytest.raises(ValueError, match=match):
        parse_loss_spec(spec, **kwargs)


@pytest.mark.parametrize(
    "name, params, match",
    [
        ("sigmoid", {"beta": 0.0}, "beta must be > 0"),
        ("ipo", {"beta": -1.0}, "beta must be > 0"),
        ("exo_pair", {"label_smoothing": 0.0}, r"exo_pair: label_smoothing .* \(0, 1\)"),
        ("robust", {"label_smoothing": 0.5}, r"robust: label_smoothing .* \[0, 0.5\)"),
        ("sigmoid", {"label_smoothing": 0.7}, "label_smoothing must be in"),
        ("discopop", {"discopop_tau": 0.0}, "discopop_tau must be > 0"),
        ("sigmoid", {"rpo_alpha": -1.0}, "rpo_alpha"),
        # non-finite params made every loss NaN or inf at the first step instead of failing here
        ("sigmoid", {"beta": math.inf}, "beta must be a finite number"),
        ("simpo", {"gamma": math.nan}, "simpo: gamma must be a finite number"),
        ("simpo", {"gamma": math.inf}, "simpo: gamma must be a finite number"),
        ("orpo", {"orpo_alpha": math.nan}, "orpo: orpo_alpha must be a finite number"),
        ("bco_pair", {"bco_delta": math.nan}, "bco_pair: bco_delta must be a finite number"),
        ("discopop", {"discopop_tau": math.inf}, "discopop: discopop_tau must be a finite number"),
        # a negative lambda maximises the odds-ratio term, as a negative loss weight would
        ("orpo", {"orpo_alpha": -1.0}, r"orpo: orpo_alpha .* >= 0"),
    ],
)
def test_bad_param_values(name, params, match):
    with pytest.raises(ValueError, match=match):
        _run(name, **params)


def test_bad_shapes():
    pc, pr, rc, rr, ct, rt = _batch()
    with pytest.raises(ValueError, match="same batch size"):
        preference_loss("sigmoid", pc, pr[:1], rc, rr, ct, rt)
    with pytest.raises(ValueError, match=r"shape \(B,\)"):
        preference_loss("sigmoid", pc[None], pr, rc, rr, ct, rt)


def test_none_param_means_the_loss_default():
    # a config can pass label_smoothing=None to every loss; exo_pair then gets its own 1e-3
    torch.testing.assert_close(_run("exo_pair", label_smoothing=None, beta=None)[0], _run("exo_pair")[0])
    torch.testing.assert_close(_run("sigmoid", rpo_alpha=None)[0], _run("sigmoid")[0])


def test_params_known_to_other_losses_are_ignored():
    torch.testing.assert_close(_run("sigmoid", gamma=3.0, discopop_tau=9.0)[0], _run("sigmoid")[0])


def test_inputs_on_other_devices_than_the_policy_are_named():
    """The cache's values come on the CPU; torch's own error named no argument."""
    pc, pr, rc, rr, ct, rt = _batch()
    with pytest.raises(ValueError, match=r"^all inputs must be on the policy's device \(meta\), got \{'ref_chosen': "
                       r"'cpu', 'ref_rejected': 'cpu', 'chosen_tokens': 'cpu', 'rejected_tokens': 'cpu'\}: move them "
                       r"there \(PairValues.to\(device\)"):
        preference_loss("sigmoid", pc.to("meta"), pr.to("meta"), rc, rr, ct, rt, beta=0.1)


def test_ld_pair_logps_takes_an_alpha_in_0_1():
    from dpocache.losses.formulas import ld_pair_logps

    logps, mask = torch.zeros(1, 3), torch.ones(1, 3)
    with pytest.raises(ValueError, match=r"^ld_alpha must be in \[0, 1\], got 1.5"):
        ld_pair_logps(logps, mask, logps, mask, 1.5)
