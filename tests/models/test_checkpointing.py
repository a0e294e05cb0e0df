"""Activation checkpointing and ``--checkpoint-keep`` (``dpocache.models.checkpointing``): a LoRA
model whose named frozen matrices keep their products through the recompute computes the same
loss and gradients as the fully checkpointed one, bit for bit, in fp32 under PEFT's forward and
in bf16 under the fused one, and runs exactly the named products' FLOPs fewer (counted by
torch's ``FlopCounterMode``, against the products' shapes); the kept products are released by
the backward, and by a forward whose backward never runs; one changed in place, and a second
backward through the same graph, stop with a named error; outside a checkpointed call the layer
is a plain product; ``train`` with it logs and saves what the fully checkpointed run does,
streamed or not (on CUDA, GPU-marked, within a GPU's rounding); bad uses are refused with one
line. ``--skip-unread-products``: in every family the table lists, the recompute without the
down projections' products gives full recomputation's gradients bit for bit, exactly those
products' FLOPs fewer; zeros in place of any other product, or in a family left out, change
them; a fully trained model and the routes it does not serve skip nothing."""

from __future__ import annotations

import gc
import types
import warnings
import weakref

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode, flop_registry
from train_fixtures import (  # noqa: F401 (fixtures)
    flags,
    load_tensors,
    run_json,
    run_training,
    train_jsonl,
    train_records,
)

from dpocache.models import checkpointing
from dpocache.models.checkpointing import checkpoint_phases, enable_checkpointing, kept_product_forward
from dpocache.models.tiny import save_tiny_model

LAYERS, HIDDEN, INTERMEDIATE, TOKENS = 3, 64, 128, 32


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("checkpoint-keep"), "llama", num_hidden_layers=4)


