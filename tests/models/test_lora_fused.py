"""A LoRA layer's update added inside ``lora_B``'s GEMM (``dpocache.models.lora_fused``): the
values of the LoRA formula (``base(x) + scaling * x A^T B^T``, computed here in float64) within
the compute dtype's rounding, as close as PEFT's own forward, with gradients; a fresh adapter
leaves the base's output exactly; no multiplication or addition of a whole output tensor is
left; calls it does not cover go to PEFT's forward; ``load_policy`` fuses under bf16 autocast only."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from train_fixtures import base_model, flags, load_tensors, run_training, train_jsonl, train_records  # noqa: F401

from dpocache.models import policy as policy_mod
from dpocache.models.lora_fused import fuse_lora_updates_, fused_lora_forward

IN, OUT, R, ALPHA = 48, 80, 4, 8


class SelectedOps(TorchDispatchMode):
    """The names of the aten ops run inside it that ``selects(func, args, kwargs, out)`` picks."""

    def __init__(self, selects):
        super().__init__()
        self.selects, self.names = selects, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.selects(func, args, kwargs, out):
            self.names.append(func.overloadpacket.__name__)
        return out


def _layer(fresh: bool = False, dtype=torch.float32):
    """One adapted linear layer (PEFT's), A and B random unless ``fresh`` (B zero)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    base = torch.nn.Sequential()
    base.add_module("proj", torch.nn.Linear(IN, OUT, bias=True))
    model = get_peft_model(base, LoraConfig(r=R, lora_alpha=ALPHA, target_modules=["proj"],
                                            init_lora_weights=fresh))
    model.to(dtype)
    for name, p in model.named_parameters():
        if "lora_" in name:
            p.data = p.data.float()  # the adapters in fp32, as dpocache trains them
    from peft.tuners.lora.layer import Linear

    return model, next(m for m in model.modules() if type(m) is Linear)


def _formula(layer, x):
    """``base(x) + scaling * x A^T B^T`` in float64, from the layer's weights."""
    w, b = layer.base_layer.weight.double(), layer.base_layer.bias.double()
    a, bb = layer.lora_A["default"].weight.double(), layer.lora_B["default"].weight.double()
    x = x.double()
    return x @ w.T + b + layer.scaling["default"] * (x @ a.T @ bb.T)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_update_is_the_lora_formula_as_close_as_pefts(dtype):
    model, layer = _layer(dtype=torch.float32 if dtype == torch.float32 else torch.bfloat16)
    x = torch.randn(2, 7, IN)
    want = _formula(layer, x.to(dtype))
    runs = {}
    for fused in (False, True):
        if fused:
            fuse_lora_updates_(model)
        x_in = x.clone().requires_grad_(True)
        with torch.autocast("cpu", dtype, enabled=dtype != torch.float32):
            out = model(x_in)
        (out.float() * torch.linspace(-1, 1, OUT)).sum().backward()
        grads = [x_in.grad] + [p.grad.clone() for p in model.parameters() if p.requires_grad]
        model.zero_grad()
        runs[fused] = (out.float(), grads)
    assert runs[True][0].shape == (2, 7, OUT)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    peft_err = (runs[False][0] - want).abs().max().item()
    fused_err = (runs[True][0] - want).abs().max().item()
    assert fused_err <= max(2 * peft_err, tol / 100) and fused_err < tol, (fused_err, peft_err)
    for a, b in zip(runs[True][1], runs[False][1], strict=True):
        torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol)


def test_a_fresh_adapter_leaves_the_base_output_exactly():
    """B is zero: the policy starts at the cached reference (the base), bit for bit."""
    model, layer = _layer(fresh=True, dtype=torch.bfloat16)
    fuse_lora_updates_(model)
    x = torch.randn(3, 5, IN)
    with torch.autocast("cpu", torch.bfloat16), torch.no_grad():
        assert torch.equal(model(x), layer.base_layer(x))
    with torch.autocast("cpu", torch.bfloat16), torch.inference_mode():  # inference tensors: no shared cast
        assert torch.equal(model(x), layer.base_layer(x))


