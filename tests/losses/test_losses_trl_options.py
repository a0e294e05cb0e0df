"""f-DPO, LD-DPO and WPO (dpocache.losses.formulas): hand-worked values of the papers' formulas, and
agreement with TRL 1.16's DPOTrainer formulas transcribed below (no TRL import needed)."""

import math

import pytest
import torch
import torch.nn.functional as F

from dpocache.config import build_config
from dpocache.losses.formulas import f_divergence_scores, ld_pair_logps, wpo_token_logps, wpo_weights
from dpocache.losses.registry import parse_loss_spec, preference_loss

ONE = torch.ones(1)


def _loss(name, pc, pr, rc, rr, ct=ONE, rt=ONE, **params):
    t = lambda v: torch.tensor([float(v)])  # noqa: E731
    return preference_loss(name, t(pc), t(pr), t(rc), t(rr), ct, rt, **params)


# chosen log-ratio +0.5, rejected log-ratio -0.5 in every f-DPO case below.
PAIR = (-1.0, -2.0, -1.5, -1.5)


def test_reverse_kl_is_dpo():
    # delta = 0.5 - (-0.5) = 1; -log sigma(1) = log(1 + e^-1) = 0.3132617
    losses, rc, rr = _loss("sigmoid", *PAIR, beta=1.0, f_divergence_type="reverse_kl")
    assert losses.item() == pytest.approx(0.3132617, abs=1e-6)
    assert (rc.item(), rr.item()) == pytest.approx((0.5, -0.5))


def test_forward_kl_hand_worked():
    # f'(u) = 1 - 1/u: chosen 1 - e^-0.5 = 0.3934693, rejected 1 - e^0.5 = -0.6487213;
    # delta = 1.0421906; -log sigma(delta) = log(1 + e^-1.0421906) = log(1.3526812) = 0.3020887
    losses, rc, rr = _loss("sigmoid", *PAIR, beta=1.0, f_divergence_type="forward_kl")
    assert losses.item() == pytest.approx(0.3020887, abs=1e-6)
    # rewards stay beta * log-ratio, not beta * score
    assert (rc.item(), rr.item()) == pytest.approx((0.5, -0.5))


@pytest.mark.parametrize("name, params", [("sigmoid", {}), ("sigmoid_norm", {}), ("hinge", {}), ("robust", {}),
                                          ("exo_pair", {}), ("exo_pair", {"label_smoothing": 0.2}), ("discopop", {})])