def _lora_llama(keep: tuple[str, ...], fused: bool):
    """A tiny Llama with every linear layer adapted (non-zero B, so the adapters count), its
    base stored in bf16 under the fused forward as ``load_policy`` stores it, checkpointed."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from dpocache.models.lora_fused import fuse_lora_updates_
    from dpocache.models.policy import keep_adapter_inputs_

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=LAYERS,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=256)
    model = get_peft_model(LlamaForCausalLM(config),
                           LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False))
    if fused:
        for module in model.modules():
            if type(module) is nn.Linear and not module.weight.requires_grad:
                module.weight.data = module.weight.data.bfloat16()
        keep_adapter_inputs_(model)
        fuse_lora_updates_(model)
    model.train()
    kept = enable_checkpointing(model, keep).kept
    model.enable_input_require_grads()
    return model, kept


def _step(model, fused: bool, device: str = "cpu") -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
    """A forward and backward: (loss, the adapters' gradients, the FLOPs of every ``aten.mm``)."""
    ids = torch.randint(0, 256, (2, TOKENS // 2), generator=torch.Generator().manual_seed(0)).to(device)
    # Attention counted as nothing: the products are what this counts, and torch's formula for
    # attention refuses the grouped key heads a GPU's SDPA takes as they are (enable_gqa).
    uncounted = {op: lambda *args, **kwargs: 0 for op in flop_registry if "attention" in str(op)}
    with FlopCounterMode(display=False, custom_mapping=uncounted) as counter:
        with torch.autocast(device, torch.bfloat16, enabled=fused):
            loss = model(input_ids=ids).logits.float().logsumexp(-1).mean()
        loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, counter.get_flop_counts()["Global"][torch.ops.aten.mm]


@pytest.mark.parametrize("fused", [False, True], ids=["peft-fp32", "fused-bf16"])
@pytest.mark.parametrize("keep", [("down_proj",), ("down_proj", "q_proj", "gate_proj")])
def test_kept_products_train_as_full_checkpointing_and_skip_exactly_their_products(fused, keep, monkeypatch):
    monkeypatch.setenv("DPOCACHE_BF16_MATMUL", "native")  # the native bf16 kernels, as on a GPU
    loss, grads, flops = _step(_lora_llama((), fused)[0], fused)
    model, kept = _lora_llama(keep, fused)
    kept_loss, kept_grads, kept_flops = _step(model, fused)
    assert len(kept) == LAYERS * len(keep) and all(name.endswith(".base_layer") for name in kept)
    assert torch.equal(kept_loss, loss)
    assert kept_grads.keys() == grads.keys() and len(grads) == LAYERS * 7 * 2
    assert all(torch.equal(kept_grads[name], grads[name]) for name in grads)
    shapes = {"down_proj": (INTERMEDIATE, HIDDEN), "q_proj": (HIDDEN, HIDDEN), "gate_proj": (HIDDEN, INTERMEDIATE)}
    skipped = sum(2 * TOKENS * shapes[name][0] * shapes[name][1] for name in keep) * LAYERS  # one forward's
    assert flops - kept_flops == skipped


def _family(model_type: str, lora: bool):
    """A tiny model of ``model_type`` from its config (every family here takes these sizes), in
    fp32, in training mode; with ``lora`` every linear layer adapted (both matrices drawn, so
    every adapter weight has a gradient), else every weight trained."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
                                  num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                                  head_dim=HIDDEN // 4, vocab_size=256)
    model = AutoModelForCausalLM.from_config(config)
    if lora:
        model = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False))
    return model.train()


def _checkpointed_step(model, skip_unread: bool = False) -> tuple[torch.Tensor, dict, int, list[str]]:
    """``_step`` of ``model`` checkpointed, skipping the unread products or not; with the
    qualified names of the layers that skip theirs."""
    products = enable_checkpointing(model, skip_unread=skip_unread)
    if hasattr(model, "enable_input_require_grads"):
        model.enable_input_require_grads()
    return (*_step(model, fused=False), products.skipped)


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "qwen3", "gemma"])
def test_the_recompute_skips_the_unread_products_with_the_same_gradients(model_type):
    """In every family ``UNREAD_PRODUCTS`` lists, a LoRA model's recompute that returns zeros for
    the frozen down projections gives the loss and every adapter's gradient of full
    recomputation bit for bit, and runs exactly their products' FLOPs fewer."""
    loss, grads, flops, _ = _checkpointed_step(_family(model_type, lora=True))
    skip_loss, skip_grads, skip_flops, skipped = _checkpointed_step(_family(model_type, lora=True), skip_unread=True)
    assert len(skipped) == LAYERS and all(name.endswith(".mlp.down_proj.base_layer") for name in skipped)
    assert torch.equal(skip_loss, loss)
    assert skip_grads.keys() == grads.keys() and len(grads) == LAYERS * 7 * 2
    assert all(torch.equal(skip_grads[name], grads[name]) for name in grads)
    assert flops - skip_flops == 2 * TOKENS * INTERMEDIATE * HIDDEN * LAYERS


def test_training_every_weight_skips_nothing_and_torch_stops_before_that_product():
    """Training every weight, no layer is given the skipping forward: the down projection saves
    its input for its own gradient, last in the layer, and torch's checkpoint stops its
    recompute there (early stop), before the product runs: the FLOPs of a step are those of a
    forward, the recompute without its down projections, and the backward."""
    model = _family("llama", lora=False)
    loss, grads, flops, skipped = _checkpointed_step(model, skip_unread=True)
    assert skipped == [] and all(type(m).forward is m.forward.__func__ for m in model.modules()
                                 if isinstance(m, nn.Linear))
    linear = sum(2 * TOKENS * a * b for a, b in [(HIDDEN, HIDDEN), (HIDDEN, HIDDEN // 2), (HIDDEN, HIDDEN // 2),
                                                 (HIDDEN, HIDDEN), (HIDDEN, INTERMEDIATE), (HIDDEN, INTERMEDIATE),
                                                 (INTERMEDIATE, HIDDEN)]) * LAYERS
    head = 2 * TOKENS * HIDDEN * 256
    down = 2 * TOKENS * INTERMEDIATE * HIDDEN * LAYERS
    assert flops == linear + (linear - down) + 2 * linear + 3 * head


@pytest.mark.parametrize("model_type,name", [("llama", n) for n in ("q_proj", "k_proj", "v_proj", "o_proj",
                                                                    "gate_proj", "up_proj")]
                         + [("gemma2", "down_proj"), ("olmo2", "down_proj")])
def test_zeros_in_place_of_any_other_product_change_the_gradients(model_type, name, monkeypatch):
    """What the table leaves out: every other product of a Llama layer is read by its backward,
    and so is the down projection's in families that normalise it before the residual sum
    (Gemma 2, OLMo 2), which the table does not list: forced to skip it, the gradients change.
    So the test above can fail."""
    loss, grads, _, _ = _checkpointed_step(_family(model_type, lora=True))
    model = _family(model_type, lora=True)
    assert checkpointing.unread_products(model) == (() if model_type != "llama" else ("down_proj",))
    monkeypatch.setitem(checkpointing.UNREAD_PRODUCTS, type(checkpointing.decoder_layers(model)[0]).__name__, (name,))
    skip_loss, skip_grads, _, skipped = _checkpointed_step(model, skip_unread=True)
    assert len(skipped) == LAYERS and torch.equal(skip_loss, loss)  # the forward is the same
    assert not all(torch.equal(skip_grads[n], grads[n]) for n in grads)


def test_a_bf16_run_routed_through_the_fp32_gemm_and_layers_compiled_whole_do_not_skip(monkeypatch):
    """On a CPU whose bf16 products take ``bf16_matmul``'s fp32 GEMM those layers keep that
    forward (a skipping one would run natively); in fp32, or with native bf16, they skip; not
    where the layers compile whole, their checkpoint inside the graph (``--compile on``
    without ``--stream-base``), and not when told."""
    from dpocache.config import Config
    from dpocache.models.policy import skips_unread_products

    cfg = Config()
    monkeypatch.setenv("DPOCACHE_BF16_MATMUL", "fp32-gemm")
    assert not skips_unread_products(cfg, torch.device("cpu"), torch.bfloat16)
    assert skips_unread_products(cfg, torch.device("cpu"), torch.float32)
    monkeypatch.setenv("DPOCACHE_BF16_MATMUL", "native")
    assert skips_unread_products(cfg, torch.device("cpu"), torch.bfloat16)
    cfg.model.compile = "on"
    assert not skips_unread_products(cfg, torch.device("cpu"), torch.float32)
    cfg.model.stream_base = True  # streamed, each layer's forward compiles inside its checkpoint
    assert skips_unread_products(cfg, torch.device("cpu"), torch.float32)
    cfg.model.skip_unread_products = False
    assert not skips_unread_products(cfg, torch.device("cpu"), torch.float32)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_kept_products_on_a_gpu_train_as_full_checkpointing():
    """On CUDA under bf16 autocast, with the fused forward: the same loss (the forward is the
    same), gradients within 1% (a GPU's attention backward sums in no fixed order), the named
    products' FLOPs fewer."""
    loss, grads, flops = _step(_lora_llama((), fused=True)[0].cuda(), True, "cuda")
    kept_loss, kept_grads, kept_flops = _step(_lora_llama(("down_proj",), fused=True)[0].cuda(), True, "cuda")
    assert torch.equal(kept_loss, loss)
    for name, grad in grads.items():
        assert (kept_grads[name] - grad).norm() <= 1e-2 * grad.norm(), name
    assert flops - kept_flops == 2 * TOKENS * INTERMEDIATE * HIDDEN * LAYERS


def test_kept_products_are_released_by_the_backward_and_by_a_forward_without_one(monkeypatch):
    refs = []
    real = checkpointing.Phase.keep

    def keep(self, module, product):
        real(self, module, product)
        refs.append(weakref.ref(self.store[module][-1][0]))  # the tensor kept

    monkeypatch.setattr(checkpointing.Phase, "keep", keep)
    model, _ = _lora_llama(("down_proj",), fused=False)
    ids = torch.randint(0, 256, (2, 8))
    model(input_ids=ids).logits.sum().backward()
    assert len(refs) == LAYERS
    gc.collect()
    assert all(ref() is None for ref in refs)
    refs.clear()
    logits = model(input_ids=ids).logits  # a forward whose backward never runs
    assert len(refs) == LAYERS and any(ref() is not None for ref in refs)
    del logits
    gc.collect()
    assert all(ref() is None for ref in refs)


def test_outside_a_checkpointed_call_the_product_is_plain(monkeypatch):
    model, _ = _lora_llama(("down_proj",), fused=False)
    plain, _ = _lora_llama((), fused=False)
    calls = []
    monkeypatch.setattr(checkpointing._KeptProduct, "apply", lambda *a: calls.append(a))
    ids = torch.randint(0, 256, (2, 8))
    model.eval(), plain.eval()  # transformers checkpoints in training only
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, plain(input_ids=ids).logits)
    model.train()
    with torch.no_grad():
        model(input_ids=ids)
    assert calls == []


def test_a_kept_product_changed_in_place_stops_the_backward():
    linear = nn.Linear(8, 8).requires_grad_(False)
    linear.forward = types.MethodType(kept_product_forward, linear)

    def block(x):
        y = linear(x)
        y.mul_(2)  # in place, after the product was kept
        return y.sum()

    x = torch.randn(4, 8, requires_grad=True)
    loss = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False, context_fn=checkpoint_phases)
    with pytest.raises(RuntimeError, match=r"--checkpoint-keep .*: a kept product was changed in place"):
        loss.backward()


def test_a_second_backward_through_the_same_graph_is_named():
    linear = nn.Linear(8, 8).requires_grad_(False)
    linear.forward = types.MethodType(kept_product_forward, linear)
    x = torch.randn(4, 8, requires_grad=True)
    loss = torch.utils.checkpoint.checkpoint(lambda t: linear(t).pow(2).sum(), x, use_reentrant=False,
                                             context_fn=checkpoint_phases)
    loss.backward(retain_graph=True)
    first = x.grad.clone()
    assert torch.equal(first, 2 * (linear(x) @ linear.weight).detach())  # grad @ W, from the kept product
    with pytest.raises(RuntimeError, match="a second backward through a checkpointed layer"):
        loss.backward()


def test_bf16_matmul_leaves_a_kept_layer_its_forward(monkeypatch):
    from dpocache.scoring import bf16_matmul

    model, kept = _lora_llama(("down_proj",), fused=False)
    count = bf16_matmul.install(model, "fp32-gemm")
    assert count == sum(type(m) is nn.Linear for m in model.modules()) - len(kept)
    downs = [m for name, m in model.named_modules() if name.endswith("down_proj.base_layer")]
    assert len(downs) == LAYERS and all(m.forward.__func__ is kept_product_forward for m in downs)


def test_a_name_no_decoder_layer_has_and_a_trained_matrix_are_refused():
    from transformers import LlamaConfig, LlamaForCausalLM

    from dpocache.config import ConfigError

    with pytest.raises(ConfigError, match=r"--checkpoint-keep .*: no linear layer named 'dwn_proj'.*q_proj, k_proj"):
        _lora_llama(("dwn_proj",), fused=False)
    full = LlamaForCausalLM(LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, vocab_size=64))
    with pytest.raises(ConfigError, match=r"--checkpoint-keep .*: model.layers.0.mlp.down_proj is trained"):
        enable_checkpointing(full, ("down_proj",))


@pytest.mark.parametrize("streamed,device", [(False, "cpu"), (True, "cpu"), pytest.param(True, "cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")])],
    ids=["resident", "streamed", "streamed-cuda"])