def test_no_whole_output_tensor_is_scaled_or_added():
    """PEFT's forward and backward multiply and add whole ``(tokens, out)`` tensors; the fused
    ones do not (the update goes into the base's output in its GEMM)."""

    def whole_output(func, args, kwargs, out):  # a multiplication or addition of a (tokens, out) tensor
        return func.overloadpacket in (torch.ops.aten.mul, torch.ops.aten.add) and out.numel() >= 4 * 6 * OUT

    counts = {}
    for fused in (False, True):
        model, _ = _layer(dtype=torch.bfloat16)
        if fused:
            fuse_lora_updates_(model)
        x = torch.randn(4, 6, IN, requires_grad=True)
        mode = SelectedOps(whole_output)
        with mode, torch.autocast("cpu", torch.bfloat16):
            model(x).float().sum().backward()
        counts[fused] = mode.names
    assert counts[False]  # so that the count below could fail
    assert counts[True] == []


def test_calls_it_does_not_cover_go_to_pefts_forward():
    model, layer = _layer()
    fuse_lora_updates_(model)
    assert layer.forward.__func__ is fused_lora_forward
    x = torch.randn(2, 3, IN)
    with torch.no_grad():
        with model.disable_adapter():  # adapters off: the base alone
            assert torch.equal(model(x), layer.base_layer(x))
        mixed = layer(x, adapter_names=["default", "__base__"])  # PEFT's mixed-batch forward
        assert torch.allclose(mixed[0], _formula(layer, x)[0].float(), atol=1e-5)
        torch.testing.assert_close(mixed[1], layer.base_layer(x[1]))