def test_forward_kl_far_below_the_reference_is_the_formulas_limit_not_nan(name, params):
    # A rejected log-ratio below -88.7 nats overflows float32's exp(-logratio) in f'(u) = 1 - 1/u:
    # the loss was NaN (0 * logsigmoid(-inf)) and the gradient 0 * inf = NaN, where the formula,
    # evaluated in float64 below, has a saturated loss and a gradient of 0.
    beta, counts = 0.1, (3.0, 4.0)
    lr = torch.tensor([[0.7, -100.0], [-2.0, -300.0]], dtype=torch.float64, requires_grad=True)  # (chosen, rejected)
    score = 1 - torch.exp(-lr)
    z = beta * (score[:, 0] - score[:, 1])
    eps = params.get("label_smoothing", 1e-3)
    expected = {
        "sigmoid": lambda: -F.logsigmoid(z), "robust": lambda: -F.logsigmoid(z), "hinge": lambda: torch.relu(1 - z),
        "sigmoid_norm": lambda: -F.logsigmoid(beta * (score[:, 0] / counts[0] - score[:, 1] / counts[1])),
        "exo_pair": lambda: (torch.sigmoid(z) * (F.logsigmoid(z) - math.log1p(-eps))
                             + torch.sigmoid(-z) * (F.logsigmoid(-z) - math.log(eps))),
        "discopop": lambda: (-F.logsigmoid(z) * torch.sigmoid(-z / 0.05)
                             + torch.sigmoid(z / 0.05) * torch.exp(-z)),
    }[name]()
    expected.sum().backward()
    policy = lr.detach().float().requires_grad_(True)  # reference sums 0: the policy sums are the log-ratios
    zeros, ct, rt = torch.zeros(2), torch.full((2,), counts[0]), torch.full((2,), counts[1])
    losses, _, _ = preference_loss(name, policy[:, 0], policy[:, 1], zeros, zeros, ct, rt, beta=beta,
                                   f_divergence_type="forward_kl", **params)
    losses.sum().backward()
    torch.testing.assert_close(losses.double(), expected.detach(), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(policy.grad.double(), lr.grad, atol=1e-6, rtol=1e-5)


def test_js_divergence_hand_worked():
    # f'(u) = log(2u/(1+u)) = log 2 + log sigma(lr); the log 2 cancels and
    # log sigma(x) - log sigma(-x) = x, so delta = 0.5 and the loss is -log sigma(0.5) = 0.4740770
    losses, _, _ = _loss("sigmoid", *PAIR, beta=1.0, f_divergence_type="js_divergence")
    assert losses.item() == pytest.approx(0.4740770, abs=1e-6)


def test_alpha_divergence_hand_worked():
    # TRL's coef c = 0.5: (u^(c-1) - 1)/(c-1) = 2 (1 - u^-0.5):
    # chosen 2 (1 - e^-0.25) = 0.4423984, rejected 2 (1 - e^0.25) = -0.5680508; delta = 1.0104493;
    # loss = log(1 + e^-1.0104493) = log(1.3640554) = 0.3104622
    losses, _, _ = _loss("sigmoid", *PAIR, beta=1.0, f_divergence_type="alpha_divergence",
                         f_alpha_divergence_coef=0.5)
    assert losses.item() == pytest.approx(0.3104622, abs=1e-6)
    # c = 1 is the log-u limit: plain DPO
    losses, _, _ = _loss("sigmoid", *PAIR, beta=1.0, f_divergence_type="alpha_divergence",
                         f_alpha_divergence_coef=1.0)
    assert losses.item() == pytest.approx(0.3132617, abs=1e-6)


def test_f_divergence_ipo_divides_scores_by_counts():
    # forward KL scores 0.3934693 / 2 tokens - (-0.6487213) / 4 tokens = 0.3589150;
    # IPO beta 0.5: (0.3589150 - 1)^2 = 0.4109900
    losses, _, _ = _loss("ipo", *PAIR, ct=torch.tensor([2.0]), rt=torch.tensor([4.0]), beta=0.5,
                         f_divergence_type="forward_kl")
    assert losses.item() == pytest.approx(0.4109900, abs=1e-6)


def _trl_scores(lr, f_type, coef):
    """TRL 1.16 DPOTrainer._compute_loss's score block, transcribed."""
    if f_type == "reverse_kl":
        return lr
    if f_type == "forward_kl":
        return 1 - torch.exp(-lr)
    if f_type == "js_divergence":
        return math.log(2) + F.logsigmoid(lr)
    if abs(coef - 1.0) < 1e-6:
        return lr
    return (torch.exp(torch.clamp((coef - 1.0) * lr, max=80.0)) - 1.0) * (1.0 / (coef - 1.0))


@pytest.mark.parametrize("f_type", ["reverse_kl", "forward_kl", "js_divergence", "alpha_divergence"])
@pytest.mark.parametrize("coef", [0.3, 0.5, 1.7])
def test_matches_trl_formulas(f_type, coef):
    g = torch.Generator().manual_seed(0)
    pc, pr, rc, rr = (-torch.rand(16, generator=g, dtype=torch.float64) * 20 for _ in range(4))
    ct, rt = torch.randint(1, 30, (16,), generator=g).double(), torch.randint(1, 30, (16,), generator=g).double()
    beta = 0.1
    sc, sr = _trl_scores(pc - rc, f_type, coef), _trl_scores(pr - rr, f_type, coef)
    delta = sc - sr
    trl = {
        "sigmoid": -F.logsigmoid(beta * delta),
        "hinge": torch.relu(1 - beta * delta),
        "ipo": (sc / ct - sr / rt - 1 / (2 * beta)) ** 2,
        "sigmoid_norm": -F.logsigmoid(beta * (sc / ct - sr / rt)),
    }
    for name, expected in trl.items():
        losses, _, _ = preference_loss(name, pc, pr, rc, rr, ct, rt, beta=beta, f_divergence_type=f_type,
                                       f_alpha_divergence_coef=coef)
        torch.testing.assert_close(losses, expected, rtol=1e-12, atol=1e-12)
    assert f_divergence_scores(pc - rc, f_type, coef).shape == (16,)


def test_f_divergence_rejects_losses_trl_rejects():
    with pytest.raises(ValueError, match="f_divergence_type='forward_kl' applies only"):
        _loss("nca_pair", *PAIR, f_divergence_type="forward_kl")
    with pytest.raises(ValueError, match="f_divergence_type must be one of"):
        _loss("sigmoid", *PAIR, f_divergence_type="kl")


def test_ld_dpo_hand_worked():
    # chosen 3 tokens (-1, -2, -3), rejected 2 tokens (-0.5, -0.5), right-padded; public length 2.
    policy_c = torch.tensor([[-1.0, -2.0, -3.0]])
    mask_c = torch.tensor([[1, 1, 1]])
    policy_r = torch.tensor([[-0.5, -0.5, 9.0]])  # the padded position's value must not count
    mask_r = torch.tensor([[1, 1, 0]])
    c, r = ld_pair_logps(policy_c, mask_c, policy_r, mask_r, ld_alpha=0.5)
    assert (c.item(), r.item()) == (-1 - 2 + 0.5 * -3, -1.0)  # -4.5, -1.0
    c1, r1 = ld_pair_logps(policy_c, mask_c, policy_r, mask_r, ld_alpha=1.0)
    assert (c1.item(), r1.item()) == (-6.0, -1.0)  # ld_alpha = 1: the plain sums
    c0, _ = ld_pair_logps(policy_c, mask_c, policy_r, mask_r, ld_alpha=0.0)
    assert c0.item() == -3.0  # ld_alpha = 0: the verbose token is masked out
    # Left padding: the k-th 1 of the mask is the k-th completion token.
    cl, _ = ld_pair_logps(torch.tensor([[7.0, -1.0, -2.0, -3.0]]), torch.tensor([[0, 1, 1, 1]]),
                          policy_r, mask_r, ld_alpha=0.5)
    assert cl.item() == -4.5
    # Reference (-1, -1, -1) and (-1, -1): -2.5 and -2. Log-ratios -2 and +1; beta 0.1:
    # -log sigma(0.1 * -3) = log(1 + e^0.3) = 0.8543552
    ref_c, ref_r = ld_pair_logps(-torch.ones(1, 3), mask_c, -torch.ones(1, 3), mask_r, ld_alpha=0.5)
    losses, _, _ = preference_loss("sigmoid", c, r, ref_c, ref_r, torch.tensor([3.0]), torch.tensor([2.0]),
                                   beta=0.1, ld_alpha=0.5)
    assert losses.item() == pytest.approx(0.8543552, abs=1e-6)


def test_ld_alpha_range():
    with pytest.raises(ValueError, match="ld_alpha"):
        _loss("sigmoid", *PAIR, ld_alpha=1.5)


def test_wpo_hand_worked():
    # Two-token vocabulary with probabilities (0.8, 0.2): sum p^2 = 0.68.
    logits = torch.log(torch.tensor([[0.8, 0.2], [0.8, 0.2]]))
    aligned = wpo_token_logps(logits, torch.tensor([0, 1]))
    assert aligned.tolist() == pytest.approx([math.log(0.8 / 0.68), math.log(0.2 / 0.68)], abs=1e-6)
    # Uniform distribution: every token is as likely as a self-sampled one, weight 1.
    assert wpo_token_logps(torch.zeros(3, 5), torch.tensor([0, 2, 4])).abs().max().item() < 1e-6
    # chosen = tokens (0, 1): geometric mean sqrt((0.8/0.68)(0.2/0.68)) = 0.5882353;
    # rejected = token 0: 0.8/0.68 = 1.1764706; w = 0.6920415
    ct, rt = torch.tensor([2.0]), torch.tensor([1.0])
    chosen, rejected = aligned.sum().reshape(1), aligned[:1]
    assert wpo_weights(chosen, rejected, ct, rt).item() == pytest.approx(0.6920415, abs=1e-6)
    # Policy = reference: DPO's log 2, times the weight: 0.4796866
    losses, _, _ = preference_loss("sigmoid", -ONE, -ONE, -ONE, -ONE, ct, rt, use_weighting=True,
                                   chosen_wpo_logps=chosen, rejected_wpo_logps=rejected)
    assert losses.item() == pytest.approx(math.log(2) * 0.6920415, abs=1e-6)


def test_wpo_needs_its_inputs_and_refuses_aot():
    with pytest.raises(ValueError, match="chosen_wpo_logps"):
        _loss("sigmoid", *PAIR, use_weighting=True)
    with pytest.raises(ValueError, match="aot"):
        _loss("aot", *PAIR, use_weighting=True)


@pytest.mark.parametrize("shape", [(1,), (4, 1), (3,)])
def test_wpo_sums_of_the_wrong_shape_are_one_clear_error(shape):
    # (1,) broadcast to every pair and (B, 1) made the (B,) losses (B, B), both silently
    b = 4
    sums = [torch.full((b,), -v) for v in (1.0, 2.0, 1.5, 2.5)]
    counts = torch.full((b,), 3.0)
    with pytest.raises(ValueError, match=r"shape \(B,\)|same batch size") as error:
        preference_loss("sigmoid", *sums, counts, counts, use_weighting=True,
                        chosen_wpo_logps=torch.zeros(shape), rejected_wpo_logps=torch.zeros(b))
    assert "chosen_wpo_logps" in str(error.value) and "\n" not in str(error.value)


def test_wpo_weight_has_no_gradient():
    pc = torch.tensor([-1.0], requires_grad=True)
    aligned = torch.tensor([-0.5], requires_grad=True)
    losses, _, _ = preference_loss("sigmoid", pc, -ONE, -ONE, -ONE, ONE, ONE, use_weighting=True,
                                   chosen_wpo_logps=aligned, rejected_wpo_logps=aligned)
    losses.sum().backward()
    assert aligned.grad is None and pc.grad is not None


def test_config_fields_under_trl_names():
    cfg = build_config(None, ["--loss.ld_alpha", "0.5", "--loss.use_weighting", "--loss.f_divergence_type",
                              "js_divergence", "--loss.f_alpha_divergence_coef", "0.3"])
    assert (cfg.loss.ld_alpha, cfg.loss.use_weighting) == (0.5, True)
    assert (cfg.loss.f_divergence_type, cfg.loss.f_alpha_divergence_coef) == ("js_divergence", 0.3)
    spec = parse_loss_spec(cfg.loss.name, **cfg.loss.params())
    assert spec.params["f_divergence_type"] == "js_divergence" and spec.params["ld_alpha"] == 0.5


# ------------------------------------------------------------------ LD-DPO in dpocache train

from train_fixtures import base_model, flags, one_thread, run_training, train_jsonl, train_records  # noqa: E402,F401


def _hf_token_logps(model, prompt, completion):
    """Per-token log-probs of ``completion`` after ``prompt`` by a plain Hugging Face forward."""
    ids = torch.tensor([list(prompt) + list(completion)])
    with torch.no_grad():
        logp = model(input_ids=ids).logits[0, :-1].float().log_softmax(-1)
    targets = ids[0, 1:]
    return logp.gather(-1, targets[:, None])[len(prompt) - 1:, 0]


def _ld_by_hand(tokens, shared, alpha):
    return float(sum(t for t in tokens[:shared]) + alpha * sum(t for t in tokens[shared:]))


@pytest.fixture(scope="module")
def other_reference(tmp_path_factory):
    from dpocache.models.tiny import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("ld-ref"), "llama", seed=1)