def test_train_with_kept_products_logs_and_saves_what_full_checkpointing_does(tmp_path, model_path,
                                                                           train_jsonl,  # noqa: F811
                                                                           monkeypatch, streamed, device):
    """``train --checkpoint-keep down_proj,o_proj`` through the whole loop: a bf16 LoRA run with
    its base stored in bf16 on native kernels, as on a GPU, logs the same values and saves the
    same adapter as the fully checkpointed run (``--skip-unread-products false``, keeping none),
    bit for bit, and so does the default run, whose recompute skips ``down_proj`` (the backward
    never reads it), and so do both together (``down_proj`` skipped, not kept); with the base
    streamed too (``--stream-base``, the CPU standing in for the GPU); run.json names what kept
    or skipped its products. On CUDA (the GPU suite's LoRA row: streamed, kept, Liger's kernels
    where installed) the losses within 1e-3 and the gradient norms within 5%, as a GPU's
    attention backward sums in no fixed order (Adam's first steps on that noise leave the
    adapters apart by up to a step of the learning rate)."""
    import dpocache.config as config_mod

    if device == "cpu":
        monkeypatch.setenv("DPOCACHE_BF16_MATMUL", "native")
        monkeypatch.setattr(config_mod, "_validate_streamed", lambda cfg, flag: None)  # past the device check
    runs = {}
    for keep, skip in [(keep, skip) for skip in ("false", "true") for keep in ("none", "down_proj,o_proj")]:
        out = tmp_path / f"run-{keep}-{skip}"
        run_training(*flags(model_path, train_jsonl, out, tmp_path / "cache", "--lora-r", "4",
                            "--dtype", "bfloat16", "--gradient-checkpointing", "true", "--max-steps", "3",
                            "--lr", "1e-2", "--checkpoint-keep", keep, "--skip-unread-products", skip,
                            "--stream-base", str(streamed), "--device", device,
                            "--kernels", "none" if device == "cpu" else "auto"))
        values = [{k: v for k, v in r.items() if k not in {"seconds", "tokens_per_s", "mfu"}}
                  for r in train_records(out)]
        runs[keep, skip] = (values, load_tensors(out / "final" / "adapter_model.safetensors"), run_json(out))
    want_values, want_adapter, want_info = runs["none", "false"]
    for values, adapter, info in runs.values():
        assert len(values) == 3 and adapter.keys() == want_adapter.keys()
        if device == "cpu":
            assert values == want_values
            assert all(torch.equal(adapter[k], want_adapter[k]) for k in adapter)
        else:  # the adapters themselves apart by more: Adam's first steps on bf16 rounding noise
            for got, want in zip(values, want_values):
                assert got["loss"] == pytest.approx(want["loss"], rel=1e-3), (got, want)
                assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=5e-2), (got, want)
        assert (info["policy"]["streamed"] is not None) == streamed
    products = {run: (info["policy"]["kept_products"], info["policy"]["skipped_products"])
                for run, (_, _, info) in runs.items()}
    down = {"names": ["down_proj"], "linear_layers": 4}
    assert products == {("none", "false"): (None, None),
                        ("down_proj,o_proj", "false"): ({"names": ["down_proj", "o_proj"], "linear_layers": 8}, None),
                        ("none", "true"): (None, down),
                        ("down_proj,o_proj", "true"): ({"names": ["o_proj"], "linear_layers": 4}, down)}