@pytest.mark.parametrize("dtype,fused", [(torch.bfloat16, True), (torch.float32, False)], ids=["bf16", "fp32"])
def test_load_policy_fuses_under_bf16_autocast_only(base_model, monkeypatch, dtype, fused):  # noqa: F811
    from peft.tuners.lora.layer import Linear

    from dpocache.config import Config

    monkeypatch.setenv("DPOCACHE_BF16_MATMUL", "native")
    cfg = Config()
    cfg.model.path, cfg.lora.r = str(base_model), 4
    policy = policy_mod.load_policy(cfg, torch.device("cpu"), None, dtype)
    layers = [m for m in policy.modules() if type(m) is Linear]
    assert layers and {getattr(m.forward, "__func__", None) is fused_lora_forward for m in layers} == {fused}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_fused_update_is_the_lora_formula_as_close_as_pefts():
    """cuBLAS's GEMM with the update in its epilogue, under bf16 autocast: no farther from the
    float64 formula than PEFT's forward, with the same gradients within bf16 rounding."""
    outs = {}
    for fused in (False, True):
        model, layer = _layer(dtype=torch.bfloat16)
        model.cuda()
        if fused:
            fuse_lora_updates_(model)
        x = torch.randn(8, 64, IN, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
        with torch.autocast("cuda", torch.bfloat16):
            out = model(x.requires_grad_(True))
        out.float().sum().backward()
        outs[fused] = (out.float(), _formula(layer, x.detach().bfloat16()).float(), x.grad.float())
    peft_err = (outs[False][0] - outs[False][1]).abs().max()
    fused_err = (outs[True][0] - outs[True][1]).abs().max()
    assert fused_err <= 2 * peft_err + 1e-3
    torch.testing.assert_close(outs[True][2], outs[False][2], rtol=2e-2, atol=2e-2)


def test_an_input_shared_by_layers_is_cast_once_with_the_same_gradients(base_model, monkeypatch):  # noqa: F811
    """q, k and v (gate and up) take one normed fp32 input: the fused forward casts it to bf16
    once for all of them (``_compute_inputs``), where autocast cast it for each base layer and
    each ``lora_A``; outputs and every gradient are the same, bit for bit (each consumer's
    gradient still reaches the fp32 input on its own, and is summed there in fp32)."""
    from dpocache.config import Config
    from dpocache.models import lora_fused

    monkeypatch.setenv("DPOCACHE_BF16_MATMUL", "native")
    cfg = Config()
    cfg.model.path, cfg.lora.r = str(base_model), 4
    policy = policy_mod.load_policy(cfg, torch.device("cpu"), None, torch.bfloat16)
    for name, p in policy.named_parameters():  # a trained adapter: B not zero
        if "lora_B" in name:
            p.data.normal_(0, 0.02, generator=torch.Generator().manual_seed(len(name)))
    config = policy.config
    ids = torch.randint(0, config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    runs = {}
    for shared in (True, False):
        if not shared:  # $DPOCACHE_LORA_CAST=per-product, read at import
            monkeypatch.setattr(lora_fused, "CAST_ONCE", False)
        policy.zero_grad()
        mode = SelectedOps(lambda func, args, kwargs, out: func is torch.ops.aten._to_copy.default
                           and args[0].dtype == torch.float32 and kwargs.get("dtype") == torch.bfloat16
                           and args[0].numel() > config.hidden_size)  # fp32 -> bf16 casts of activations
        with mode, torch.autocast("cpu", torch.bfloat16):
            logits = policy(input_ids=ids).logits
        logits.float().logsumexp(-1).sum().backward()
        grads = [p.grad.clone() for p in policy.parameters() if p.requires_grad]
        runs[shared] = (len(mode.names), logits.detach(), grads)
    # per layer: the attention's input cast once instead of 6 times, the MLP's once instead of 4
    assert runs[False][0] - runs[True][0] == 8 * config.num_hidden_layers
    assert torch.equal(runs[True][1], runs[False][1])
    assert all(torch.equal(a, b) for a, b in zip(runs[True][2], runs[False][2], strict=True))


def test_a_lora_cast_mode_that_is_not_one_stops_the_command(tmp_path, base_model, train_jsonl, monkeypatch,  # noqa: F811
                                                            capsys):
    """``$DPOCACHE_LORA_CAST``: one line and status 2, before any model loads."""
    from dpocache.cli.entry import main

    monkeypatch.setenv("DPOCACHE_LORA_CAST", "twice")
    assert main(["train", "--model", str(base_model), "--data", str(train_jsonl), "--lora-r", "4",
                 "--output-dir", str(tmp_path / "run"), "--cache-dir", str(tmp_path / "c")]) == 2
    err = capsys.readouterr().err
    assert "$DPOCACHE_LORA_CAST must be once or per-product; got 'twice'" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "c").exists()


def test_checkpointed_lora_training_recomputes_the_same_values(tmp_path, base_model, train_jsonl,  # noqa: F811
                                                               monkeypatch):
    """bf16 LoRA training through the fused forward (its shared cast included) with gradient
    checkpointing, whose backward runs each layer's forward again: every logged value and the
    adapter after 3 steps are the run's without checkpointing, bit for bit."""
    monkeypatch.setenv("DPOCACHE_BF16_MATMUL", "native")
    timing = {"seconds", "tokens_per_s", "mfu"}
    runs = []
    for checkpointed in ("false", "true"):
        out = tmp_path / f"run-{checkpointed}"
        run_training(*flags(base_model, train_jsonl, out, tmp_path / "cache", "--lora-r", "4", "--max-steps", "3",
                            "--lr", "1e-2", "--dtype", "bfloat16", "--gradient-checkpointing", checkpointed))
        runs.append(([{k: v for k, v in r.items() if k not in timing} for r in train_records(out)],
                     load_tensors(out / "final" / "adapter_model.safetensors")))
    assert len(runs[0][0]) == 3 and runs[0][0] == runs[1][0]
    assert runs[0][1].keys() == runs[1][1].keys()
    assert all(torch.equal(runs[0][1][k], runs[1][1][k]) for k in runs[0][1])


def _compiled_run(model, x, dtype=torch.bfloat16):
    """``model`` compiled, called on ``x`` under ``dtype`` autocast and backward through a weighted
    sum: (output, [x's gradient, each trained parameter's], the compiled forward's code)."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    compiled = torch.compile(model)
    x_in = x.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype):
        out, codes = run_and_get_code(compiled, x_in)
    (out.float() * torch.linspace(-1, 1, OUT)).sum().backward()
    grads = [x_in.grad] + [p.grad.clone() for p in model.parameters() if p.requires_grad]
    model.zero_grad()
    return out.float(), grads, codes[0]


def test_a_compiled_layer_adds_the_update_into_the_product_it_made():
    """Compiled, the update's in-place ``addmm_`` would become an ``addmm`` into a new buffer that
    the product is first copied into; traced as ``dpocache::lora_linear``, it is added into the
    product the operation made, with the LoRA formula's values and PEFT's (eager) gradients."""
    model, layer = _layer(dtype=torch.bfloat16)
    x = torch.randn(2, 7, IN)
    want = _formula(layer, x.bfloat16())
    x_in = x.clone().requires_grad_(True)
    with torch.autocast("cpu", torch.bfloat16):
        peft_out = model(x_in).float()  # PEFT's forward, eager
    (peft_out * torch.linspace(-1, 1, OUT)).sum().backward()
    peft_grads = [x_in.grad] + [p.grad.clone() for p in model.parameters() if p.requires_grad]
    model.zero_grad()
    peft_err = (peft_out.detach() - want).abs().max().item()
    fuse_lora_updates_(model)
    out, grads, code = _compiled_run(model, x)
    assert "torch.ops.dpocache.lora_linear" in code and "addmm" not in code
    assert (out - want).abs().max().item() <= 2 * peft_err + 1e-3
    for got, expected in zip(grads, peft_grads, strict=True):
        torch.testing.assert_close(got.float(), expected.float(), rtol=2e-2, atol=2e-2)


def test_lora_linear_registration_holds_under_torch_checks():
    """The operation's schema, fake tensor and autograd formula, as torch's ``opcheck`` tests
    them (against the eager op, through autograd and AOT dispatch), in fp32 and bf16."""
    from dpocache.models import lora_fused  # noqa: F401  (registers the operation)

    gen = torch.Generator().manual_seed(3)
    for dtype in (torch.float32, torch.bfloat16):
        def rand(*shape, grad=True):
            return torch.randn(*shape, generator=gen, dtype=dtype).requires_grad_(grad)
        for bias in (None, rand(OUT, grad=False)):
            args = (rand(10, IN), rand(OUT, IN, grad=False), bias, rand(10, R), rand(OUT, R), 2.0, False)
            torch.library.opcheck(torch.ops.dpocache.lora_linear.default, args)


def test_lora_linear_gradients_are_the_formulas():
    """x's, h's and B's gradients against autograd through the float64 formula."""
    from dpocache.models import lora_fused  # noqa: F401

    gen = torch.Generator().manual_seed(4)
    x, w, bias = (torch.randn(*s, generator=gen, dtype=torch.float64) for s in ((9, IN), (OUT, IN), (OUT,)))
    h, b = (torch.randn(*s, generator=gen, dtype=torch.float64) for s in ((9, R), (OUT, R)))
    weights = torch.randn(9, OUT, generator=gen, dtype=torch.float64)
    results = []
    for op in (True, False):
        leaves = [t.clone().requires_grad_(True) for t in (x, h, b)]
        xi, hi, bi = leaves
        out = torch.ops.dpocache.lora_linear(xi, w, bias, hi, bi, 1.5, False) if op \
            else xi @ w.T + bias + 1.5 * hi @ bi.T
        (out * weights).sum().backward()
        results.append((out.detach(), [t.grad for t in leaves]))
    torch.testing.assert_close(results[0][0], results[1][0])
    for got, want in zip(results[0][1], results[1][1], strict=True):
        torch.testing.assert_close(got, want)


def test_an_unread_product_is_zeros_in_the_recompute_only():
    """``unread``: a checkpointed call's recompute gets zeros (nothing reads the output there);
    its forward, and a call outside any checkpoint, the product and update."""
    from dpocache.models.checkpoint_phases import checkpoint_phases

    gen = torch.Generator().manual_seed(5)
    x, w, h, b = (torch.randn(*s, generator=gen) for s in ((6, IN), (OUT, IN), (6, R), (OUT, R)))
    want = x @ w.T + 2.0 * h @ b.T
    forward, recompute = checkpoint_phases()
    with forward:
        torch.testing.assert_close(torch.ops.dpocache.lora_linear(x, w, None, h, b, 2.0, True), want)
    with recompute:
        assert torch.equal(torch.ops.dpocache.lora_linear(x, w, None, h, b, 2.0, True), torch.zeros(6, OUT))
        torch.testing.assert_close(torch.ops.dpocache.lora_linear(x, w, None, h, b, 2.0, False), want)
    torch.testing.assert_close(torch.ops.dpocache.lora_linear(x, w, None, h, b, 2.0, True), want)