@pytest.mark.parametrize("layout", ["shared", "padded"])
def test_ld_dpo_first_step_loss(layout, tmp_path, base_model, pref_jsonl, other_reference):
    """Step 1's loss with --loss.ld_alpha 0.5 and a reference different from the policy equals
    LD-DPO computed independently: per-token log-probs by plain HF forwards, the public-length
    split written out per pair. The rows have completions of different lengths."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dpocache.data.order import training_order
    from dpocache.data.pairs import load_preference_data

    out = tmp_path / "run"
    run_training(*flags(base_model, pref_jsonl, out, tmp_path / "cache", "--ref-model", str(other_reference),
                        "--max-steps", "1", "--loss.ld_alpha", "0.5", "--train.layout", layout))
    loss = train_records(out)[0]["loss"]

    tokenizer = AutoTokenizer.from_pretrained(base_model)
    pairs = load_preference_data(str(pref_jsonl), tokenizer, 64, None, False, show_progress=False).pairs
    batch = [pairs[i] for i in training_order(len(pairs), 42, 0)[:4]]
    policy = AutoModelForCausalLM.from_pretrained(base_model, torch_dtype=torch.float32).eval()
    reference = AutoModelForCausalLM.from_pretrained(other_reference, torch_dtype=torch.float32).eval()
    expected = []
    for p in batch:
        shared = min(len(p.chosen_ids), len(p.rejected_ids))
        margin = 0.0
        for model, sign in ((policy, 1), (reference, -1)):
            c = _hf_token_logps(model, p.prompt_ids, p.chosen_ids).tolist()
            r = _hf_token_logps(model, p.prompt_ids, p.rejected_ids).tolist()
            margin += sign * (_ld_by_hand(c, shared, 0.5) - _ld_by_hand(r, shared, 0.5))
        expected.append(math.log1p(math.exp(-0.1 * margin)))
    assert any(len(p.chosen_ids) != len(p.rejected_ids) for p in batch)  # the tail weight matters
    assert loss == pytest.approx(sum(expected) / len(expected), abs=1e-5)