@pytest.mark.parametrize("extra,message", [
    (("--lora-r", "4"), "--gradient-checkpointing"),
    (("--gradient-checkpointing", "true"), "--lora-r"),
    (("--lora-r", "4", "--gradient-checkpointing", "true", "--compile", "on"), "--compile"),
])
def test_checkpoint_keep_is_refused_before_any_model_loads(cli, model_path, pref_jsonl, tmp_path, extra, message):
    rc, out, err = cli("train", "--model", model_path, "--data", pref_jsonl, "--output-dir", tmp_path / "run",
                       "--checkpoint-keep", "down_proj", *extra)
    assert rc == 2 and err.count("\n") == 1 and "--checkpoint-keep" in err and message in err, err
    assert not (tmp_path / "run").exists()


def test_a_bad_name_is_refused_with_one_line(cli, model_path, pref_jsonl, tmp_path):
    rc, out, err = cli("train", "--model", model_path, "--data", pref_jsonl, "--output-dir", tmp_path / "run",
                       "--lora-r", "4", "--gradient-checkpointing", "true", "--checkpoint-keep", "down-proj")
    assert rc == 2 and "--checkpoint-keep" in err and "'down-proj' is not a module name" in err
    assert "Traceback" not in err
    rc, out, err = cli("train", "--model", model_path, "--data", pref_jsonl, "--output-dir", tmp_path / "run2",
                       "--device", "cpu", "--lora-r", "4", "--gradient-checkpointing", "true",
                       "--checkpoint-keep", "dwn_proj", "--train.progress", "false")
    assert rc == 2 and "--checkpoint-keep" in err and "no linear layer named 'dwn_proj'" in err, err
    assert "Loading" not in err and err.count("\n") == 1, err  # before any model loads


def test_checkpointing_is_enabled_under_its_current_name():
    """transformers 5 renamed ``gradient_checkpointing_enable``, warning at each call of the old name."""
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, vocab_size=64))
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        assert enable_checkpointing(model) == ([], [], [])
    assert model.model.layers[0].gradient_checkpointing



def test_a_layer_called_with_another_forward_runs_its_hooks_and_keeps_its_own():
    """How the compiled checkpoint calls a layer that an earlier transformers hands over as its
    call: the layer's hooks around the forward given, and afterwards the layer's own forward
    again, a forward set on the layer itself (accelerate's) included."""
    from dpocache.models.checkpointing import _call_with_forward

    layer, seen = nn.Linear(2, 2), []
    layer.register_forward_pre_hook(lambda module, args: seen.append("pre"))
    layer.register_forward_hook(lambda module, args, out: seen.append("post"))
    given = lambda x: seen.append("forward") or x + 1  # noqa: E731
    assert torch.equal(_call_with_forward(layer, given, torch.zeros(2)), torch.ones(2))
    assert seen == ["pre", "forward", "post"] and "forward" not in layer.__dict__
    layer.forward = lambda x: torch.full_like(x, 7.0)  # as accelerate's hooks set one
    _call_with_forward(layer, given, torch.zeros(2))
    assert torch.equal(layer(torch.zeros(2)), torch.full((2,), 7.0))
